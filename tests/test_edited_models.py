"""The model as it really is: edited after a first call, adapted, hooked, parametrized, given odd targets.

dpa checks a model once and reuses what it looked up; these tests edit the model *after* a first call (a
decoder layer, a projection or a norm replaced, an adapter injected, an activation swapped) and require exactly
the result that a freshly built model with the same edit gets, or the same refusal, by name. A projection dpa
reads by its weight (the unembedding, o_proj, down_proj, and the branches) must compute what that weight says:
an ``nn.Linear`` subclass whose forward adds a low-rank term is refused, one that keeps Linear's forward (a
parametrization, a marker subclass) is read as it computes. Every call leaves the model as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import dpa
from dpa.errors import ModelStateError, TargetError, UnsupportedModelError

from .conftest import random_ids, tiny_model

IDS = random_ids(7)
TARGET = 5


def attribute(model, **kw):
    return dpa.attribute(model, None, IDS, TARGET, **kw)


def assert_same(a, b):
    """Bit for bit: the same modules, weights and arithmetic give the same numbers."""
    assert a.target_logit == b.target_logit
    for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name


def state(model):
    """What a call must leave as it was: every module at its place, forwards, hooks, flags and weights."""
    return ([(n, id(m), type(m), "forward" in m.__dict__, m.training, len(m._forward_hooks),
              len(m._forward_pre_hooks), len(m._backward_hooks)) for n, m in model.named_modules()],
            [(n, id(p), p.requires_grad, p.dtype, p.shape, p.detach().clone()) for n, p in model.named_parameters()])


def assert_state(model, before):
    after = state(model)
    assert after[0] == before[0]
    assert len(after[1]) == len(before[1])
    for x, y in zip(after[1], before[1]):
        assert x[:5] == y[:5] and torch.equal(x[5], y[5]), x[0]


def own_logit(model, target=TARGET):
    """The model's own logit of ``target`` at the last position (its own forward, unembedding included)."""
    with torch.no_grad():
        return float(model(IDS[None]).logits[0, -1, target])


# --- edits, each seeded so that a fresh model gets the very same one ---

def _seeded(module, seed=7):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_((1 + 0.3 * torch.randn_like(p)) if "norm" in name or name == "weight" and p.dim() == 1
                    else torch.randn_like(p) * p.shape[-1] ** -0.5)
    return module.double().eval()


def new_layer(model):
    layer = model.model.layers[1]
    model.model.layers[1] = _seeded(type(layer)(model.config, 1))


def new_projection(model):
    model.model.layers[0].mlp.up_proj = _seeded(nn.Linear(32, 48, bias=False))


def new_output_projection(model):
    model.model.layers[2].self_attn.o_proj = _seeded(nn.Linear(32, 32, bias=False))


def new_norm(model):
    norm = model.model.layers[0].input_layernorm
    model.model.layers[0].input_layernorm = _seeded(type(norm)(32, eps=0.05))


def swapped_projections(model):
    attn = model.model.layers[1].self_attn
    attn.q_proj, attn.o_proj = attn.o_proj, attn.q_proj  # both [32 32] with 4 heads of 8


def new_gpt2_block(model):
    block = model.transformer.h[0]
    model.transformer.h[0] = _seeded(type(block)(model.config, layer_idx=0))


EDITS = {"layer": ("llama", new_layer), "projection": ("llama", new_projection),
         "output-projection": ("llama", new_output_projection), "norm": ("llama", new_norm),
         "swapped": ("llama", swapped_projections), "gpt2-block": ("gpt2", new_gpt2_block),
         "qwen2-moe-layer": ("qwen2_moe", new_layer)}


@pytest.mark.parametrize("edit", EDITS)
def test_edited_after_a_call_is_a_fresh_model(edit):
    """A first call, then the edit: the result is the fresh edited model's, bit for bit, edges included."""
    family, change = EDITS[edit]
    fresh = tiny_model(family, 4)
    change(fresh)
    want = attribute(fresh, edges=family != "qwen2_moe")
    model = tiny_model(family, 4)
    attribute(model, edges=family != "qwen2_moe")  # dpa has checked and looked up the unedited model
    change(model)
    got = attribute(model, edges=family != "qwen2_moe")
    assert_same(got, want)
    assert got.target_logit == pytest.approx(own_logit(model), abs=1e-12)


