"""The paper's prompt formats, tokenised, with the positions that count as context units.

* Known 1000, IOI: the raw text, tokenised as the tokenizer does (BOS when it adds one).
* SQuAD, IMDb: the chat template with the instruction as system turn, the context and question
  (or review) as user turn, and "Answer:" as a continued assistant turn (``prompt="chat"``, the paper's form).
  A base model without a chat template reads the same three parts as plain text (``prompt="plain"``):
  ``"{instruction}\n\n{user turn}\nAnswer:"`` after the tokenizer's BOS.

Context units are the tokens of the raw text, or of the context inside the user turn: the paragraph (SQuAD) or
the review (IMDb), as the reference data defines it (``Example.units``); its "Context:" / "Review:" label, the
question, BOS, the system turn, role markers and the prefill are never ablated. The target is the first token of
" " + answer (a leading bare-space token, as SentencePiece tokenizers emit, is skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError, InputTypeError, UnsupportedModelError
from .datasets import Example

PROMPTS = ("chat", "plain")  # how a chat example (SQuAD, IMDb) is written out: the chat template, or plain text


@dataclass(frozen=True)
class Sample:
    """One tokenised example."""

    id: str
    input_ids: list[int]
    context: list[bool]  # True where a token is a context unit (ablatable)
    target_id: int
    contrast_id: int | None

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def position(self) -> int:
        return len(self.input_ids) - 1


def first_token(tokenizer, word: str) -> int:
    """The first token of " " + word."""
    if not isinstance(word, str):
        raise InputTypeError(f"word must be a string (an answer or contrast), got {type(word).__name__}")
    if not word.strip():
        raise InputError(f"word must be a non-empty string (an answer or contrast), got {word!r}")
    ids = tokenizer.encode(" " + word, add_special_tokens=False)
    if len(ids) > 1 and not tokenizer.decode(ids[:1]).strip():
        ids = ids[1:]
    if not ids:
        raise InputError(f"word {word!r} tokenises to nothing")
    return ids[0]


def check_prompt(prompt) -> str:
    if not isinstance(prompt, str) or prompt not in PROMPTS:
        raise InputError(f"prompt must be one of {', '.join(map(repr, PROMPTS))} (how SQuAD and IMDb prompts are "
                         f"written: the chat template, or plain text for a base model), got {prompt!r}")
    return prompt


def prompt_text(tokenizer, ex: Example, prompt: str = "chat") -> str:
    """A chat example written out: through the tokenizer's chat template, or as plain text."""
    if check_prompt(prompt) == "plain":
        return f"{ex.system}\n\n{ex.user}\n{ex.prefill}"
    if not getattr(tokenizer, "chat_template", None):
        raise UnsupportedModelError("this dataset uses the chat template, but the tokenizer has none: use an "
                                    "instruct model, or prompt='plain' (--prompt plain) for a base model")
    messages = [{"role": "system", "content": ex.system}, {"role": "user", "content": ex.user},
                {"role": "assistant", "content": ex.prefill}]
    return tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)


def encode_example(tokenizer, ex: Example, prompt: str = "chat") -> Sample:
    """Tokenise an example in the paper's format (``prompt``: how a chat example is written, see PROMPTS) and mark
    its context units."""
    check_prompt(prompt)
    if not ex.chat:
        enc = tokenizer(ex.text)
        special = set(tokenizer.all_special_ids)
        context = [i not in special for i in enc["input_ids"]]
    else:
        text = prompt_text(tokenizer, ex, prompt)
        start = text.find(ex.user, text.find(ex.system) + len(ex.system))
        if start < 0:
            raise UnsupportedModelError("the tokenizer's chat template does not contain the user turn verbatim, so "
                                        "the context tokens cannot be found")
        end = start + len(ex.user)
        if ex.units is not None:  # the paragraph or review inside the user turn
            inner = text.find(ex.units, start, end)
            if inner < 0:
                raise InputError(f"example {ex.id!r}: its units text is not inside its user turn")
            start, end = inner, inner + len(ex.units)
        enc = tokenizer(text, add_special_tokens=prompt == "plain", return_offsets_mapping=True)  # chat: own BOS
        context = [a < end and b > start and b > a for a, b in enc["offset_mapping"]]
    contrast = None if ex.contrast is None else first_token(tokenizer, ex.contrast)
    return Sample(id=ex.id, input_ids=list(enc["input_ids"]), context=context,
                  target_id=first_token(tokenizer, ex.answer), contrast_id=contrast)
