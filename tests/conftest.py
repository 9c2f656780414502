"""Tiny random HF models (no download), float64, every family and head layout."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

# The book's exercise checks (dpa.exercises) raise on a wrong answer in this session's notebooks and the kernels
# nbmake starts from it: a reference solution that stops passing fails its chapter (an unanswered one never raises).
os.environ.setdefault("DPA_EXERCISES_STRICT", "1")

# Filled by tests/test_book.py's ``built_book`` fixture: {"seconds": build time, "notebooks": {name: seconds},
# "reused": names of notebooks whose nbmake run the build used}.
BOOK_BUILD = pytest.StashKey[dict]()
# Filled by the nbmake runs of this session (``_keep_nbmake_runs``): {absolute notebook path: executed notebook} for
# each notebook that ran without error, so that the book build shows those outputs instead of executing it again.
EXECUTED_NOTEBOOKS: dict = {}

from dpa.tiny import FAMILIES as ALL_FAMILIES  # noqa: F401  (every family dpa supports: the autograd suite)
from dpa.tiny import (HYBRID_FAMILIES, LAYOUTS, MHA_ONLY, MOE_FAMILIES, PARALLEL_FAMILIES, SCAN_FAMILIES,  # noqa: F401
                      SELECTIVE_FAMILIES, random_ids, tiny_config, tiny_model)

EDGE_HYBRIDS = HYBRID_FAMILIES  # hybrids whose edges dpa computes (MIB's graph too): all of them

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # the SwiGLU families the book's hand rules are written for


def _float64_rms_forward(original):
    def forward(self, hidden_states):
        if hidden_states.dtype != torch.float64:
            return original(self, hidden_states)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
    return forward


def _float64_gemma_rms_forward(original):
    def forward(self, x):
        if x.dtype != torch.float64:
            return original(self, x)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)
    return forward


@pytest.fixture(autouse=True, scope="session")
def float64_norms():
    """HF's RMSNorm rounds to float32 even in a float64 model; keep float64 so identities hold to 1e-12.

    Same arithmetic, more precision: this only removes float32 rounding noise that would
    otherwise hide errors of the order of a norm's eps."""
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.olmo2 import modeling_olmo2
    from transformers.models.smollm3 import modeling_smollm3

    classes = [modeling_llama.LlamaRMSNorm, modeling_mistral.MistralRMSNorm, modeling_qwen2.Qwen2RMSNorm,
               modeling_qwen3.Qwen3RMSNorm, modeling_smollm3.SmolLM3RMSNorm, modeling_olmo2.Olmo2RMSNorm]
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.phi3 import modeling_phi3

    from transformers.models.lfm2 import modeling_lfm2
    from transformers.models.bamba import modeling_bamba
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as modeling_granite

    from transformers.models.mamba2 import modeling_mamba2

    classes += [modeling_phi3.Phi3RMSNorm, modeling_lfm2.Lfm2RMSNorm, modeling_bamba.BambaRMSNorm,
                modeling_granite.GraniteMoeHybridRMSNorm, modeling_mamba2.Mamba2RMSNorm]

    originals = [c.forward for c in classes]
    for c, f in zip(classes, originals):
        c.forward = _float64_rms_forward(f)
    from transformers.models.qwen3_next import modeling_qwen3_next

    for gemma in (modeling_gemma3.Gemma3RMSNorm, modeling_gemma2.Gemma2RMSNorm, modeling_qwen3_next.Qwen3NextRMSNorm):
        classes, originals = classes + [gemma], originals + [gemma.forward]
        gemma.forward = _float64_gemma_rms_forward(gemma.forward)
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.olmoe import modeling_olmoe
    from transformers.models.qwen2_moe import modeling_qwen2_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from transformers.models.gpt_oss import modeling_gpt_oss

    moe_norms = [modeling_mixtral.MixtralRMSNorm, modeling_qwen2_moe.Qwen2MoeRMSNorm,
                 modeling_qwen3_moe.Qwen3MoeRMSNorm, modeling_olmoe.OlmoeRMSNorm, modeling_gpt_oss.GptOssRMSNorm]
    classes, originals = classes + moe_norms, originals + [c.forward for c in moe_norms]
    for c in moe_norms:
        c.forward = _float64_rms_forward(c.forward)
    routers = [modeling_mixtral.MixtralTopKRouter, modeling_qwen2_moe.Qwen2MoeTopKRouter,
               modeling_qwen3_moe.Qwen3MoeTopKRouter, modeling_olmoe.OlmoeTopKRouter,
               modeling_qwen3_next.Qwen3NextTopKRouter]
    classes, originals = classes + routers, originals + [r.forward for r in routers]
    for r in routers:  # the routers' softmax rounds to float32 too
        r.forward = _float64_router(r.forward)
    granite_router = modeling_granite.GraniteMoeHybridTopKRouter  # its logits cast to float32: the same code in
    classes, originals = classes + [granite_router], originals + [granite_router.forward]  # float64
    granite_router.forward = _keeping_float64(granite_router.forward)
    eager = modeling_gemma2.eager_attention_forward  # Gemma 2's softmax, too, rounds to float32
    modeling_gemma2.eager_attention_forward = _float64_eager(eager)
    from transformers.models.falcon_mamba import modeling_falcon_mamba
    from transformers.models.mamba import modeling_mamba

    from transformers.models.jamba import modeling_jamba

    jamba_router = modeling_jamba.JambaTopKRouter  # its softmax in float32; the top k weights not renormalised
    classes, originals = classes + [jamba_router], originals + [jamba_router.forward]
    jamba_router.forward = _float64_router(jamba_router.forward, renormalise=False)
    mamba_norms = [modeling_mamba.MambaRMSNorm, modeling_falcon_mamba.FalconMambaRMSNorm, modeling_jamba.JambaRMSNorm]
    classes, originals = classes + mamba_norms, originals + [c.forward for c in mamba_norms]
    for c in mamba_norms:
        c.forward = _float64_rms_forward(c.forward)
    weightless = modeling_falcon_mamba.FalconMambaWeightlessRMSNorm  # Falcon-Mamba's norms of B, C and the step's
    classes, originals = classes + [weightless], originals + [weightless.forward]  # input: x.float() in float64
    weightless.forward = _keeping_float64(weightless.forward)
    selective = (modeling_mamba, modeling_falcon_mamba, modeling_jamba)  # Mamba blocks: the torch scan casts B and x
    selective_scans = [module.mamba_selective_scan for module in selective]
    for module, scan in zip(selective, selective_scans):
        module.mamba_selective_scan = _keeping_float64(scan)
    scans = (modeling_bamba, modeling_granite, modeling_mamba2)  # Mamba-2 blocks: their gated norm and their whole
    for gated in (modeling_bamba.BambaRMSNormGated, modeling_granite.GraniteMoeHybridRMSNormGated,  # scan: float32
                  modeling_mamba2.MambaRMSNormGated):
        classes, originals = classes + [gated], originals + [gated.forward]
        gated.forward = _float64_gated_norm(gated.forward)
    chunk_scans = [module.mamba2_chunk_scan for module in scans]
    for module, scan in zip(scans, chunk_scans):
        module.mamba2_chunk_scan = _keeping_float64(scan)
    from transformers.models.nemotron_h import modeling_nemotron_h

    nemotron = modeling_nemotron_h.NemotronHRMSNorm  # Nemotron-H: its norms, its blocks' gated norm and scan in
    classes, originals = classes + [nemotron], originals + [nemotron.forward]  # float32
    nemotron.forward = _float64_rms_forward(nemotron.forward)
    nemotron_router = modeling_nemotron_h.NemotronHTopkRouter  # its logits cast to float32: the same code in float64
    classes, originals = classes + [nemotron_router], originals + [nemotron_router.forward]
    nemotron_router.forward = _float64_sigmoid_router(nemotron_router.forward)
    nemotron_gated = modeling_nemotron_h.NemotronHRMSNormGated
    classes, originals = classes + [nemotron_gated], originals + [nemotron_gated.forward]
    nemotron_gated.forward = _float64_gated_norm(nemotron_gated.forward)
    scans, chunk_scans = scans + (modeling_nemotron_h,), chunk_scans + [modeling_nemotron_h.mamba2_chunk_scan]
    modeling_nemotron_h.mamba2_chunk_scan = _keeping_float64(modeling_nemotron_h.mamba2_chunk_scan)
    from transformers.models.falcon_h1 import modeling_falcon_h1

    falcon = [modeling_falcon_h1.FalconH1RMSNorm, modeling_falcon_h1.FalconH1RMSNormGated]  # Falcon-H1: its norms,
    classes, originals = classes + falcon, originals + [c.forward for c in falcon]  # its blocks' gated norm (where
    for c in falcon:  # the config asks for one) and its scan in float32
        c.forward = _keeping_float64(c.forward)
    scans, chunk_scans = scans + (modeling_falcon_h1,), chunk_scans + [modeling_falcon_h1.mamba2_chunk_scan]
    modeling_falcon_h1.mamba2_chunk_scan = _keeping_float64(modeling_falcon_h1.mamba2_chunk_scan)
    delta_gated = modeling_qwen3_next.Qwen3NextRMSNormGated  # Gated DeltaNets: their gated norm and their whole
    classes, originals = classes + [delta_gated], originals + [delta_gated.forward]  # delta rule in float32
    delta_gated.forward = _keeping_float64(delta_gated.forward)
    delta_rule = modeling_qwen3_next.torch_chunk_gated_delta_rule
    modeling_qwen3_next.torch_chunk_gated_delta_rule = _keeping_float64(delta_rule)
    yield
    modeling_qwen3_next.torch_chunk_gated_delta_rule = delta_rule
    for module, scan in zip(scans, chunk_scans):
        module.mamba2_chunk_scan = scan
    for module, scan in zip(selective, selective_scans):
        module.mamba_selective_scan = scan
    modeling_gemma2.eager_attention_forward = eager
    for c, f in zip(classes, originals):
        c.forward = f