def test_edited_layer_scores_are_not_stale():
    """The symptom itself: the replaced layer's heads and neurons score (the taps sit on its modules)."""
    model = tiny_model("llama", 4)
    attribute(model)
    new_layer(model)
    res = attribute(model)
    assert res.head_scores[1].abs().sum() > 0 and res.neuron_scores[1].abs().sum() > 0
    assert res.token_scores.sum() + res.bias_share == pytest.approx(res.target_logit) or not res.weights.conservative


def test_edited_circuit_is_a_fresh_model():
    fresh = tiny_model("llama", 4)
    new_projection(fresh)
    want = dpa.circuit(fresh, None, IDS, TARGET, nodes=8)
    model = tiny_model("llama", 4)
    dpa.circuit(model, None, IDS, TARGET, nodes=8)
    new_projection(model)
    got = dpa.circuit(model, None, IDS, TARGET, nodes=8)
    assert [n.label for n in got.nodes] == [n.label for n in want.nodes]
    assert torch.equal(got.edges, want.edges)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_layers_and_config_must_agree(family):
    """Layers removed or added without the config: refused by name (not a KeyError, not scores left out); with
    the config set too, the pruned model is attributed as a fresh one pruned alike."""
    def prune(model, config=True):
        base = dpa.spec_for(model).base(model)
        name = dpa.spec_for(model).parts.layers.rsplit(".", 1)[1]
        setattr(base, name, getattr(base, name)[:2])
        if config:
            model.config.num_hidden_layers = 2
            if getattr(model.config, "layer_types", None):
                model.config.layer_types = model.config.layer_types[:2]

    def grow(model):
        layers = dpa.spec_for(model).layers(model)
        layers.append(_seeded(type(layers[0])(model.config, layer_idx=3)))

    for edit, what in ((lambda m: prune(m, config=False), "holds 2 layers"), (grow, "holds 4 layers")):
        model = tiny_model(family, 4)
        attribute(model, edges=True)
        edit(model)
        before = state(model)
        with pytest.raises(UnsupportedModelError, match=what + ".*num_hidden_layers is 3"):
            attribute(model, edges=True)
        assert_state(model, before)
    fresh = tiny_model(family, 4)
    prune(fresh)
    model = tiny_model(family, 4)
    attribute(model, edges=True)
    prune(model)
    got = attribute(model, edges=True)
    assert_same(got, attribute(fresh, edges=True))
    assert got.head_scores.shape[0] == 2
    assert got.target_logit == pytest.approx(own_logit(model), abs=1e-12)


# --- adapters: a wrapper module, and a Linear subclass whose forward adds a low-rank term ---

class LoraWrapper(nn.Module):
    """An adapter as peft writes it: the base Linear inside, a low-rank term beside it."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
        nn.init.normal_(self.lora_B.weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class LoraLinear(nn.Linear):
    """A LoRA written as an nn.Linear subclass: its weight alone is not what it computes."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, dtype=base.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(base.weight)
        torch.manual_seed(3)
        self.A = nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype))
        self.B = nn.Parameter(torch.randn(base.out_features, rank, dtype=base.weight.dtype))

    def forward(self, x):
        return super().forward(x) + x @ self.A.T @ self.B.T


class MarkedLinear(nn.Linear):
    """A subclass that changes nothing it computes (Linear's own forward)."""


def put(model, path: str, module: nn.Module) -> None:
    """Replace the submodule at a dotted path."""
    parent, _, name = path.rpartition(".")
    setattr(dpa.families.get(model, parent) if parent else model, name, module)


def _adapt(path: str, kind):
    def edit(model):
        put(model, path, kind(dpa.families.get(model, path)))
    return edit


