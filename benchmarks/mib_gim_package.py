"""MIB edge scores with the backward of the ``gim-explain`` package as shipped (GIM, arXiv 2505.17630), beside
dpa's own implementation of GIM's rules (``dpa.mib.methods.edge_scores(..., "gim")``).

    from benchmarks.mib_gim_package import gim_package_scores
    scores = gim_package_scores(model, pairs)   # [writer reader], dpa.mib.graph.Graph.of(spec)'s indexing

An optional benchmark dependency (``pip install gim-explain``), never one of dpa's. The scores are computed as
``dpa.mib.methods._batch_scores`` computes them for "gim" -- score(u -> r) = sum over pairs and positions of
Δ_u . g_r, from dpa's reader-by-reader run (``dpa.mib.forward``) inside ``dpa.instrument`` with the model's own
backward (``weights=None``) -- but with ``gim.GIM(model, softmax_temperature=T)`` active around the batches, so
that g_r is the gradient as the package modifies it. Nothing of dpa's linearisation is on the model.

What the package does (0.1.4, the PyPI release; read from its code). ``GIM(model)`` on a plain ``nn.Module``:

* norms: swaps every ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` child for a copy whose std / rms is detached;
  any other class is left alone. HF's RMSNorm classes (``LlamaRMSNorm``, ``Gemma3RMSNorm``, Qwen's, ...) are
  their own ``nn.Module`` subclasses, not ``nn.RMSNorm``: on the llama and gemma3_text families no norm is frozen
  (the block norms, Gemma's post-norms, its q/k norms and the final norm all keep their exact backward). GPT-2's
  ``nn.LayerNorm`` is swapped, for a module built with the default dtype and device (float32, CPU: a float64
  model's gains are rounded to float32, and a model on a GPU would meet CPU weights).
* softmax temperature: replaces ``torch.nn.functional.softmax``, ``torch.softmax`` and ``Tensor.softmax`` by a
  function whose backward is GIM's rule (s_T = softmax(x / T) in place of s, no 1/T), with the signature
  ``(input, dim=None)``. HF's eager attention of llama and gemma3 calls ``softmax(w, dim=-1, dtype=torch.float32)``:
  the patched function refuses the ``dtype`` keyword, so under ``attn_implementation="eager"`` the package's
  default context raises ``TypeError`` at the first attention (re-raised here as ``UnsupportedModelError``).
  Under "sdpa" the softmax is inside the fused kernel: the patch never sees it and the temperature has no
  effect. (GPT-2's eager attention calls ``softmax(w, dim=-1)``: there the rule applies, and equals dpa's.)
  The patch is global: any other softmax in the context is tempered too, e.g. the probability-difference metric
  (MIB's greater-than); this adapter runs the metric with torch's own softmax, as dpa's "gim" does.
* q/k/v gradient scales (0.25, 0.25, 0.5): wraps ``torch.nn.functional.scaled_dot_product_attention``, scaling
  the gradient of its q, k and v arguments. Applied under "sdpa" (HF's sdpa kernel looks the function up at
  each call); never under "eager", which does not call it.
* nothing else: no rule for the MLP (0.1.4 has neither the gate/up gradient scales -- added on GitHub after the
  release, not on PyPI -- nor a linearised SiLU / GELU: neither version has one), no rule for attention
  soft-caps, no freezing of Gemma's post-norms or q/k norms.

Measured (tiny float64 models, ``dpa.tiny.tiny_model``: 3 layers, 4 heads, 2 KV heads; token scores
embedding . gradient of one logit, 7 tokens; transformers 5.24, torch 2.13; the package's default context)::

    family       attention  norms frozen  temperature      q/k/v scales  |pkg - autograd|  |pkg - dpa gim|  max|dpa gim|
    llama        eager      none          TypeError        not applied   (raises)          (raises)         1.2e-1
    llama        sdpa       none          no effect (0)    applied       1.9e-1            5.4e-2           1.2e-1
    gemma3_text  eager      none          TypeError        not applied   (raises)          (raises)         2.2e0
    gemma3_text  sdpa       none          no effect (0)    applied       4.5e-1            2.3e0            2.2e0
    gpt2         eager      LayerNorm     applied          not applied   1.9e-3            5.7e-4           2.3e-2
    gpt2         sdpa       LayerNorm     no effect (0)    applied       1.8e-3            4.3e-4           2.3e-2

On llama and gemma3_text under "sdpa" the package's gradient equals, to the last bit (difference 0.0), plain
autograd with the gradients of q_proj, k_proj and v_proj's outputs scaled by 0.25, 0.25, 0.5; and dpa's
linearised model with mu = 1 everywhere inside the package's context equals dpa with mu_q = mu_k = 0.25,
mu_v = 0.5, mu_gate = mu_up = 1 (difference 0.0): the package's q/k/v rule is exactly dpa's mu for q, k, v. With
the temperature turned off (``softmax_temperature=None``) the package under "eager" applies nothing: its
gradient is the model's own (difference 0.0). On GPT-2 under "eager" the package's temperature rule inside dpa's
mu = 1 model equals dpa's own T = 2 rule to 1e-18.

So on the llama and gemma3_text families the package as shipped is, under "sdpa" (HF's default), the model's own
backward with the q/k/v gradient scales and nothing else; under "eager" it runs only with the temperature off,
and is then the model's own backward (EAP). On MIB's graph (``gim_package_scores``, tiny llama and gemma3_text,
"sdpa"; ``tests/test_gim_package.py`` asserts each): the logits reader's and the last MLP reader's scores equal
EAP's (1e-12: no norm or MLP rule), the last layer's q and k readers' are 0.25 x EAP's and its v readers'
0.5 x EAP's, T = 2 and T = None give the same scores, and the logits reader's differ from dpa's "gim" (which
freezes the final norm).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpa.errors import UnsupportedModelError
from dpa.mib.forward import batches
from dpa.mib.graph import Graph
from dpa.mib.methods import scores_in
from dpa.mib.pairs import Pairs
from dpa.request import check_model


def gim_package_scores(model: nn.Module, pairs: Pairs, *, batch_size: int = 8,
                       temperature: float | None = 2.0) -> Tensor:
    """Edge scores [writer reader] (``Graph.of(spec)``'s indexing; 0 where there is no edge), summed over the pairs:
    Δ_u . g_r with g_r the gradient under ``gim.GIM(model, softmax_temperature=temperature)`` (the package's other
    settings its defaults: norms frozen, q/k/v gradient scales 0.25, 0.25, 0.5). ``temperature`` None (or 1):
    the package's softmax patch off. See the module docstring for what the package applies on which model."""
    from gim import GIM

    spec = check_model(model)
    if spec.mixed:  # its rules are attention's and norms'; on a mixer's readers it would be the model's own gradient
        raise UnsupportedModelError(
            f"gim-explain applies its rules to attention and norms; the {spec.family} model's "
            f"{', '.join(sorted(set(spec.layer_kinds) - {'attention'}))} layers would get the model's own gradient "
            "(EAP's) under its name, so this comparison runs on attention-only models")
    graph = Graph.of(spec)
    t = None if temperature is None or float(temperature) == 1.0 else float(temperature)
    own = (F.softmax, torch.softmax, torch.Tensor.softmax)  # torch's, before the package replaces them
    total = torch.zeros(graph.exists.shape, dtype=torch.float64)
    # Entered before dpa's instrument (which ``batches`` enters for each batch): the norm modules the package swaps
    # in are then the ones dpa's run calls, and dpa sees no hooks (0.1.4 puts none on modules; a version that does
    # is refused by dpa's instrument, loudly).
    with GIM(model, softmax_temperature=t):
        try:
            for batch in batches(model, pairs, batch_size, weights=None, grad=True):
                batch = dataclasses.replace(batch, metric=_with_softmax(batch.metric, own))
                total += scores_in(batch, graph, "gim", 1)
        except TypeError as e:
            if "F_patched" not in str(e):
                raise
            raise UnsupportedModelError(
                f"gim-explain's softmax patch cannot run this model's attention ({e}): it takes no dtype argument, "
                "which transformers' eager attention passes; use attn_implementation='sdpa' (where the package's "
                "temperature has no effect) or temperature=None") from e
    return total * graph.exists


def _with_softmax(metric, own):
    """The metric with torch's own softmax: the package's patch is global, and would temper the softmax of the
    probability-difference metric, which is not the model's attention."""
    def exact(logits: Tensor) -> Tensor:
        with _softmax(own):
            return metric(logits)
    return exact


@contextmanager
def _softmax(fns):
    saved = (F.softmax, torch.softmax, torch.Tensor.softmax)
    F.softmax, torch.softmax, torch.Tensor.softmax = fns
    try:
        yield
    finally:
        F.softmax, torch.softmax, torch.Tensor.softmax = saved
