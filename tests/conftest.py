"""Tiny random HF models (no download), float64, every family and head layout."""

from __future__ import annotations

import pytest
import torch
import transformers

# Filled by tests/test_book.py's ``built_book`` fixture: {"seconds": build time, "notebooks": {name: seconds}}.
BOOK_BUILD = pytest.StashKey[dict]()

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # the SwiGLU families the book's hand rules are written for
ALL_FAMILIES = (*FAMILIES, "gemma2", "gemma3_text", "smollm3", "olmo2", "phi3",  # every family dpa supports:
                "gpt2", "gpt_neox")  # the autograd suite (test_families_autograd)
MHA_ONLY = ("gpt2", "gpt_neox")  # families whose configs have no KV-head setting
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
ALL_FAMILIES = (*ALL_FAMILIES, *MOE_FAMILIES)
LAYOUTS = {"mha": 4, "gqa": 2, "mqa": 1}  # KV heads for 4 query heads

_CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "gemma3_text": transformers.Gemma3TextConfig,
    "smollm3": transformers.SmolLM3Config,
    "olmo2": transformers.Olmo2Config,
    "gemma2": transformers.Gemma2Config,
    "phi3": transformers.Phi3Config,
    "gpt2": transformers.GPT2Config,
    "gpt_neox": transformers.GPTNeoXConfig,
    "mixtral": transformers.MixtralConfig,
    "qwen2_moe": transformers.Qwen2MoeConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "olmoe": transformers.OlmoeConfig,
    "gpt_oss": transformers.GptOssConfig,
}
_MODELS = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "gemma3_text": transformers.Gemma3ForCausalLM,
    "smollm3": transformers.SmolLM3ForCausalLM,
    "olmo2": transformers.Olmo2ForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
    "gpt2": transformers.GPT2LMHeadModel,
    "gpt_neox": transformers.GPTNeoXForCausalLM,
    "mixtral": transformers.MixtralForCausalLM,
    "qwen2_moe": transformers.Qwen2MoeForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "olmoe": transformers.OlmoeForCausalLM,
    "gpt_oss": transformers.GptOssForCausalLM,
}


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

    classes.append(modeling_phi3.Phi3RMSNorm)

    originals = [c.forward for c in classes]
    for c, f in zip(classes, originals):
        c.forward = _float64_rms_forward(f)
    for gemma in (modeling_gemma3.Gemma3RMSNorm, modeling_gemma2.Gemma2RMSNorm):
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
               modeling_qwen3_moe.Qwen3MoeTopKRouter, modeling_olmoe.OlmoeTopKRouter]
    classes, originals = classes + routers, originals + [r.forward for r in routers]
    for r in routers:  # the routers' softmax rounds to float32 too
        r.forward = _float64_router(r.forward)
    eager = modeling_gemma2.eager_attention_forward  # Gemma 2's softmax, too, rounds to float32
    modeling_gemma2.eager_attention_forward = _float64_eager(eager)
    yield
    modeling_gemma2.eager_attention_forward = eager
    for c, f in zip(classes, originals):
        c.forward = f


def _float64_router(original):
    """HF's top-k routers (softmax, top k, renormalised where the router says so) with float64 kept."""
    def forward(self, hidden_states):
        if hidden_states.dtype != torch.float64:
            return original(self, hidden_states)
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
            top = top / top.sum(-1, keepdim=True)
        return logits, top, index
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
    return forward


def tiny_config(family: str, kv_heads: int = 2, **overrides):
    kwargs = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-2, head_dim=8)
    if family == "mistral":
        kwargs["sliding_window"] = 5  # short enough to matter on the test prompts
    if family == "qwen2":
        kwargs.pop("head_dim")
    if family == "smollm3":  # the middle layer without RoPE (NoPE), as every fourth in SmolLM3
        kwargs.update(no_rope_layers=[1, 0, 1], pad_token_id=0, bos_token_id=1, eos_token_id=2)
        kwargs.pop("head_dim")  # SmolLM3 derives it (32 / 4 = 8, as for the others)
    if family == "olmo2":  # derives head_dim (32 / 4 = 8)
        kwargs.pop("head_dim")
        kwargs.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family in ("gemma3_text", "gemma2"):  # a local (sliding) layer between global ones; 1/sqrt(6) scaling
        kwargs.update(sliding_window=5, layer_types=["full_attention", "sliding_attention", "full_attention"],
                      query_pre_attn_scalar=6, pad_token_id=0)
    if family == "gemma2":  # soft-caps small enough to matter on tiny random weights
        kwargs.update(attn_logit_softcapping=1.5, final_logit_softcapping=2.0, bos_token_id=1, eos_token_id=2)
    if family == "phi3":  # derives head_dim; a rotary half of each head (partial_rotary_factor, as Phi-4-mini)
        kwargs.pop("head_dim")
        kwargs.update(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    if family in MOE_FAMILIES:  # four experts, two per token; Qwen2-MoE's shared expert; both router kinds
        kwargs.update(num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        kwargs["num_local_experts" if family == "mixtral" else "num_experts"] = 4
        if family not in ("mixtral", "gpt_oss"):
            kwargs.update(norm_topk_prob=family == "qwen3_moe")
        if family in ("qwen2_moe", "qwen3_moe"):
            kwargs.update(moe_intermediate_size=12)
        if family == "qwen2_moe":
            kwargs.update(shared_expert_intermediate_size=16)
            kwargs.pop("head_dim")
        if family == "olmoe":
            kwargs.pop("head_dim")
            kwargs.update(intermediate_size=12)
        if family == "gpt_oss":  # sliding and full layers, attention sinks, biases; a limit small enough to clamp
            kwargs.pop("num_experts")
            kwargs.update(num_local_experts=4, intermediate_size=12, swiglu_limit=0.3, sliding_window=5,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "gpt2":
        kwargs = dict(vocab_size=96, n_embd=32, n_inner=48, n_layer=3, n_head=4, n_positions=64,
                      bos_token_id=1, eos_token_id=2, layer_norm_epsilon=1e-2)
    if family == "gpt_neox":  # partial rotary (a quarter of each head, Pythia's), parallel residuals
        kwargs.pop("head_dim"), kwargs.pop("num_key_value_heads"), kwargs.pop("rms_norm_eps")
        kwargs.update(layer_norm_eps=1e-2, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    kwargs.update(overrides)
    return _CONFIGS[family](**kwargs)


def tiny_model(family: str, kv_heads: int = 2, seed: int = 0, **overrides):
    """A float64 model with every parameter random (norm gammas and biases too, so they are tested)."""
    torch.manual_seed(seed)
    config = tiny_config(family, kv_heads, **overrides)
    if family in MOE_FAMILIES:  # transformers' default, grouped_mm, has no float64 kernel
        config._experts_implementation = "eager"
    model = _MODELS[family](config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    model.requires_grad_(False)
    return model


@pytest.fixture(params=[(f, l) for f in FAMILIES for l in LAYOUTS], ids=lambda p: f"{p[0]}-{p[1]}")
def family_model(request):
    family, layout = request.param
    return tiny_model(family, LAYOUTS[layout])


def random_ids(n: int, vocab: int = 96, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


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
        lines.append(f"book built in {build['seconds']:.0f} s (jupyter-book build -W, every notebook executed); "
                     "slowest: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in slowest))
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