ADAPTED = {  # (path, adapter, the module path the refusal names)
    "wrapper-up": ("model.layers.0.mlp.up_proj", LoraWrapper, "layers[0].mlp.up_proj"),
    "subclass-up": ("model.layers.0.mlp.up_proj", LoraLinear, "layers[0].mlp.up_proj"),
    "subclass-query": ("model.layers.1.self_attn.q_proj", LoraLinear, "layers[1].self_attn.q_proj"),
    "subclass-o": ("model.layers.1.self_attn.o_proj", LoraLinear, "layers[1].self_attn.o_proj"),
    "subclass-down": ("model.layers.2.mlp.down_proj", LoraLinear, "layers[2].mlp.down_proj"),
    "subclass-unembed": ("lm_head", LoraLinear, "lm_head"),
    "wrapper-unembed": ("lm_head", LoraWrapper, "lm_head"),
}


@pytest.mark.parametrize("case", ADAPTED)
@pytest.mark.parametrize("edges", [False, True], ids=["scores", "edges"])
def test_adapter_refused_by_name(case, edges):
    """Injected after a first call or built in, the same refusal naming the module and what it is."""
    path, kind, named = ADAPTED[case]
    fresh = tiny_model("llama", 4)
    _adapt(path, kind)(fresh)
    with pytest.raises(UnsupportedModelError, match=named.replace("[", r"\[").replace("]", r"\]")) as first:
        attribute(fresh, edges=edges)
    assert kind.__name__ in str(first.value)
    model = tiny_model("llama", 4)
    attribute(model, edges=edges)
    _adapt(path, kind)(model)
    before = state(model)
    with pytest.raises(UnsupportedModelError) as again:
        attribute(model, edges=edges)
    assert str(again.value) == str(first.value)
    assert_state(model, before)


def test_adapter_on_unembedding_refused_in_circuits_and_verify():
    """The circuit's target direction and its edges' writes are read from weights: refused, not agreed with."""
    model = tiny_model("llama", 4)
    circ = dpa.circuit(model, None, IDS, TARGET, nodes=6)
    _adapt("lm_head", LoraLinear)(model)
    with pytest.raises(UnsupportedModelError, match="lm_head"):
        dpa.circuit(model, None, IDS, TARGET, nodes=6)
    with pytest.raises(UnsupportedModelError, match="lm_head"):
        circ.verify(model, None, (circ.units[0], "target"))
    _adapt("model.layers.0.self_attn.o_proj", LoraLinear)(tiny := tiny_model("llama", 4))
    with pytest.raises(UnsupportedModelError, match=r"layers\[0\].self_attn.o_proj"):
        dpa.circuit(tiny, None, IDS, TARGET, nodes=6)


@pytest.mark.parametrize("path", ["lm_head", "model.layers.0.mlp.up_proj", "model.layers.1.self_attn.o_proj",
                                  "model.layers.2.mlp.down_proj"])
def test_subclass_keeping_linear_forward_is_read_as_linear(path):
    plain = tiny_model("llama", 4)
    want = attribute(plain, edges=True)
    model = tiny_model("llama", 4)
    old = dpa.families.get(model, path)
    marked = MarkedLinear(old.in_features, old.out_features, bias=False, dtype=old.weight.dtype)
    with torch.no_grad():
        marked.weight.copy_(old.weight)
    put(model, path, marked)
    assert_same(attribute(model, edges=True), want)


class Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("path", ["lm_head", "model.layers.0.mlp.up_proj", "model.layers.1.self_attn.o_proj",
                                  "model.layers.2.mlp.down_proj", "model.layers.1.post_attention_layernorm",
                                  "model.norm"])
def test_parametrization_is_read_as_it_computes(path):
    """A parametrized weight is what the module computes with: the same result as the weight materialised."""
    materialised = tiny_model("llama", 4)
    with torch.no_grad():
        dpa.families.get(materialised, path).weight.mul_(2)
    want = attribute(materialised, neuron_target="mid", edges=True)
    model = tiny_model("llama", 4)
    attribute(model)  # and after a first call
    parametrize.register_parametrization(dpa.families.get(model, path), "weight", Doubled())
    before = state(model)
    got = attribute(model, neuron_target="mid", edges=True)
    assert_state(model, before)
    torch.testing.assert_close(got.token_scores, want.token_scores, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.neuron_scores, want.neuron_scores, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.edge_scores, want.edge_scores, rtol=1e-12, atol=1e-12)
    assert got.target_logit == pytest.approx(own_logit(model), abs=1e-12)


