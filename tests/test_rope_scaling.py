"""Every RoPE scaling dpa accepts (``families.ROPE_TYPES``), on every family with rotary positions whose
transformers config takes it, against autograd; and a prompt's scores independent of its batch where the rotary
frequencies depend on the prompt's length (LongRoPE, dynamic NTK: ``families.LENGTH_DEPENDENT_ROPE``).

Each case is a tiny float64 model of the family with the scaling set so that it acts on the test prompt: the
prompt (``N`` tokens) is longer than ``original_max_position_embeddings`` (``ORIGINAL``), so that YaRN's and
Llama 3's ramps, LongRoPE's long factors and dynamic NTK's rescaled base all apply (dynamic NTK rescales beyond
``max_position_embeddings``, set to ``ORIGINAL`` for it). The scaling demonstrably changes the model's logits;
then, as ``test_families_autograd`` checks the unscaled models: the forward oracle (the instrumented forward's
logits are the model's), the explicit attention path reproduces the model on a padded batch, each path alone
and the default weights equal autograd through the linearised model, and completeness under conservative
weights: every path alone where the family's released models use the scaling (``USED``), the default weights
and the query and key paths alone (the two through the RoPE transpose) elsewhere. transformers' Phi-3 config takes
LongRoPE alone (besides unscaled RoPE), so Phi-3 is tested with LongRoPE.
"""

from __future__ import annotations

import json

import pytest
import torch

import dpa
from dpa import request
from dpa.families import ROPE_TYPES, context_length, rope_settings
from dpa.instrument import instrument, logits_at
from dpa.linearise import Scores

from .conftest import ALL_FAMILIES, FAMILIES, random_ids, tiny_config, tiny_model
from dpa.rules.hand import hand_attribute
from .test_families_autograd import PATHS, TARGET, autograd_scores, path_weights, pre_cap_logits

ORIGINAL = 16  # original_max_position_embeddings (and max_position_embeddings for dynamic NTK)
N = 24  # tokens of the test prompt: past ORIGINAL, so that every scaling acts
SHORT = 11  # a prompt under ORIGINAL (LongRoPE's short factors, dynamic NTK's unscaled base)
KINDS = tuple(k for k in ROPE_TYPES if k != "default")
ROTARY = tuple(f for f in ALL_FAMILIES if f != "gpt2")  # GPT-2 has learned positions, no RoPE
CASES = [(f, k) for f in ROTARY for k in KINDS if f != "phi3" or k == "longrope"]
# The scalings released models of the family use (Llama 2 fine-tunes, Llama 3.x; Qwen 2.5 and Qwen 3's YaRN for
# long context; Gemma 3's linear scaling on its global layers; SmolLM3's YaRN; Phi-3's LongRoPE; GPT-OSS's YaRN):
# every path alone there; elsewhere the default weights and the two paths through the RoPE transpose (query, key)
USED = {("llama", "linear"), ("llama", "dynamic"), ("llama", "yarn"), ("llama", "llama3"), ("qwen2", "yarn"),
        ("qwen3", "yarn"), ("qwen3_moe", "yarn"), ("gemma3_text", "linear"), ("smollm3", "yarn"),
        ("phi3", "longrope"), ("gpt_oss", "yarn")}


def _rotary_features(family: str) -> tuple[int, float | None]:
    """(rotated features per head, partial_rotary_factor) of the family's tiny model."""
    cfg = tiny_config(family)
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # GPT-NeoX: half of each head, not Pythia's quarter: 2 features leave dynamic NTK's exponent d / (d - 2) undefined
    partial = 0.5 if family == "gpt_neox" else rope_settings(cfg)[0].get("partial_rotary_factor")
    return int(d_head * (partial or 1.0)), partial


