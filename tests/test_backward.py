"""``dpa.backward.run``, the one door to the backward, at its edges: a read-out declares what it records and
which tensors it wants the gradients of, and anything else is refused by name, with the model as it was."""

from __future__ import annotations

import pytest
import torch

import dpa
from dpa import backward, request
from dpa.errors import InputError, InputTypeError

from .conftest import random_ids, tiny_model


class Targets(backward.Readout):
    """The README's kind of read-out: the gradient at each layer's input."""

    record = frozenset({"resid"})

    def tensors(self, rec, spec):
        return [rec.resid[i] for i in range(spec.n_layers + 1)]

    def read(self, ctx, grads):
        return torch.stack(grads, dim=1)


class Unasked(backward.Readout):
    def tensors(self, rec, spec):
        return [rec.resid[0]]


class Named(backward.Readout):
    record = "resid"


class Unknown(backward.Readout):
    record = frozenset({"logits"})


class NotATensor(backward.Readout):
    record = frozenset({"resid"})

    def tensors(self, rec, spec):
        return [1.0]


class Raises(backward.Readout):
    def read(self, ctx, grads):
        raise RuntimeError("a bug in the read-out")


def state(model):
    return ([(n, p.requires_grad) for n, p in model.named_parameters()], model.training,
            [(n, dict(m._forward_hooks), dict(m._forward_pre_hooks), "forward" in m.__dict__)
             for n, m in model.named_modules()])


def test_a_readout_reads_the_gradients_it_asks_for():
    model = tiny_model("llama", 2)
    req = request.build(model, None, random_ids(7), 5)
    out = backward.run(model, req, {"targets": Targets()}).out["targets"]
    res = dpa.attribute(model, None, random_ids(7), 5, effective_targets=True)
    torch.testing.assert_close(out[0], res.effective_targets, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("readouts, error, message", [
    ({"x": Unasked()}, InputError, "read-out 'x': its tensors\\(\\) read 0 of a recording it did not ask for"),
    ({"x": Named()}, InputTypeError, "read-out 'x': record must be a set of recording keys"),
    ({"x": Unknown()}, InputError, "read-out 'x' asks to record 'logits'; a session records"),
    ({"x": NotATensor()}, InputError, "read-out 'x': tensors\\(\\) must give tensors of the forward's graph"),
    ([Targets()], InputTypeError, "readouts must be a dict of name -> dpa.backward.Readout, got list"),
    ({"x": object()}, InputTypeError, "read-out 'x' is a object, not a dpa.backward.Readout"),
    ({"x": Raises()}, RuntimeError, "a bug in the read-out"),
])
def test_a_readout_that_does_not_fit_is_refused_by_name_and_the_model_is_as_it_was(readouts, error, message):
    model = tiny_model("llama", 2)
    req = request.build(model, None, random_ids(7), 5)
    before = state(model)
    with pytest.raises(error, match=message):
        backward.run(model, req, readouts)
    assert state(model) == before
    backward.run(model, req, {"targets": Targets()})  # the lock was let go