def test_a_train_mode_parametrization_is_refused_before_its_weight_is_read():
    """spectral_norm updates its buffers each time the weight is read in train mode, and dpa reads weights (the
    family check) before it switches the model to eval: refused by name, with the buffers as they were."""
    model = tiny_model("llama", 2)
    down = model.model.layers[0].mlp.down_proj
    torch.nn.utils.parametrizations.spectral_norm(down)
    model.train()
    u = down.parametrizations.weight[0]._u.clone()
    with pytest.raises(ModelStateError, match=r"model.layers.0.mlp.down_proj has a parametrization .*model.eval\(\)"):
        attribute(model)
    assert torch.equal(u, down.parametrizations.weight[0]._u)
    model.eval()
    attribute(model)  # in eval mode the parametrization is read as it computes
    assert torch.equal(u, down.parametrizations.weight[0]._u)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_causal_lm_subclass_with_a_forward_of_its_own_is_refused(family):
    """dpa runs the decoder stack and takes the logits from the unembedding itself: a *ForCausalLM subclass whose
    forward adds a logit bias was attributed as the model without it (target logit and every score off, silently).
    A subclass that keeps transformers' forward (a marker) is the same model and attributed as such."""
    from dpa.mib import Pairs, discover

    model = tiny_model(family, 2)
    want = attribute(model)

    class Biased(type(model)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + 1.0
            return out
    model.__class__ = Biased
    message = r"Biased's forward is its own \(.*Biased.forward, not transformers'\)"
    with pytest.raises(UnsupportedModelError, match=message):
        attribute(model)
    with pytest.raises(UnsupportedModelError, match=message):
        discover(model, None, Pairs([[1, 2, 3]], [[1, 2, 4]], [[5]], [[7]]), progress=False)

    class Marked(type(model).__mro__[1]):
        pass
    model.__class__ = Marked
    assert_same(attribute(model), want)


@pytest.mark.parametrize("family, where", [("llama", "adapter"), ("qwen3_moe", "mlp_extra"), ("gpt2", "adapter")])
def test_a_layer_holding_parameters_its_description_does_not_name_is_refused(family, where):
    """A module with parameters added beside a layer's described ones (an adapter set on the layer, a block a layer
    runs on a flag of its own, as Granite's experts): dpa would neither linearise nor score what it computes. Refused
    by name before any work, also after a first call; the model left as it was."""
    model = tiny_model(family, 2)
    attribute(model)
    layers = model.model.layers if family != "gpt2" else model.transformer.h
    setattr(layers[1], where, nn.Linear(4, 4))
    before = state(model)
    with pytest.raises(UnsupportedModelError, match=rf"layers\[1\] holds parameters outside the modules .*{where}.weight"):
        attribute(model)
    assert_state(model, before)


def test_a_compiled_layer_is_refused_by_name():
    model = tiny_model("llama", 2)
    model.model.layers[1] = torch.compile(model.model.layers[1], backend="eager")
    with pytest.raises(ModelStateError, match=r"model.layers.1 is a torch.compile'd module.*_orig_mod"):
        attribute(model)


@pytest.mark.parametrize("path", ["lm_head", "model.layers.0.mlp.up_proj", "model.layers.2.mlp.down_proj"])
@pytest.mark.parametrize("pre", [False, True], ids=["hook", "pre-hook"])
def test_hooks_refused_by_name(path, pre):
    """A hook may change what a module computes, and dpa reads these by weight: refused, the hook left in place."""
    model = tiny_model("llama", 4)
    attribute(model)
    module = dpa.families.get(model, path)
    handle = (module.register_forward_pre_hook(lambda m, a: (a[0] * 2,)) if pre
              else module.register_forward_hook(lambda m, a, out: out * 2))
    before = state(model)
    with pytest.raises(ModelStateError, match=path.split(".")[-1]):
        attribute(model)
    assert_state(model, before)
    handle.remove()
    attribute(model)


# --- a norm whose forward is not its weight's arithmetic ---

def _norm_class(model, path, forward):
    norm = dpa.families.get(model, path)
    return type("Edited" + type(norm).__name__, (type(norm),), {"forward": forward} if forward else {})


NORMS = {  # family, path, forward of a subclass (None: the class's own), the name refused (None: accepted)
    "llama-doubled": ("llama", "model.layers.1.post_attention_layernorm",
                      lambda self, x: 2 * super(type(self), self).forward(x), "layers[1].post_attention_layernorm"),
    "llama-final-shifted": ("llama", "model.norm", lambda self, x: super(type(self), self).forward(x) + 0.1,
                            "model.norm"),
    "qwen3-head-norm": ("qwen3", "model.layers.0.self_attn.k_norm", lambda self, x: x,
                        "layers[0].self_attn.k_norm"),
    "gpt2-layernorm": ("gpt2", "transformer.h.2.ln_1", lambda self, x: torch.nn.functional.layer_norm(
        x, self.normalized_shape, self.weight, None, self.eps), "layers[2].ln_1"),
    "llama-marked": ("llama", "model.layers.1.input_layernorm", None, None),
}


@pytest.mark.parametrize("case", NORMS)
def test_norm_computing_something_else_refused(case):
    """dpa freezes a norm from its weight and epsilon: a norm whose forward computes something else is refused by
    name (edited after a call, or fresh); a subclass keeping the arithmetic gives the same scores."""
    family, path, forward, named = NORMS[case]
    plain = attribute(tiny_model(family, 4))

    def edit(model):
        norm = dpa.families.get(model, path)
        norm.__class__ = _norm_class(model, path, forward)

    model = tiny_model(family, 4)
    attribute(model)
    edit(model)
    if named is None:
        assert_same(attribute(model), plain)
        return
    before = state(model)
    with pytest.raises(UnsupportedModelError) as err:
        attribute(model)
    assert named in str(err.value) and "Edited" in str(err.value)
    assert_state(model, before)
    fresh = tiny_model(family, 4)
    edit(fresh)
    with pytest.raises(UnsupportedModelError) as again:
        attribute(fresh)
    assert str(again.value) == str(err.value)


# --- an activation module that contradicts the config ---

ACTIVATIONS = {  # family, path, module replacing it, whether it computes the config's activation, the name refused
    "llama-gelu": ("llama", "model.layers.1.mlp.act_fn", lambda: nn.GELU(), False, "layers[1].mlp.act_fn"),
    "llama-tanh": ("llama", "model.layers.0.mlp.act_fn", lambda: nn.Tanh(), False, "layers[0].mlp.act_fn"),
    "llama-torch-silu": ("llama", "model.layers.1.mlp.act_fn", lambda: nn.SiLU(), True, None),
    "gemma3-erf-gelu": ("gemma3_text", "model.layers.2.mlp.act_fn", lambda: nn.GELU(), False, "layers[2].mlp.act_fn"),
    "gemma3-tanh-gelu": ("gemma3_text", "model.layers.2.mlp.act_fn", lambda: nn.GELU(approximate="tanh"), True, None),
    "gpt2-silu": ("gpt2", "transformer.h.0.mlp.act", lambda: nn.SiLU(), False, "layers[0].mlp.act"),
    "mixtral-gelu": ("mixtral", "model.layers.0.mlp.experts.act_fn", lambda: nn.GELU(), False,
                     "layers[0].mlp.experts.act_fn"),
    "qwen2-moe-shared-gelu": ("qwen2_moe", "model.layers.1.mlp.shared_expert.act_fn", lambda: nn.GELU(), False,
                              "layers[1].mlp.shared_expert.act_fn"),
}


@pytest.mark.parametrize("case", ACTIVATIONS)
def test_activation_module_against_config(case):
    """Linearised by the config's kind, the module must compute that kind: another function is refused by name
    (fresh or edited after a call); another module computing the same function gives the same scores."""
    family, path, make, same, named = ACTIVATIONS[case]
    plain = attribute(tiny_model(family, 4))
    model = tiny_model(family, 4)
    attribute(model)
    put(model, path, make())
    if same:
        res = attribute(model)
        torch.testing.assert_close(res.token_scores, plain.token_scores, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res.neuron_scores, plain.neuron_scores, rtol=1e-12, atol=1e-12)
        return
    before = state(model)
    with pytest.raises(UnsupportedModelError) as err:
        attribute(model)
    assert named in str(err.value) and type(make()).__name__ in str(err.value)
    assert_state(model, before)
    fresh = tiny_model(family, 4)
    put(fresh, path, make())
    with pytest.raises(UnsupportedModelError) as again:
        attribute(fresh)
    assert str(again.value) == str(err.value)


# --- vector targets: [d_model] only, on the model's device ---

@pytest.mark.parametrize("shape", [(1, 32), (16, 2), (32, 1), (2, 2, 8)], ids=str)
def test_vector_target_of_another_shape_refused(shape):
    model = tiny_model("llama", 4)
    with pytest.raises(TargetError, match=r"\[d_model=32\].*" + r"\(" + ", ".join(map(str, shape))):
        dpa.attribute(model, None, IDS, torch.ones(shape, dtype=torch.float64))


def test_vector_target_on_meta_refused():
    model = tiny_model("llama", 4)
    with pytest.raises(TargetError, match="meta"):
        dpa.attribute(model, None, IDS, torch.ones(32, dtype=torch.float64, device="meta"))


def test_vector_target_forms():
    """[d_model] in any float dtype, requiring grad or not, strided: the direction itself."""
    model = tiny_model("llama", 4)
    torch.manual_seed(0)
    u = torch.randn(32, dtype=torch.float64)
    want = dpa.attribute(model, None, IDS, u)
    with torch.no_grad():
        final = dpa.spec_for(model).base(model)(input_ids=IDS[None]).last_hidden_state[0, -1]
    assert want.target_logit == pytest.approx(float(final @ u), abs=1e-12)
    strided = torch.stack([u, u], 1)[:, 0]
    assert not strided.is_contiguous()
    assert_same(dpa.attribute(model, None, IDS, strided), want)
    assert_same(dpa.attribute(model, None, IDS, u.clone().requires_grad_(True)), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_vector_target_on_another_device_moved():
    model = tiny_model("llama", 4)
    u = torch.randn(32, dtype=torch.float64)
    assert_same(dpa.attribute(model, None, IDS, u.cuda()), dpa.attribute(model, None, IDS, u))


def test_a_token_added_to_the_tokenizer_but_not_the_model_is_refused_by_name():
    """A target or contrast string the tokenizer knows and the model does not (tokens added, embeddings not
    resized): the same TargetError as an int id outside the vocabulary, not torch's IndexError."""
    from .test_evaluate import word_tokenizer

    tok = word_tokenizer()
    tok.add_tokens(["newword"])  # id 96; the tiny model has 96 rows
    model = tiny_model("llama")
    for kwargs in (dict(target="newword"), dict(target="w5", contrast="newword")):
        with pytest.raises(dpa.TargetError, match="resize_token_embeddings"):
            dpa.attribute(model, tok, "w4 w5 w6", **kwargs)


def test_a_forward_that_skips_the_activation_module_is_refused(monkeypatch):
    """A class-level patch computing SwiGLU in one expression (as fused-kernel libraries do) never calls act_fn:
    its scores would leave the gate path unlinearised. Refused by name (the MLP's forward is not transformers'), the
    model left as it was."""
    from torch.nn import functional as F
    from transformers.models.llama import modeling_llama

    model = tiny_model("llama")
    before = dpa.attribute(model, None, random_ids(7), target=5)
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward",
                        lambda self, x: self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))
    with pytest.raises(UnsupportedModelError, match=r"layers\[0\]'s MLP is a LlamaMLP whose forward is its own"):
        dpa.attribute(model, None, random_ids(7), target=5)
    monkeypatch.undo()
    after = dpa.attribute(model, None, random_ids(7), target=5)
    assert torch.equal(after.token_scores, before.token_scores)