def scaling(family: str, kind: str) -> dict:
    """The RoPE parameters of one case: each type as its released models set it, lengths shrunk to ORIGINAL."""
    d_rot, partial = _rotary_features(family)
    rope = {"rope_type": kind, "rope_theta": 10000.0}
    if kind == "linear":
        rope.update(factor=4.0)
    elif kind == "dynamic":
        rope.update(factor=2.0)
    elif kind == "yarn":  # GPT-OSS's as released: beta_fast 32, beta_slow 1, no truncation
        rope.update(factor=4.0, original_max_position_embeddings=ORIGINAL, beta_fast=32.0, beta_slow=1.0)
        if family == "gpt_oss":
            rope.update(truncate=False)
    elif kind == "llama3":
        rope.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=ORIGINAL)
    elif kind == "longrope":  # short factors under ORIGINAL tokens, long ones beyond (Phi-3, Phi-3.5, Phi-4-mini)
        rope.update(short_factor=[1.0 + 0.25 * i for i in range(d_rot // 2)],
                    long_factor=[2.0 + 1.5 * i for i in range(d_rot // 2)], original_max_position_embeddings=ORIGINAL)
    if partial is not None:
        rope["partial_rotary_factor"] = partial
    return rope


def overrides(family: str, kind: str | None) -> dict:
    """tiny_model's config overrides for one case (``kind=None``: the same model with unscaled RoPE)."""
    _, partial = _rotary_features(family)
    rope = scaling(family, kind) if kind else {"rope_type": "default", "rope_theta": 10000.0,
                                                **({"partial_rotary_factor": partial} if partial else {})}
    out = {"rope_parameters": rope}
    if family == "gemma3_text":  # RoPE per layer type: the scaling on the global layers, as Gemma 3's linear one;
        plain = {"rope_type": "default", "rope_theta": 10000.0}  # dynamic NTK on both (the context it extends is
        out["rope_parameters"] = {"full_attention": rope,  # the whole model's: families.context_length)
                                  "sliding_attention": rope if kind == "dynamic" else plain}
    if kind == "dynamic" or kind is None:
        out["max_position_embeddings"] = ORIGINAL if kind == "dynamic" else 64
    if family == "phi3":  # Phi-3 keeps the pretraining length at the top of its config, which takes precedence
        out["original_max_position_embeddings"] = ORIGINAL
    return out


def build(family: str, kind: str | None):
    """A fresh model of the case: transformers' dynamic NTK keeps the longest length it has seen, so references
    for the length-dependent types are computed on a model no other call has run."""
    return tiny_model(family, 2, **overrides(family, kind))


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def case(request):
    family, kind = request.param
    return family, kind, build(family, kind)


def test_the_scaling_changes_the_logits(case):
    """The test can fail: on the prompt, the scaled model's logits are not the unscaled model's."""
    family, kind, _ = case
    ids = random_ids(N)
    scaled, plain = build(family, kind)(ids[None]).logits, build(family, None)(ids[None]).logits
    assert (scaled - plain).abs().max() > 1e-3
    assert N <= context_length(build(family, kind).config)


def test_the_instrumented_forward_is_the_models(case):
    family, kind, model = case
    ids = random_ids(N)
    req = request.build(model, None, ids, TARGET)
    spec = req.spec
    scores = Scores.empty(spec, 1, len(ids), torch.float64, req.device, False)
    with instrument(model, req, weights=dpa.PathWeights(), scores=scores, lean=False) as session:
        hidden = session.forward()
    ours, theirs = spec.unembed(model)(hidden), pre_cap_logits(build(family, kind), ids)
    if spec.n_experts == 0:  # the model's own modules and rotary on the same inputs: bit for bit
        assert torch.equal(ours, theirs)
    else:  # dpa runs the experts itself: the same sums in another order
        torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-13)


def test_the_explicit_attention_path_reproduces_the_model(case):
    """dpa's recomputation of alpha with the recorded (cos, sin), on a padded batch of a prompt past ORIGINAL
    and one under it: each row gives the model's logits for that prompt alone."""
    family, kind, model = case
    prompts = [random_ids(N, seed=1), random_ids(SHORT, seed=2)]
    req = request.build(model, None, prompts)
    with torch.no_grad(), instrument(model, req, explicit=True) as session:
        ours = logits_at(model, req, session.forward())
    for b, p in enumerate(prompts):
        torch.testing.assert_close(ours[b], build(family, kind)(p[None]).logits[0, -1], rtol=1e-10, atol=1e-10)


def test_each_path_alone_and_the_default_equal_autograd(case):
    """DPA equals the autograd gradient of the linearised model (the model's own modules, its own rotary)."""
    family, kind, model = case
    ids = random_ids(N)
    for path in PATHS if (family, kind) in USED else ("query", "key", "default"):
        mu = path_weights(model, path)
        if mu is None:
            continue
        res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(*mu))
        tokens, heads, neurons, positions, experts = autograd_scores(build(family, kind), ids, mu)
        torch.testing.assert_close(res.token_scores, tokens, rtol=1e-9, atol=1e-11, msg=path)
        torch.testing.assert_close(res.head_scores, heads, rtol=1e-9, atol=1e-11, msg=path)
        torch.testing.assert_close(res.neuron_scores, neurons, rtol=1e-9, atol=1e-11, msg=path)
        if experts is not None:
            torch.testing.assert_close(res.expert_scores, experts, rtol=1e-9, atol=1e-11, msg=path)


def test_completeness_under_conservative_weights(case):
    family, kind, model = case
    ids = random_ids(N)
    moe = (0, 1) if dpa.spec_for(model).n_experts else ()
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5, *moe))
    assert res.weights.conservative
    logit = pre_cap_logits(build(family, kind), ids)[0, -1, TARGET].item()
    assert res.target_logit == pytest.approx(logit, rel=1e-12, abs=1e-12)
    total = float(res.token_scores.sum()) + res.position_share + res.bias_share
    assert total == pytest.approx(logit, rel=1e-8, abs=1e-10)


@pytest.mark.parametrize("family,kind", [(f, k) for f, k in CASES if f in FAMILIES])
def test_the_hand_rules_with_the_models_rotary(family, kind):
    """The book's hand rules (RoPE transpose with the module's cos/sin), chained top-down, give DPA's scores."""
    model = build(family, kind)
    ids = random_ids(N)
    res = dpa.attribute(model, None, ids, target=TARGET, edges=True)
    hand = hand_attribute(build(family, kind), dpa.spec_for(model), ids, TARGET, mu=PATHS["default"])
    for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores"):
        torch.testing.assert_close(getattr(res, name), getattr(hand, name), rtol=1e-9, atol=1e-11, msg=name)


# --- batch = single where the rotary depends on the prompt's length ---

# LongRoPE on Phi-3 (partial rotary, as Phi-4-mini) and on Gemma 3's global layers; dynamic NTK on Llama and
# Qwen 2 (the frequencies change with every length past max_position_embeddings, not only across a threshold)
LENGTH_DEPENDENT = [("phi3", "longrope"), ("gemma3_text", "longrope"), ("llama", "dynamic"), ("qwen2", "dynamic")]
LENGTHS = (10, 24, 19, 30)  # under ORIGINAL, past it, past it by another length, and the longest


def same(a: dpa.Attribution, b: dpa.Attribution, tol: float = 1e-10) -> None:
    assert a.token_ids == b.token_ids and a.target.position == b.target.position
    for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores"):
        x, y = getattr(a, name), getattr(b, name)
        if x is not None or y is not None:
            torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=name)
    assert a.target_logit == pytest.approx(b.target_logit, rel=tol, abs=tol)


