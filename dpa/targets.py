"""Targets: the direction DPA propagates (book: residual-stream-and-targets).

A target is a direction ``u`` in the space of the final *normalised* residual (where the
unembedding rows live); the attributed quantity is ``u . norm_final(x^(L))`` at the target
position. The backward through the frozen final norm folds it into ``u * gamma_f * r_f``.

* ``token``    u = W_U[y]                      (the logit of y)
* ``contrast`` u = W_U[y] - W_U[y']            (the logit difference)
* ``logprob``  u = W_U^T (e_y - p), p held fixed (the gradient of log p(y))
* ``vector``   u = any vector (a probe, a feature)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from .errors import TargetError
from .rules.softcap import softcap_ratio

Kind = Literal["token", "contrast", "logprob", "vector"]


@dataclass(frozen=True)
class TargetSpec:
    """What one sample's target is (resolved to ids)."""

    kind: Kind
    token_id: int | None = None
    contrast_id: int | None = None
    vector: Tensor | None = None  # [d_model], kind == "vector"
    text: str | None = None  # the target as the caller wrote it, when a string (for spelling hints)
    contrast_text: str | None = None
    tokens: tuple[int, ...] = ()  # a target of several tokens (multi_token="sum"): all of them, tokens[0] == token_id
    contrast_tokens: tuple[int, ...] = ()  # a contrast of several tokens: read in a row of its own (its own tokens
    # forced), whose target is the contrast negated (``negate``)
    negate: bool = False  # the direction is minus the token's (the row of a contrast of several tokens)

    @property
    def n_terms(self) -> int:
        """How many positions the target reads: its tokens under teacher forcing (1 for a one-token target)."""
        return max(1, len(self.tokens))

    def term(self, j: int) -> TargetSpec:
        """The one-token target of term j: the j-th token of the target (term 0 keeps the contrast)."""
        if j == 0 and not self.contrast_tokens:
            return TargetSpec(self.kind, token_id=self.token_id, contrast_id=self.contrast_id, vector=self.vector,
                              negate=self.negate)
        token = self.tokens[j] if self.tokens else self.token_id
        return TargetSpec("logprob" if self.kind == "logprob" else "token", token_id=token, negate=self.negate)


def token_id(tokenizer, token: str | int, vocab_size: int, *, multi_token: str = "error", what: str = "target",
             options: tuple[str, ...] = ("error", "first")) -> int:
    """The id of a single-token string (or a checked int id).

    ``multi_token="first"`` takes the first token of a string that splits into several;
    the default raises and says how it splits.
    """
    ids = token_ids(tokenizer, token, vocab_size, multi_token="first" if multi_token == "first" else "error",
                    what=what, options=options)
    return ids[0]


def token_ids(tokenizer, token: str | int, vocab_size: int, *, multi_token: str = "error",
              what: str = "target", options: tuple[str, ...] = ("error", "first", "sum")) -> tuple[int, ...]:
    """The ids of a target string (or a checked int id): one id, or with ``multi_token="sum"`` every token of a
    string that splits into several (attributed as the sum of its tokens under teacher forcing).
    ``options``: the values of ``multi_token`` the caller offers (the error names those)."""
    if isinstance(token, bool):
        raise TargetError(f"{what} must be a token string or id, got {token!r}")
    if isinstance(token, int):
        if not 0 <= token < vocab_size:
            raise TargetError(f"{what} id {token} is outside the vocabulary (size {vocab_size})")
        return (token,)
    if not isinstance(token, str):
        raise TargetError(f"{what} must be a token string or id, got {type(token).__name__}")
    if tokenizer is None:
        raise TargetError(f"a string {what} {token!r} needs a tokenizer; pass a token id instead")
    if token == "":
        raise TargetError(f"{what} is an empty string")
    ids = tokenizer.encode(token, add_special_tokens=False)
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in ids and token != getattr(tokenizer, "unk_token", None):
        raise TargetError(f"{what} {token!r} is not in the tokenizer's vocabulary (it maps to the unknown token "
                          f"{tokenizer.unk_token!r}); pass a token the model knows, or its id")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:  # a token added to the tokenizer, the model's embeddings not resized
        raise TargetError(f"{what} {token!r} is token id {outside[0]} of the tokenizer, outside the model's vocabulary "
                          f"(size {vocab_size}): tokens added to the tokenizer need model.resize_token_embeddings")
    if len(ids) != 1:
        pieces = [token_text(tokenizer, i) for i in ids]
        if multi_token == "first" and ids:
            return (ids[0],)
        if multi_token == "sum" and ids:
            return tuple(ids)
        others = [v for v, _ in single_token_spellings(tokenizer, token)] if token.strip() else []
        # a piece is worth suggesting only if it reads back as itself (a byte of a character does not)
        typed = next((p for p, i in zip(pieces, ids) if tokenizer.encode(p, add_special_tokens=False) == [i]), None)
        whole = ("attribute the whole of it, the sum of its tokens' logits under teacher forcing (multi_token='sum' "
                 "in Python, --multi-token sum on the command line), " if "sum" in options else "")
        piece = (f"pass one of the pieces (e.g. {typed!r})" if typed is not None else
                 f"pass a piece's id in Python (e.g. {ids[0]}: the pieces are parts of one character)")
        first = ("attribute the first (multi_token='first' in Python, --multi-token first on the command line)"
                 if "first" in options else "")
        advice = whole + (f"{piece}, or {first}" if first else piece)
        raise TargetError(f"{what} {token!r} is not a single token: it splits into {len(ids)} tokens {pieces!r}. "
                          + (f"{others[0]!r} is one token; or {advice}" if others else advice[0].upper() + advice[1:]))
    return (ids[0],)


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2, Llama 3, SmolLM2, Qwen): the printable Latin-1 bytes
    stand for themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in kept}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return table