# --- one module object at two places, settings the modules keep, blocks wrapped ---

def test_a_module_used_at_two_places_is_refused_by_name():
    """dpa's rules and taps sit on module objects: one object at two layers would give both layers one layer's
    scores (and the other's none), so it is refused, naming both places."""
    model = tiny_model("llama", 4)
    attribute(model)
    model.model.layers[2] = model.model.layers[0]
    before = state(model)
    with pytest.raises(UnsupportedModelError, match=r"layers\[2\] is the same module object as layers\[0\]"):
        attribute(model)
    assert_state(model, before)
    model.model.layers[2] = tiny_model("llama", 4).model.layers[2]  # its own copy: attributed again
    model.model.layers[1].mlp.act_fn = model.model.layers[0].mlp.act_fn  # shared below the layer too
    with pytest.raises(UnsupportedModelError, match=r"layers\[1\]\.mlp\.act_fn is the same module object"):
        dpa.circuit(model, None, IDS, TARGET, nodes=4)


@pytest.mark.parametrize("edit", ["config-heads", "config-kv-heads", "module-head-dim", "module-groups"])
def test_head_layout_edited_after_loading_is_refused(edit):
    """The attention modules run the head layout they were built with; a config or module edited after loading
    would have dpa split the heads otherwise (fake heads, wrong n_kv_heads): refused, naming the setting."""
    model = tiny_model("llama", 2)
    attribute(model)
    attn = model.model.layers[1].self_attn
    if edit == "config-heads":
        model.config.num_attention_heads = 8  # the model still runs 4 heads of 8 features
    elif edit == "config-kv-heads":
        model.config.num_key_value_heads = 4
    elif edit == "module-head-dim":
        attn.head_dim = 4
    else:
        attn.num_key_value_groups = 1
    before = state(model)
    with pytest.raises(UnsupportedModelError, match=r"self_attn\.(head_dim|num_key_value_groups)|k_proj has"):
        attribute(model, edges=True)
    assert_state(model, before)