def _float64_gated_norm(original):
    """A Mamba-2 block's gated RMSNorm (``y * SiLU(z)``, normalised per group of channels) with float64 kept."""
    def forward(self, hidden_states, gate=None):
        if hidden_states.dtype != torch.float64:
            return original(self, hidden_states, gate)
        if gate is not None:
            hidden_states = hidden_states * torch.nn.functional.silu(gate.to(torch.float64))
        grouped = hidden_states.view(*hidden_states.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * grouped.flatten(-2)
    return forward


class _KeepFloat64(torch.overrides.TorchFunctionMode):
    """Inside it, a float64 tensor's casts to float32 (``.float()``, ``.to(torch.float32)``) are the identity: the same
    code, the same arithmetic, in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64 and (
                func is torch.Tensor.float or func is torch.Tensor.to and (
                    torch.float32 in args[1:] or kwargs.get("dtype") is torch.float32)):
            return args[0]
        return func(*args, **kwargs)


SCORES = ("token_scores", "head_scores", "neuron_scores", "expert_scores", "edge_scores")


def check_batch_lean_and_float32(model, target: int, float32: bool = True) -> None:
    """A padded batch of three prompts (11, 6 and 1 tokens) gives each prompt its scores alone (edges too), lean
    memory the full run's, and a float32 copy the float64 scores to float32's rounding: the per-family files of the
    hybrids call it on their tiny model."""
    import copy

    import dpa

    prompts = [random_ids(11, seed=1), random_ids(6, seed=2), random_ids(1, seed=3)]
    batch = dpa.attribute(model, None, prompts, target=target, edges=True)
    for p, res in zip(prompts, batch):
        alone = dpa.attribute(model, None, p, target=target, edges=True)
        for name in SCORES:
            if getattr(alone, name) is not None:
                torch.testing.assert_close(getattr(res, name), getattr(alone, name), rtol=1e-9, atol=1e-11)
        assert res.bias_share == pytest.approx(alone.bias_share, rel=1e-9, abs=1e-12)
    ids = random_ids(13)  # (not a multiple of a Mamba-2 block's chunk of 4)
    lean = dpa.attribute(model, None, ids, target=target, memory="lean")
    full = dpa.attribute(model, None, ids, target=target, memory="full")
    for name in SCORES[:4]:
        if getattr(full, name) is not None:
            torch.testing.assert_close(getattr(lean, name), getattr(full, name), rtol=1e-12, atol=1e-14)
    if float32:
        narrow = dpa.attribute(copy.deepcopy(model).float(), None, ids, target=target)
        for name in SCORES[:3]:
            torch.testing.assert_close(getattr(narrow, name).double(), getattr(full, name), rtol=1e-4, atol=1e-5)


def hf_logits(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """``model(ids).logits``; where the forward casts a float64 model's logits to float32 (Mamba-2's ``.float()``
    after its lm_head), the lm_head's output before that cast (checked to be what was cast)."""
    seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: seen.append(out))
    try:
        with torch.no_grad():
            logits = model(ids, **kwargs).logits
    finally:
        handle.remove()
    if logits.dtype != seen[-1].dtype:
        assert torch.equal(logits, seen[-1].to(logits.dtype))
        return seen[-1]
    return logits


