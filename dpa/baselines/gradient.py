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

from ..result import Attribution
from .common import Problem, Prompt, causal, embeddings, final_logits, prepare, result
from .forward import instrumented, run


def _logits(model: nn.Module, problem: Problem, embeds: Tensor) -> Tensor:
    return final_logits(model, run(model, inputs_embeds=embeds), problem.position)


def embedding_gradient(model: nn.Module, problem: Problem, embeds: Tensor, *, clean: bool = False) -> Tensor:
    """df/de for each row of ``embeds`` [batch pos d_model] (rows are independent). ``clean``: the
    rows are the clean prompt, so keep its logits."""
    with torch.enable_grad():
        e = embeds.detach().requires_grad_(True)
        logits = _logits(model, problem, e)
        (grad,) = torch.autograd.grad(problem.metric(logits).sum(), e)
    if clean:
        problem.clean_logits = logits[0].detach()
    return grad


def _input_gradient(model, tokenizer, prompt, target, contrast, position):
    problem = prepare(model, tokenizer, prompt, target, contrast, position)
    e = embeddings(model, problem).detach()
    return problem, e, embedding_gradient(model, problem, e, clean=True)


def gradient(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
             position: int | None = None) -> Attribution:
    """Signed sum over the embedding dimensions of df/de_i."""
    problem, _, grad = _input_gradient(model, tokenizer, prompt, target, contrast, position)
    return result(model, tokenizer, problem, "gradient", token_scores=grad[0].sum(-1))


def input_x_gradient(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                     position: int | None = None) -> Attribution:
    """e_i . df/de_i."""
    problem, e, grad = _input_gradient(model, tokenizer, prompt, target, contrast, position)
    return result(model, tokenizer, problem, "input_x_gradient", token_scores=(e * grad)[0].sum(-1))


def integrated_gradients(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                         position: int | None = None, steps: int = 20, batch_size: int = 10) -> Attribution:
    """Integrated gradients from the all-zero embedding; sum_i S_i -> f(e) - f(0) as steps grow."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    problem = prepare(model, tokenizer, prompt, target, contrast, position)
    e = embeddings(model, problem).detach()
    alphas = (torch.arange(steps, device=e.device, dtype=e.dtype) + 0.5) / steps
    total = torch.zeros_like(e[0])
    for chunk in alphas.split(max(1, batch_size)):
        total += embedding_gradient(model, problem, chunk[:, None, None] * e).sum(0)
    scores = (e[0] * total / steps).sum(-1)
    return result(model, tokenizer, problem, "integrated_gradients", token_scores=scores)


def component_gradients(model: nn.Module, problem: Problem) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """alpha [layer head query key], df/dalpha, a [layer pos d_mlp], df/da (one forward, one backward)."""
    n = problem.spec.n_layers
    with torch.enable_grad(), instrumented(model, record=True) as rec:
        e = embeddings(model, problem).detach().requires_grad_(True)  # a leaf, so the graph exists
        logits = _logits(model, problem, e)
        f = problem.metric(logits).sum()
        probs = [rec.probs[i] for i in range(n)]
        acts = [rec.acts[i] for i in range(n)]
        grads = torch.autograd.grad(f, probs + acts)
    problem.clean_logits = logits[0].detach()
    stack = lambda xs: torch.stack([x[0].detach() for x in xs])  # noqa: E731
    return stack(probs), stack(grads[:n]), stack(acts), stack(grads[n:])


def component_gradient(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                       position: int | None = None) -> Attribution:
    """df/dalpha per causal edge and df/da per position-level neuron."""
    problem = prepare(model, tokenizer, prompt, target, contrast, position)
    _, d_probs, _, d_acts = component_gradients(model, problem)
    d_probs = d_probs * causal(problem.n_tokens, d_probs.device)  # non-causal pairs are not units
    return result(model, tokenizer, problem, "gradient", edge_scores=d_probs, neuron_position_scores=d_acts)


def atp(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
        position: int | None = None) -> Attribution:
    """Attribution patching: alpha df/dalpha per edge and a df/da per position-level neuron."""
    problem = prepare(model, tokenizer, prompt, target, contrast, position)
    probs, d_probs, acts, d_acts = component_gradients(model, problem)
    return result(model, tokenizer, problem, "atp", edge_scores=probs * d_probs, neuron_position_scores=acts * d_acts)