@pytest.mark.parametrize("where", ["config", "module"])
def test_gemma2_attention_softcap_must_be_the_modules(where):
    """Gemma 2 caps its attention scores with each module's own attn_logit_softcapping; dpa's explicit attention
    (edges, circuits, ablations) uses the spec's: the two disagreeing is refused by name, not silently used."""
    model = tiny_model("gemma2", 2)
    want = attribute(model, edges=True)
    if where == "config":
        model.config.attn_logit_softcapping = None
    else:
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = 7.0
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        attribute(model, edges=True)
    if where == "module":  # config and modules agreeing again: a model built with that cap, bit for bit
        model.config.attn_logit_softcapping = 7.0
        got = attribute(model, edges=True)
        assert_same(got, attribute(tiny_model("gemma2", 2, attn_logit_softcapping=7.0), edges=True))
        assert got.target_logit != want.target_logit


class _Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("path", ["mlp", "self_attn"])
def test_a_wrapped_block_is_refused_by_name(path):
    model = tiny_model("llama", 4)
    layer = model.model.layers[1]
    setattr(layer, path, _Wrap(getattr(layer, path)))
    with pytest.raises(UnsupportedModelError, match="does not have the modules of a llama layer"):
        attribute(model)


def test_an_attention_class_whose_forward_is_patched_is_refused(monkeypatch):
    """The explicit attention path (edge ablations, the gradient baselines, activation patching) recomputes alpha
    from the module's weights in place of its forward, and dpa.attribute runs that forward with the rules on the
    modules inside it: a class whose forward was patched (here: doubling the output; a tanh there would be carried
    through unlinearised) is refused by name by both."""
    from transformers.models.llama import modeling_llama

    from dpa import baselines

    own = modeling_llama.LlamaAttention.forward
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward",
                        lambda self, *a, **k: (lambda out: (out[0] * 2, *out[1:]))(own(self, *a, **k)))
    model = tiny_model("llama", 2)
    for method in (baselines.activation_patching, baselines.atp):
        with pytest.raises(UnsupportedModelError, match=r"layers\[0\]'s attention is a LlamaAttention whose forward "
                                                         "is its own"):
            method(model, None, IDS, TARGET)
    with pytest.raises(UnsupportedModelError, match=r"layers\[0\]'s attention is a LlamaAttention whose forward "
                                                     "is its own"):
        attribute(model)


