"""Gradient baselines, all with torch.autograd on the unmodified model.

Input (f = target logit, or logit difference with a contrast; e = token embeddings):
* gradient:              sum_d df/de_{i,d}                (signed, as the paper)
* input_x_gradient:      sum_d e_{i,d} df/de_{i,d}
* integrated_gradients:  sum_d e_{i,d} mean_k df/de (at (k + 1/2)/steps * e), zero-embedding
                         baseline, midpoint rule, steps evaluated in batches
Component (alpha the post-softmax probabilities, a = SiLU(s) u the GLU activations):
* gradient:  df/dalpha per causal edge, df/da per (position, neuron)
* atp:       attribution patching, alpha df/dalpha and a df/da (the first-order estimate of the
             effect of zeroing the unit, sign flipped so that positive supports the target)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..instrument import instrument, logits_at
from ..result import Attribution
from ..checks import check_int
from .common import Prompt, Request, causal, metric_at, prepare, result


def embedding_gradient(model: nn.Module, req: Request, embeds: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(embeddings, df/de) for each row of ``embeds`` [rows pos d_model] (default: the clean prompt,
    whose logits are then kept in ``req``); rows are independent. The model's own gradient."""
    with instrument(model, req, grad=True) as session:
        clean = embeds is None
        e = (session.embed() if clean else embeds.clone()).detach().requires_grad_(True)  # clone: not an inference tensor
        hidden = session.forward(inputs_embeds=e)
        if clean:
            req.clean_logits = logits_at(model, req, hidden.detach())
        (grad,) = torch.autograd.grad(metric_at(model, req, hidden).sum(), e)
    return e.detach(), grad


def gradient(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
             position: int | None = None) -> Attribution:
    """Signed sum over the embedding dimensions of df/de_i."""
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    _, grad = embedding_gradient(model, req)
    return result(model, req, "gradient", token_scores=grad[0].sum(-1))


def input_x_gradient(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                     position: int | None = None) -> Attribution:
    """e_i . df/de_i."""
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    e, grad = embedding_gradient(model, req)
    return result(model, req, "input_x_gradient", token_scores=(e * grad)[0].sum(-1))


def integrated_gradients(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                         position: int | None = None, steps: int = 20, batch_size: int = 10) -> Attribution:
    """Integrated gradients from the all-zero embedding; sum_i S_i -> f(e) - f(0) as steps grow."""
    steps, batch_size = check_int("steps", steps, low=1), check_int("batch_size", batch_size, low=1)
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    e, _ = embedding_gradient(model, req)
    alphas = (torch.arange(steps, device=e.device, dtype=e.dtype) + 0.5) / steps
    total = torch.zeros_like(e[0])
    for chunk in alphas.split(batch_size):
        total += embedding_gradient(model, req, chunk[:, None, None] * e)[1].sum(0)
    scores = (e[0] * total / steps).sum(-1)
    return result(model, req, "integrated_gradients", token_scores=scores)


def component_gradients(model: nn.Module, req: Request) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """alpha [layer head query key], df/dalpha, a [layer pos d_mlp], df/da (one forward, one backward)."""
    n = req.spec.n_layers
    with instrument(model, req, explicit=True, record={"neuron_inputs"}, grad=True) as session:
        e = session.embed().detach().requires_grad_(True)  # a leaf, so the graph exists
        hidden = session.forward(inputs_embeds=e)
        req.clean_logits = logits_at(model, req, hidden.detach())
        rec = session.recording
        probs = [rec.probs[i] for i in range(n)]
        acts = [rec.neuron_inputs[i] for i in range(n)]
        grads = torch.autograd.grad(metric_at(model, req, hidden).sum(), probs + acts)
    stack = lambda xs: torch.stack([x[0].detach() for x in xs])  # noqa: E731
    return stack(probs), stack(grads[:n]), stack(acts), stack(grads[n:])


def component_gradient(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                       position: int | None = None) -> Attribution:
    """df/dalpha per causal edge and df/da per position-level neuron."""
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    _, d_probs, _, d_acts = component_gradients(model, req)
    d_probs = d_probs * causal(req.n_tokens, d_probs.device)  # non-causal pairs are not units
    return result(model, req, "gradient", edge_scores=d_probs, neuron_position_scores=d_acts)


def atp(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
        position: int | None = None) -> Attribution:
    """Attribution patching: alpha df/dalpha per edge and a df/da per position-level neuron."""
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    probs, d_probs, acts, d_acts = component_gradients(model, req)
    return result(model, req, "atp", edge_scores=probs * d_probs, neuron_position_scores=acts * d_acts)