def _keeping_float64(original):
    """A function of transformers' that casts float64 inputs to float32, run with float64 kept: the Mamba-2 chunked
    scan (``mamba2_chunk_scan``, which scans in float32 whatever the model's dtype), Granite's router's forward (its
    logits cast to float32). Whether to keep it is read from its first tensor argument."""
    def run(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or first.dtype != torch.float64:
            return original(*args, **kwargs)
        with _KeepFloat64():
            return original(*args, **kwargs)
    return run


def _float64_router(original, renormalise: bool = True):
    """HF's top-k routers (softmax, top k, renormalised where the router says so, never Jamba's) with float64 kept."""
    def forward(self, hidden_states):
        if hidden_states.dtype != torch.float64:
            return original(self, hidden_states)
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        if renormalise and getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
            top = top / top.sum(-1, keepdim=True)
        return logits, top, index
    return forward


def _float64_sigmoid_router(original):
    """Nemotron 3's router (DeepSeek-V3's: sigmoid scores, a correction bias and groups choosing the top k, the chosen
    scores renormalised and scaled) with float64 kept."""
    def forward(self, hidden_states):
        if hidden_states.dtype != torch.float64:
            return original(self, hidden_states)
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight.double())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.double()
        group = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(-1)
        mask = torch.zeros_like(group).scatter_(1, group.topk(self.topk_group, dim=-1, sorted=False)[1], 1)
        mask = mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(
            -1, self.num_experts)
        index = choice.masked_fill(~mask.bool(), float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
        top = scores.gather(1, index)
        if self.norm_topk_prob:
            top = top / (top.sum(-1, keepdim=True) + 1e-20)
        return logits, top * self.routed_scaling_factor, index
    return forward


def _float64_eager(original):
    """HF's eager attention (scores, soft-cap, mask, softmax) with the softmax kept in float64."""
    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
        if query.dtype != torch.float64:
            return original(module, query, key, value, attention_mask, dropout, scaling, softcap, **kwargs)
        from transformers.models.gemma2.modeling_gemma2 import repeat_kv

        groups = module.num_key_value_groups
        scores = query @ repeat_kv(key, groups).transpose(2, 3) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = scores.softmax(-1)
        return (weights @ repeat_kv(value, groups)).transpose(1, 2).contiguous(), weights
    forward.original = original
    return forward


@pytest.fixture(params=[(f, l) for f in FAMILIES for l in LAYOUTS], ids=lambda p: f"{p[0]}-{p[1]}")
def family_model(request):
    family, layout = request.param
    return tiny_model(family, LAYOUTS[layout])


def edited_run(model, ids, attn=None, neurons=None):
    """The base model's last hidden state for rows ``ids`` [rows pos] of one prompt, run through dpa's
    explicit attention with alpha (``attn``: layer -> keep) and GLU activations (``neurons``) edited;
    returns it with the recording (alpha per layer, GLU activations per layer)."""
    from dpa import request
    from dpa.instrument import instrument

    req = request.build(model, None, ids[0])
    with torch.no_grad(), instrument(model, req, explicit=True, attn_keep=attn or {}, neuron_keep=neurons or {},
                                     record={"neuron_inputs"}) as session:
        hidden = session.forward(input_ids=ids)
    return hidden, session.recording


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Speed is measured, not tested: print the book build's time and the slowest notebooks at the end of the run
    (under ``-q`` too, where the build fixture's own print is captured), so that CI's log shows them."""
    lines = []
    build = config.stash.get(BOOK_BUILD, None)
    if build:
        slowest = sorted(build["notebooks"].items(), key=lambda item: -item[1])[:5]
        executed = (f"{len(build['reused'])} notebooks shown from their nbmake run, {len(build['notebooks'])} executed"
                    if build["reused"] else "every notebook executed")
        lines.append(f"book built in {build['seconds']:.0f} s (jupyter-book build -W, {executed})"
                     + ("; slowest: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in slowest)
                        if slowest else ""))
    runs = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
            if getattr(r, "when", None) == "call" and r.nodeid.split("::")[0].endswith(".ipynb")]
    if runs:
        slowest = sorted(runs, key=lambda r: -r.duration)[:5]
        lines.append(f"{len(runs)} notebooks under nbmake in {sum(r.duration for r in runs):.0f} s; slowest: "
                     + ", ".join(f"{r.nodeid.split('::')[0].rsplit('/', 1)[-1]} {r.duration:.0f} s" for r in slowest))
    if lines:
        terminalreporter.write_sep("-", "book timings")
        for line in lines:
            terminalreporter.write_line(line)


# The benchmark data (../shared/data next to the repository, or $DPA_DATA; dpa.evaluate.find_data_dir). A test that
# reads it takes the ``benchmark_data`` fixture: a missing folder fails that test, naming the path, so that
# `bash .ci/test` never passes without having run them; `--no-data` skips them on purpose, and says so at the end.
NO_DATA_REASON = "--no-data: benchmark data tests skipped on purpose"


def pytest_addoption(parser):
    parser.addoption("--no-data", action="store_true",
                     help="skip the tests that read the benchmark data (../shared/data or $DPA_DATA) on purpose, "
                          "with a summary line; without it a missing data folder fails them")


def pytest_configure(config):
    config.pluginmanager.register(_DataSummary(), "dpa-benchmark-data-summary")
    _keep_nbmake_runs()


def _keep_nbmake_runs():
    """Every notebook runs once per test session: nbmake executes it (its asserts are the test) and the book build
    (tests/test_book.py) takes that executed copy from EXECUTED_NOTEBOOKS instead of executing it a second time. A
    notebook nbmake did not run in this session (``pytest tests/test_book.py`` alone) or that failed is executed by
    the build as usual."""
    try:
        from nbmake.nb_run import NotebookRun
    except ImportError:  # without nbmake the build executes everything
        return
    if getattr(NotebookRun.execute, "_dpa_keeps_runs", False):
        return
    execute = NotebookRun.execute

    def keep(self):
        result = execute(self)
        if result.error is None:
            EXECUTED_NOTEBOOKS[str(self.filename.resolve())] = result.nb
        return result

    keep._dpa_keeps_runs = True
    NotebookRun.execute = keep


def pytest_collection_modifyitems(config, items):
    """The tests that read the built book run after the notebooks, so that the build can reuse their runs."""
    def reads_book(item):
        return "built_book" in getattr(item, "fixturenames", ())
    items[:] = [i for i in items if not reads_book(i)] + [i for i in items if reads_book(i)]


@pytest.fixture
def benchmark_data(request):
    """The folder holding the benchmark data files; fails naming the path when it is missing (skips under
    --no-data)."""
    import os
    from pathlib import Path

    from dpa.evaluate import DataError, find_data_dir

    if request.config.getoption("--no-data"):
        pytest.skip(NO_DATA_REASON)
    try:
        return find_data_dir()
    except DataError as err:
        if os.environ.get("DPA_DATA"):
            problem = f"DPA_DATA={os.environ['DPA_DATA']} is not a folder"
        else:
            default = Path(__file__).resolve().parents[1].parent / "shared" / "data"
            problem = f"{default} is not a folder ({' '.join(str(err).split())})"
        pytest.fail(f"benchmark data missing: {problem}. Put the data there or set DPA_DATA=DIR, or pass --no-data "
                    "(bash .ci/test --no-data) to skip the data tests on purpose", pytrace=False)


class _DataSummary:
    """The end-of-run line that says how many data tests --no-data skipped (under -q too)."""

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        skipped = [r for r in terminalreporter.stats.get("skipped", [])
                   if isinstance(r.longrepr, tuple) and NO_DATA_REASON in str(r.longrepr[2])]
        if skipped:
            terminalreporter.write_sep("!", f"{len(skipped)} benchmark data tests skipped because of --no-data "
                                            "(they were not run: their results are unchecked)", yellow=True)