@pytest.mark.parametrize("part", ["lm_head", "embed_tokens"])
def test_an_unembedding_or_embedding_of_another_size_than_the_config_is_refused(part):
    model = tiny_model("llama", 2)
    attribute(model)
    if part == "lm_head":
        model.lm_head = nn.Linear(32, 50, bias=False, dtype=torch.float64)
    else:
        model.model.embed_tokens = nn.Embedding(50, 32, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match="while the config's vocab_size is 96"):
        attribute(model)


def test_a_compiled_model_is_refused_as_compiled():
    model = torch.compile(tiny_model("llama", 2))
    with pytest.raises(ModelStateError, match="is a torch.compile'd module"):
        attribute(model)


class _ClampedSilu(nn.Module):
    """SiLU on the model check's probe ([-8, 8]) and beyond it up to 9; clamped at 9 past that."""

    def forward(self, s):
        return torch.nn.functional.silu(s.clamp(max=9.0))


class _ClampedRMSNorm(nn.Module):
    """An RMSNorm whose input is clamped to +-15 first (an fp16-style safety clamp): the arithmetic on the probe."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x):
        x = x.clamp(-15, 15)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.mark.parametrize("edit, match", [
    ("activation clamped beyond the probe", r"layers\[1\]'s _ClampedSilu \(as silu\) computed"),
    ("norm clamped beyond the probe", r"a _ClampedRMSNorm frozen as a rms norm computed"),
    ("non-causal attention", r"layers\[0\]\.self_attn\.is_causal is False"),
    ("embedding with max_norm", r"model\.embed_tokens has max_norm=0\.5"),
    ("MLPs of two widths", r"layers\[1\]\.mlp\.down_proj reads 20 neurons, while layers\[0\]'s reads 48"),
])
def test_what_the_checks_probe_is_also_checked_on_the_call(edit, match):
    """A module that agrees with its rule on the model check's probe but computes another function on a call's own
    input (a clamp beyond the probe's range) is refused on that call, as are module settings no probe sees: a
    non-causal attention module (transformers' kernels attend both ways), an embedding that renormalises its rows in
    place, MLPs of different widths. The model is left as it was."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    model = tiny_model("llama", 2)
    layers = model.model.layers
    if edit == "activation clamped beyond the probe":
        layers[1].mlp.act_fn = _ClampedSilu()
        layers[1].mlp.gate_proj.weight.data.mul_(80)  # pre-activations beyond 9 on this input
    elif edit == "norm clamped beyond the probe":
        layers[1].post_attention_layernorm = _ClampedRMSNorm(layers[1].post_attention_layernorm)
        model.model.embed_tokens.weight.data.mul_(60)
    elif edit == "non-causal attention":
        layers[0].self_attn.is_causal = False
    elif edit == "embedding with max_norm":
        old = model.model.embed_tokens
        model.model.embed_tokens = nn.Embedding(96, 32, max_norm=0.5, dtype=torch.float64)
        model.model.embed_tokens.weight = old.weight
    else:
        layers[1].mlp = LlamaMLP(model.config).double()
        layers[1].mlp.gate_proj, layers[1].mlp.up_proj = (nn.Linear(32, 20, bias=False, dtype=torch.float64)
                                                          for _ in range(2))
        layers[1].mlp.down_proj = nn.Linear(20, 32, bias=False, dtype=torch.float64)
    before = state(model)
    with pytest.raises(UnsupportedModelError, match=match):
        attribute(model, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5))
    assert_state(model, before)