BYTE_ALPHABET = _byte_alphabet()


def token_text(tokenizer, token: int) -> str:
    """How one token reads. A token holding part of a multi-byte character (an emoji, a CJK character
    split across tokens) decodes alone to U+FFFD; it is shown as its bytes instead ('\\xf0\\x9f'), so
    that two different pieces never look the same."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text
    raw = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(raw, str) or not raw:
        return text
    if all(c in BYTE_ALPHABET for c in raw):
        data = bytes(BYTE_ALPHABET[c] for c in raw)
        return "".join(chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}" for b in data)
    return raw  # e.g. SentencePiece's byte tokens, '<0xF0>'


def target_direction(spec: TargetSpec, unembed: Tensor, probs: Tensor | None = None,
                     capped: tuple[Tensor, float] | None = None) -> Tensor:
    """u for one sample: [d_model], in unembed's dtype. ``probs`` [vocab] for logprob.

    ``capped``: (pre-cap logits [vocab], c) of a model whose final logits are soft-capped, c tanh(z / c)
    (Gemma 2). A token or contrast target is then the pre-cap logit, linear in the residual (the capped one
    is reported beside it). A log-probability's direction linearises the cap as the activations are:
    c tanh(z / c) = z * rho(z) with rho frozen, so u . x = capped z_y - E_p[capped z]."""
    if spec.kind == "vector":
        return spec.vector.to(unembed)
    u = unembed[spec.token_id].clone()
    if spec.kind == "contrast":
        u = u - unembed[spec.contrast_id]
    elif spec.kind == "logprob":
        if capped is None:
            u = u - probs.to(unembed) @ unembed
        else:
            z, c = capped
            z = z.to(unembed)
            rho = softcap_ratio(z, c)
            u = u * rho[spec.token_id] - (probs.to(unembed) * rho) @ unembed
    return -u if spec.negate else u


def single_token_spellings(tokenizer, text: str) -> list[tuple[str, int]]:
    """Other spellings of ``text`` (with or without a leading space; as written, lower, capitalised, upper
    case) that are one token, with their ids."""
    core, seen, out = text.strip(), {text}, []
    for form in (core, core.lower(), core.capitalize(), core.upper()):
        for variant in (" " + form, form):
            if variant not in seen:
                seen.add(variant)
                ids = tokenizer.encode(variant, add_special_tokens=False)
                if len(ids) == 1:
                    out.append((variant, ids[0]))
    return out


def continuation_hint(tokenizer, text: str | None, first: int, probs: Tensor, what: str = "target") -> str | None:
    """``spelling_hint`` for a target of several tokens (teacher forcing), judged on its first token: a warning
    when ``text`` with (or without) its leading space begins with a token the model finds far likelier at the
    first position, at least 5 % and ten times the first token's probability. ``probs`` [vocab] are there."""
    if tokenizer is None or not text or not text.strip():
        return None
    other = text.lstrip() if text.startswith(" ") else " " + text
    ids = tokenizer.encode(other, add_special_tokens=False)
    if not ids or ids[0] == first:
        return None
    p, q = float(probs[first]), float(probs[ids[0]])
    if q < 0.05 or q < 10 * p:
        return None
    change = "without the leading space" if text.startswith(" ") else "with a leading space"
    return (f"{what} {text!r} begins with a token of p = {p:.2g} at this position, while {other!r} ({change}) begins "
            f"with one of p = {q:.2g}: did you mean {other!r}? (tokenizers treat ' word' and 'word' as different "
            "tokens)")


def spelling_hint(tokenizer, text: str | None, token: int, probs: Tensor, what: str = "target") -> str | None:
    """A warning when another spelling of the string ``text`` (a leading space, another case) is one token
    that the model finds far likelier at the position: at least 5 % and ten times ``token``'s probability.
    ``probs`` [vocab] are the model's next-token probabilities there."""
    if tokenizer is None or not text or not text.strip():
        return None
    core, best = text.strip(), None
    for variant, i in single_token_spellings(tokenizer, text):
        if i != token and (best is None or probs[i] > probs[best[1]]):
            best = (variant, i)
    if best is None:
        return None
    p, q = float(probs[token]), float(probs[best[1]])
    if q < 0.05 or q < 10 * p:
        return None
    changes = []
    if text.startswith(" ") != best[0].startswith(" "):
        changes.append("with a leading space" if best[0].startswith(" ") else "without the leading space")
    if best[0].strip() != core:
        changes.append("in another case")
    return (f"{what} {text!r} has p = {p:.2g} at this position, while {best[0]!r} ({' and '.join(changes)}) has "
            f"p = {q:.2g}: did you mean {best[0]!r}? (tokenizers treat ' word' and 'word' as different tokens)")
