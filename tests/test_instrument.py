"""The instrumented model: forward values are the model's own, and the model leaves every call as it came."""

import threading

import pytest
import torch

import dpa
from dpa import baselines, request
from dpa.errors import ModelStateError, NonFiniteError
from dpa.evaluate.ablation import component_ablation_probs
from dpa.instrument import instrument
from dpa.linearise import Scores

from .conftest import random_ids, tiny_model


def state(model):
    """Everything a call could leave changed: modules, hooks, flags, mode, forwards, attention kernel."""
    modules = list(model.named_modules())
    return {
        "modules": [(n, id(m)) for n, m in modules],
        "hooks": [(n, tuple(d.keys())) for n, m in modules
                  for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)],
        "forwards": [(n, m.__dict__.get("forward")) for n, m in modules],
        "training": [(n, m.training) for n, m in modules],
        "requires_grad": [(n, p.requires_grad) for n, p in model.named_parameters()],
        "grads": [(n, p.grad) for n, p in model.named_parameters()],
        "attn_implementation": model.config._attn_implementation,
    }


class TestForwardValues:
    @pytest.mark.parametrize("weights", [dpa.PathWeights(), dpa.PathWeights(0, 0, 0, 0, 0),
                                         dpa.PathWeights(0.7, 0.1, 0.4, 0.2, 1.3)])
    def test_instrumented_forward_is_the_models(self, family_model, weights):
        ids = random_ids(9)
        plain = family_model(ids[None]).logits
        req = request.build(family_model, None, ids, 3)
        scores = Scores.empty(req.spec, 1, 9, torch.float64, req.device, True)
        with instrument(family_model, req, weights=weights, scores=scores, lean=False) as session:
            hidden = session.forward()
        assert torch.equal(family_model.lm_head(hidden), plain)  # bit for bit

    def test_lean_forward_is_the_models(self):
        model = tiny_model("qwen3", 2)
        ids = random_ids(9)
        req = request.build(model, None, ids, 3)
        with instrument(model, req, weights=dpa.PathWeights(), lean=True) as session:
            hidden = session.forward()
        assert torch.equal(model.lm_head(hidden), model(ids[None]).logits)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("family", ["llama", "qwen3"])
    def test_lower_precision_forward_is_hfs(self, family, dtype):
        """Below float64 the conftest's float64 norm patch is inactive: the frozen norm's forward must
        reproduce HF's own RMSNorm arithmetic (including Qwen3's q/k norms) bit for bit."""
        model = tiny_model(family).to(dtype)
        ids = random_ids(9)
        plain = model(ids[None]).logits
        req = request.build(model, None, ids, 3)
        scores = Scores.empty(req.spec, 1, 9, torch.float32, req.device, False)
        with instrument(model, req, weights=dpa.PathWeights(), scores=scores) as session:
            hidden = session.forward()
        assert torch.equal(model.lm_head(hidden), plain)

    def test_logit_is_the_models(self, family_model):
        ids = random_ids(9)
        res = dpa.attribute(family_model, None, ids, target=3)
        assert res.target_logit == pytest.approx(float(family_model(ids[None]).logits[0, -1, 3]), abs=1e-12)


def calls(model):
    ids = random_ids(8)
    return {
        "full": lambda: dpa.attribute(model, None, ids, target=3, edges=True, neuron_positions=True),
        "lean": lambda: dpa.attribute(model, None, ids, target=3, memory="lean", effective_targets=True),
        "mid": lambda: dpa.attribute(model, None, ids, target=3, neuron_target="mid"),
        "batch": lambda: dpa.attribute(model, None, [ids, ids[:5]], target=3),
        "atp": lambda: baselines.atp(model, None, ids, 3),
        "ig": lambda: baselines.integrated_gradients(model, None, ids, 3, steps=2),
        "ablation": lambda: component_ablation_probs(model, ids, torch.ones(1, 3, 4, 8, 8), None, 7, 3),
    }


