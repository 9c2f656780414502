"""A sliding-window layer over a long input runs by bands of queries (``linearise.banded_attention``): the same
attention, so the same scores, on every family with a sliding window, in both memory modes, fused and eager, with
GIM's temperature; the model's configs put back; a mask that does not hide the keys outside the band is run whole."""
import pytest
import torch
from torch.testing import assert_close

import dpa
import dpa.instrument
import dpa.linearise
from dpa.families import spec_for
from dpa.tiny import tiny_model

SLIDING = ("mistral", "gemma2", "gemma3_text", "gpt_oss")
IDS = torch.arange(3, 40) % 50 + 1  # 37 tokens: more than four windows of 5


def _scores(model, banded_from: int, monkeypatch, **kw):
    monkeypatch.setattr(dpa.instrument, "BANDED_FROM", banded_from)
    res = dpa.attribute(model, None, IDS, target=7, **kw)
    return {k: getattr(res, k) for k in ("token_scores", "head_scores", "neuron_scores")}


@pytest.mark.parametrize("family,attention", [(f, a) for f in SLIDING for a in ("sdpa", "eager")
                                              if a == "eager" or f in ("mistral", "gemma3_text")])  # soft-caps, sinks: eager
def test_banded_equals_whole(family, attention, monkeypatch):
    model = tiny_model(family, attn_implementation=attention)
    spec = spec_for(model)
    assert any(spec.sliding_windows) and dpa.instrument.banded(spec, spec.sliding_windows.index(5), len(IDS)) is False
    calls = []  # each band's check that the model's mask hides every key outside it
    hidden = dpa.linearise._hidden
    monkeypatch.setattr(dpa.linearise, "_hidden", lambda mask: calls.append(hidden(mask)) or calls[-1])
    configs = [m.__dict__.get("config") for m in model.modules()]
    for memory in ("full", "lean"):
        for weights in (None, dpa.PathWeights().with_temperature(2.0)):
            kw = {"memory": memory} | ({} if weights is None else {"weights": weights})
            whole = _scores(model, 10**9, monkeypatch, **kw)
            n = len(calls)
            bands = _scores(model, 0, monkeypatch, **kw)
            assert calls[n:] and all(calls[n:])  # the bands ran, none fell back to the whole input
            for k in whole:  # the eager kernels take their softmax in float32: equal to its rounding only
                tol = 1e-10 if attention == "sdpa" else 1e-6 * float(whole[k].abs().max())
                assert_close(bands[k], whole[k], rtol=0, atol=tol)
    assert [m.__dict__.get("config") for m in model.modules()] == configs


def test_a_mask_reaching_outside_the_band_runs_whole(monkeypatch):
    """Bands are only the same attention when the mask hides everything outside them; a wider mask runs whole."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 4, dtype=torch.float64) for _ in range(3))

    class Module(torch.nn.Module):
        is_causal, num_key_value_groups = True, 1

        def __init__(self, window):
            super().__init__()
            self.config = type("C", (), {"_dpa_band": ("sdpa", window), "_attn_implementation": "sdpa"})()

    i = torch.arange(12)
    sliding = ((i[None] <= i[:, None]) & (i[None] > i[:, None] - 3))[None, None]
    causal = (i[None] <= i[:, None])[None, None]
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa",
                        lambda m, q, k, *a, **kw: seen.append((q.shape[2], k.shape[2])) or sdpa_attention_forward(
                            m, q, k, *a, **kw))
    for mask, calls in ((sliding, [(3, 3), (3, 5), (3, 5), (3, 5)]), (causal, [(12, 12)])):
        want, _ = sdpa_attention_forward(Module(3), q, k, v, mask, scaling=0.5)
        seen.clear()
        got, _ = dpa.linearise.banded_attention(Module(3), q, k, v, mask, scaling=0.5)
        assert seen == calls  # bands of 3 queries reading 5 keys (2 before); the causal mask whole
        assert_close(got, want, rtol=0, atol=1e-12)