@pytest.mark.parametrize("family,kind", LENGTH_DEPENDENT)
def test_a_batch_gives_each_prompt_its_single_result(family, kind):
    """transformers takes the frequencies from the longest prompt of a padded batch; dpa gives every prompt the
    rotary it gets alone, whatever its batch-mates and whatever ran before."""
    prompts = [random_ids(n, seed=n) for n in LENGTHS]
    model = build(family, kind)
    req = request.build(model, None, prompts)  # the test can fail: the model's own padded forward mixes them
    with torch.no_grad():
        own = model(req.input_ids, attention_mask=req.mask.long(), position_ids=req.position_ids).logits
    alone = torch.stack([build(family, kind)(p[None]).logits[0, -1] for p in prompts])
    assert not torch.allclose(own[torch.arange(len(prompts)), req.positions], alone, rtol=1e-6, atol=1e-6)

    batch = dpa.attribute(model, None, prompts, target=TARGET, edges=True)
    lean = dpa.attribute(model, None, prompts, target=TARGET, edges=True, memory="lean")  # layers run again
    for p, b, c in zip(prompts, batch, lean):
        same(c, b)
        same(b, dpa.attribute(build(family, kind), None, p, target=TARGET, edges=True))  # on a fresh model
        same(b, dpa.attribute(model, None, p, target=TARGET, edges=True))  # after the batch and the others
        assert b.target_logit == pytest.approx(float(build(family, kind)(p[None]).logits[0, -1, TARGET]), abs=1e-10)


