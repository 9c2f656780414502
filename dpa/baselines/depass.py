"""DePass: a decomposed forward pass with frozen activations (Hong et al., 2025).

Every residual stream is split into one additive part per input token: ``x[i, c]`` is the part of
position i's residual that comes from token c (initially the embedding of token c at i = c), and
``sum_c x[i, c]`` always equals the real residual. Each block is applied to the parts with every
nonlinearity frozen at its clean-forward value:

* RMSNorm: the scale 1/sigma of the whole stream, so the norm is linear (gamma * r, or Gemma's
  (1 + gamma) * r); a norm after a block (Gemma 3, OLMo 2) is one more such map on the block's
  output, with the scale of the whole block output;
* attention: the post-softmax probabilities, so each head moves value parts between positions;
* GLU: DePass's neuron rule, not a linearisation: the activation a_{n,i} = act(s) u of the
  whole stream (act: SiLU, or Gemma's tanh GELU) is handed out to the parts in proportion to
  softmax_c(s_{n,i,c} / tau), where
  s_{n,i,c} is part c's share of the gate pre-activation (tau = 0.1, DePass's default; parts
  absent from position i by causality are excluded, and so is the first token's part away from
  its own position, as DePass's default ``ignore_special_token`` does for the BOS / sink token).

A token's score is the target direction applied to its part of the final residual (through the
frozen final norm), so the scores sum to the target logit on bias-free models. Qwen2's value
biases belong to no token and are dropped. Memory grows as pos^2 * d_model; long prompts are
processed in chunks.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from ..families import norm_eps
from ..rules.norm import GAIN, rms_scale
from ..result import Attribution
from ..checks import check_bool, check_choice, check_float
from .common import Prompt, causal, prepare, result
from .internals import Internals, Layer, forward_internals, frozen, require_layout

_CHUNK = 2 ** 25  # elements per intermediate tensor
_ROWS = 32  # positions per GLU chunk: smaller chunks skip more of the absent (future) parts


def _attention(x: Tensor, layer: Layer) -> Tensor:
    """Attention output of every part [pos part d_model] with frozen probabilities and norms."""
    a = layer.weights
    t = x.shape[0]
    xn = frozen(x, layer.pre_attn)
    probs = layer.probs[0].view(a.n_kv_heads, a.group, t, t)  # [kv_head group query key]
    out = torch.empty_like(x)
    step = max(1, _CHUNK // (t * a.n_heads * a.d_head))
    for parts in torch.arange(t).split(step):
        v = (xn[:, parts] @ a.v.T).view(t, len(parts), a.n_kv_heads, a.d_head)  # [key part kv_head d_head]
        z = torch.einsum("kgij,jpkd->ipkgd", probs, v).reshape(t, len(parts), -1)  # [query part head*d_head]
        out[:, parts] = z @ a.o.T
    return frozen(out, layer.post_attn)


def _glu(x: Tensor, layer: Layer, temperature: float, skip_first: bool, rule: str) -> Tensor:
    """GLU output of every part [pos part d_model] under the neuron rule, with frozen norms."""
    w = layer.weights
    t = x.shape[0]
    xn = frozen(x, layer.pre_mlp)
    if rule == "up":  # act(s) frozen, the up projection linear in the parts
        return frozen((layer.act[0][:, None, :] * (xn @ w.up.T)) @ w.down.T, layer.post_mlp)
    act = layer.act[0] * layer.up[0]  # [pos d_mlp] of the whole stream
    present = causal(t, x.device)  # [pos part]
    if skip_first and t > 1:
        present[1:, 0] = False  # the first token's part gets MLP shares only at its own position
    out = torch.zeros_like(x)
    step = max(1, min(_ROWS, _CHUNK // (t * w.gate.shape[0])))
    for start in range(0, t, step):
        stop = min(t, start + step)  # rows start..stop-1 hold parts 0..stop-1 only (causality)
        s = (xn[start:stop, :stop] @ w.gate.T) / temperature  # [pos part d_mlp] each part's gate share
        s = s.masked_fill(~present[start:stop, :stop, None], float("-inf"))
        share = torch.softmax(s, dim=1)
        out[start:stop, :stop] = (share * act[start:stop, None, :]) @ w.down.T
    return frozen(out, layer.post_mlp)


def decompose(cap: Internals, temperature: float = 0.1, skip_first: bool = True,
              neuron_rule: str = "softmax") -> Tensor:
    """Every layer applied to the per-token parts: the final residual's parts [pos part d_model] (before the
    final norm), which sum over parts to the final residual (less the biases no token owns)."""
    emb = cap.embeddings[0]
    t = emb.shape[0]
    x = torch.zeros(t, t, emb.shape[-1], dtype=emb.dtype, device=emb.device)  # [pos part d_model]
    diagonal = torch.arange(t, device=emb.device)
    x[diagonal, diagonal] = emb
    for layer in cap.layers:
        x = x + _attention(x, layer)
        x = x + _glu(x, layer, temperature, skip_first, neuron_rule)
    return x


@torch.no_grad()
def depass(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None, position: int | None = None,
           temperature: float = 0.1, skip_first: bool = True,
           neuron_rule: Literal["softmax", "up"] = "softmax") -> Attribution:
    """Token scores from a decomposed forward pass (attention and activations frozen).

    neuron_rule="up" replaces DePass's softmax rule by the linear one (act(s) frozen, u split
    over the parts); the scores are then DPA's with only the value and up paths.
    """
    check_choice("neuron_rule", neuron_rule, ("softmax", "up"))
    temperature = check_float("temperature", temperature, above=0.0)
    skip_first = check_bool("skip_first", skip_first)
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    require_layout(req.spec, "depass")
    cap = forward_internals(model, req, decompose=True)
    final = decompose(cap, temperature, skip_first, neuron_rule)[req.position(0)]  # [part d_model]
    norm = req.spec.final_norm(model)
    scale = rms_scale(cap.resid_final[0, req.position(0)], norm_eps(norm)).to(final.dtype)
    unembed = req.spec.unembed(model).weight
    target = req.targets[0]
    u = unembed[target.token_id]
    if target.contrast_id is not None:
        u = u - unembed[target.contrast_id]
    u = req.spec.logits(u)  # the logits the model scales (Granite, Falcon-H1)
    scores = (final * GAIN[req.spec.parts.norm_kind](norm.weight) * scale) @ u.to(final.dtype)
    return result(model, req, "depass", token_scores=scores)