class TestModelLeftAsItWas:
    @pytest.mark.parametrize("call", list(calls(tiny_model("llama"))))
    def test_after_a_call(self, call):
        model = tiny_model("llama", 2)
        before = state(model)
        calls(model)[call]()
        assert state(model) == before

    def test_train_mode_and_gradients_restored(self):
        model = tiny_model("llama", 2, attention_dropout=0.5)
        expected = dpa.attribute(model, None, random_ids(8), target=3)
        model.train().requires_grad_(True)
        before = state(model)
        res = dpa.attribute(model, None, random_ids(8), target=3)
        assert state(model) == before  # still training, still requires_grad, no .grad written
        torch.testing.assert_close(res.token_scores, expected.token_scores)  # dropout was off during the call
        assert all(p.grad is None for p in model.parameters())

    def test_after_an_error_inside_the_forward(self):
        model = tiny_model("llama", 2)
        with torch.no_grad():
            model.model.layers[2].mlp.down_proj.weight[0, 0] = float("nan")
        before = state(model)
        with pytest.raises(NonFiniteError):
            dpa.attribute(model, None, random_ids(8), target=3, edges=True)
        assert state(model) == before

    @pytest.mark.parametrize("memory", ["full", "lean"])
    def test_after_keyboard_interrupt_inside_the_forward(self, memory):
        model = tiny_model("qwen3", 2)

        act = model.model.layers[1].mlp.act_fn
        cls = type(act)
        own = cls.forward

        def interrupt(self, x, *args, **kwargs):  # patched on the class: what dpa cannot see (a library's code; the
            if self is act and x.dim() == 3:  # probe of its checks, one-dimensional, passes)
                raise KeyboardInterrupt
            return own(self, x, *args, **kwargs)

        before = state(model)
        cls.forward = interrupt
        try:
            with pytest.raises(KeyboardInterrupt):
                dpa.attribute(model, None, random_ids(8), target=3, memory=memory, edges=True)
        finally:
            cls.forward = own
        assert state(model) == before
        dpa.attribute(model, None, random_ids(8), target=3)  # the model still works

    def test_a_users_own_forward_survives(self):
        model = tiny_model("llama", 2)
        attn = model.model.layers[0].self_attn
        original = type(attn).forward.__get__(attn)
        seen = []

        def patched(*args, **kwargs):
            seen.append(1)
            return original(*args, **kwargs)

        attn.forward = patched
        with pytest.raises(ModelStateError, match=r"model.layers.0.self_attn.forward is replaced"):
            baselines.atp(model, None, random_ids(6), 3)  # dpa cannot vouch for what it computes
        assert attn.forward is patched
        model(random_ids(6)[None])
        assert seen
        from accelerate.hooks import AlignDevicesHook

        attn._hf_hook = AlignDevicesHook("cpu")  # accelerate's device hook (moves tensors): allowed, and kept
        res = baselines.atp(model, None, random_ids(6), 3)
        assert attn.forward is patched and torch.isfinite(res.head_scores).all()
        del attn._hf_hook

    def test_inside_inference_mode(self):
        """Called inside torch.inference_mode(), the gradient methods still run, with the same results."""
        model = tiny_model("llama", 2)
        ids = random_ids(8)
        runs = {name: fn for name, fn in calls(model).items()}
        expected = {name: fn() for name, fn in runs.items()}
        with torch.inference_mode():
            got = {name: fn() for name, fn in runs.items()}
        for name in ("full", "lean", "mid", "atp", "ig"):
            torch.testing.assert_close(got[name].token_scores, expected[name].token_scores, msg=name)
            torch.testing.assert_close(got[name].head_scores, expected[name].head_scores, msg=name)
        torch.testing.assert_close(got["ablation"], expected["ablation"])
        assert ids.shape == (8,)

    def test_reentry_from_a_hook_is_refused(self):
        model = tiny_model("llama", 2)
        errors = []

        def nested(_m, _args):
            try:
                dpa.attribute(model, None, random_ids(4), target=1)
            except ModelStateError as err:
                errors.append(err)

        act = model.model.layers[0].mlp.act_fn
        cls = type(act)
        own = cls.forward

        def patched(self, x, *args, **kwargs):  # on the activation's class: a hook would be refused before the call,
            if self is act and x.dim() == 3:  # a patched layer forward too (the probe of the checks passes)
                nested(self, (x,))
            return own(self, x, *args, **kwargs)

        cls.forward = patched
        try:
            dpa.attribute(model, None, random_ids(6), target=3)
        finally:
            cls.forward = own
        assert errors and "already running" in str(errors[0])


class TestThreads:
    def test_threads_equal_sequential_calls(self):
        model = tiny_model("qwen2", 2)
        prompts = [random_ids(n, seed=s) for s, n in enumerate((9, 9, 12, 5, 9, 7, 12, 3))]
        expected = [dpa.attribute(model, None, p, target=3, edges=True) for p in prompts]
        results: dict = {}
        errors = []

        def work(i):
            try:
                results[i] = dpa.attribute(model, None, prompts[i], target=3, edges=True)
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for i, exp in enumerate(expected):
            for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores"):
                assert torch.equal(getattr(results[i], name), getattr(exp, name))

    def test_baselines_from_threads(self):
        model = tiny_model("llama", 2)
        ids = random_ids(7)
        expected = baselines.atp(model, None, ids, 3)
        out = []
        threads = [threading.Thread(target=lambda: out.append(baselines.atp(model, None, ids, 3))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(out) == 4 and all(torch.equal(o.edge_scores, expected.edge_scores) for o in out)


class TestNothingExtraFormed:
    def test_no_head_position_position_tensor_and_no_parameter_gradient(self):
        """The fused kernel's path: no [head, pos, pos] tensor anywhere, no parameter gradient."""
        from torch.utils._python_dispatch import TorchDispatchMode

        t = 9
        shapes = []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for o in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(o, torch.Tensor):
                        shapes.append(tuple(o.shape))
                return out

        model = tiny_model("llama", 2)
        model.config._attn_implementation = "sdpa"
        model.requires_grad_(True)
        with Watch():
            dpa.attribute(model, None, random_ids(t), target=3, neuron_target="mid", effective_targets=True)
        assert shapes and not [s for s in shapes if len(s) >= 2 and s[-2:] == (t, t)]
        assert all(p.grad is None for p in model.parameters())
        with Watch():  # the watch sees them where they exist: edge scores need alpha
            dpa.attribute(model, None, random_ids(t), target=3, edges=True)
        assert [s for s in shapes if s[-3:] == (4, t, t)]