@pytest.mark.parametrize("family,kind", [c for c in LENGTH_DEPENDENT if c[1] == "dynamic"])
def test_what_ran_before_does_not_change_a_prompt(family, kind):
    """transformers' dynamic NTK keeps the longest length it has seen: after a longer prompt, its own forward
    rotates a shorter one past max_position_embeddings with the longer one's base. dpa's scores do not follow,
    nor do the evaluation's ablated copies."""
    model, fresh = build(family, kind), build(family, kind)
    ids, longer = random_ids(19, seed=3), random_ids(30, seed=4)
    want = dpa.attribute(fresh, None, ids, target=TARGET)
    with torch.no_grad():
        model(longer[None])  # a plain forward of the longer prompt first
        stale = model(ids[None]).logits[0, -1]
    assert not torch.allclose(stale, fresh(ids[None]).logits[0, -1], rtol=1e-6, atol=1e-6)  # the test can fail
    same(dpa.attribute(model, None, ids, target=TARGET), want)
    from dpa.evaluate.ablation import input_ablation_probs  # the evaluation's forwards: copies of one prompt

    model(longer[None])
    probs = input_ablation_probs(model, ids, torch.ones(3, len(ids)), len(ids) - 1, TARGET)
    p = fresh(ids[None]).logits[0, -1].softmax(-1)[TARGET]
    torch.testing.assert_close(probs, p.expand(3), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_a_file_of_prompts_gives_each_its_single_result(kind, tmp_path):
    """dpa.attribute_file batches prompts itself: each result is its prompt's single call."""
    from transformers import PreTrainedTokenizerFast

    from .test_cli import WORDS, save_tiny_model

    folder = save_tiny_model(tmp_path / "tok")
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    over = overrides("llama", kind)
    model = tiny_model("llama", 2, vocab_size=128, **over)
    words = [" ".join(WORDS[i % len(WORDS)] for i in range(n - 1)) for n in LENGTHS]  # <s> and n - 1 words
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": w, "target": TARGET}) + "\n" for w in words))
    summary = dpa.attribute_file(model, tok, tmp_path / "p.jsonl", tmp_path / "out", batch_size=4, progress=False)
    assert summary["attributed"] == len(LENGTHS) and summary["batches"] == 1
    results = dpa.read_results(tmp_path / "out")
    assert [len(r.token_ids) for r in results] == list(LENGTHS)
    for w, res in zip(words, results):
        single = dpa.attribute(tiny_model("llama", 2, vocab_size=128, **over), tok, w, TARGET)
        assert res.token_ids == single.token_ids
        for name in ("token_scores", "head_scores", "neuron_scores"):
            torch.testing.assert_close(getattr(res, name), getattr(single, name), rtol=1e-10, atol=1e-10, msg=name)
        assert res.target_logit == pytest.approx(single.target_logit, rel=1e-10, abs=1e-10)


# --- what is refused ---

def test_a_rope_type_dpa_has_not_tested_is_refused_by_name():
    """transformers knows more RoPE types than dpa tests (``proportional``): refused, naming the type and family."""
    model = tiny_model("llama", 2)
    model.config.rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0}
    with pytest.raises(dpa.UnsupportedModelError, match=r"rope_type='proportional'.*llama"):
        dpa.attribute(model, None, random_ids(5), target=TARGET)


def test_dynamic_ntk_context_is_factor_times_max_position_embeddings():
    """Dynamic NTK exists to run past max_position_embeddings: dpa takes prompts up to factor times it, the CLI's
    early check (request.sizes_of) the same, and refuses a longer one by its length."""
    model = build("llama", "dynamic")
    assert dpa.spec_for(model).max_positions == request.sizes_of(model.config).max_positions == 2 * ORIGINAL
    dpa.attribute(model, None, random_ids(2 * ORIGINAL), target=TARGET)
    with pytest.raises(dpa.InputError, match=f"{2 * ORIGINAL + 1} tokens, more than the model's context of "
                                             f"{2 * ORIGINAL}"):
        dpa.attribute(model, None, random_ids(2 * ORIGINAL + 1), target=TARGET)
    plain = build("llama", None)  # every other type: max_position_embeddings
    assert dpa.spec_for(plain).max_positions == request.sizes_of(plain.config).max_positions == 64


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_the_rotary_module_is_left_as_it_was(kind):
    """Running each prompt's rotary alone changes the module (dynamic NTK's inv_freq and cached length, LongRoPE's
    attributes): a dpa call must leave the model's next plain forward as it would have been."""
    family = "phi3" if kind == "longrope" else "llama"
    seen, plain = build(family, kind), build(family, kind)
    long, mid, short = random_ids(30, seed=4), random_ids(20, seed=5), random_ids(5, seed=6)
    with torch.no_grad():
        seen(long[None]), plain(long[None])  # both have seen a long prompt: dynamic NTK keeps its length
    rotary = seen.model.rotary_emb
    before = {k: v for k, v in vars(rotary).items() if not k.startswith("_")}
    buffers = {k: v.clone() for k, v in rotary._buffers.items()}
    dpa.attribute(seen, None, [short, mid], target=3)
    assert {k: v for k, v in vars(rotary).items() if not k.startswith("_")}.keys() == before.keys()
    assert all(torch.equal(rotary._buffers[k], v) for k, v in buffers.items())
    with torch.no_grad():
        assert torch.equal(seen(mid[None]).logits, plain(mid[None]).logits)
