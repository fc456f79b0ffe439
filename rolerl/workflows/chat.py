"""Token in, token out across model calls: the prompt of a follow-up call is the previous call's exact ids
(prompt and completion, tool output spliced in) plus the chat template's rendering of what comes after,
never a re-tokenisation of decoded text (which can merge or split tokens differently from what the model
sampled, so the trainer would score tokens the model never produced).

`follow_up_ids(tokenizer, turn, messages)` renders the conversation with a placeholder as the assistant's
reply, keeps the text after the placeholder (the template's end-of-turn marker, the new messages and the
generation prompt), drops the end-of-turn marker when the completion already ended with the EOS token the
model sampled, and tokenises that suffix on its own. Chat templates put a special token at this boundary
(`<|im_end|>` in ChatML, SmolLM2 and Qwen), so the suffix tokenises as it would inside the whole text.
"""

from __future__ import annotations

from typing import Any

from rolerl.tasks.base import Messages
from rolerl.types import Turn

_PLACEHOLDER = "\x00rolerl-reply\x00"


def follow_up_ids(
    tokenizer: Any, turn: Turn, messages: Messages, *, add_generation_prompt: bool = True
) -> list[int]:
    """`turn.prompt_ids + turn.completion_ids` followed by the template's rendering of `messages` (user or
    tool messages answering the turn) and, by default, the generation prompt of the next reply."""
    if not messages:
        raise ValueError("follow_up_ids needs at least one message after the model's reply")
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}, *messages]
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=add_generation_prompt)
    if text.count(_PLACEHOLDER) != 1:
        raise ValueError("the chat template did not render the assistant reply verbatim; cannot splice ids")
    suffix = text.split(_PLACEHOLDER, 1)[1]
    completion = list(turn.completion_ids)
    eos = tokenizer.eos_token
    if completion and eos and completion[-1] == tokenizer.eos_token_id and suffix.startswith(eos):
        suffix = suffix[len(eos) :]  # the model sampled the end-of-turn token itself
    elif eos and not suffix.startswith(eos):
        raise ValueError(f"the chat template does not close the assistant reply with {eos!r}")
    return list(turn.prompt_ids) + completion + _encode(tokenizer, suffix)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
