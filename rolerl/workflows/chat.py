"""Token in, token out across model calls: the prompt of a follow-up call is the previous call's exact ids
(prompt and completion, tool output spliced in) plus the chat template's rendering of what comes after,
never a re-tokenisation of decoded text (which can merge or split tokens differently from what the model
sampled, so the trainer would score tokens the model never produced).

`follow_up_ids(tokenizer, turn, messages)` renders the conversation with a placeholder as the assistant's
reply, keeps the text after the placeholder (the template's end-of-turn marker, the new messages and the
generation prompt), drops the end-of-turn marker when the completion already ends with it (the model
sampled it: `<|im_end|>` in ChatML, SmolLM2 and Qwen, whatever the tokenizer calls its EOS), and
tokenises that suffix on its own. The marker must be a special token, so that the suffix tokenises as it
would inside the whole text; a template that closes the reply with plain text is refused.

The prompt is the previous call's ids, not the template's rendering of the whole conversation: where a
template rewrites earlier turns (Qwen3 drops the `<think>` part of assistant turns before the last user
message), the follow-up keeps what the model saw and sampled.
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
    marker = _leading_special(tokenizer, suffix)
    if marker is None:
        raise ValueError(
            f"the chat template closes the assistant reply with {suffix[:20]!r}, not a special token: the "
            "follow-up's ids could differ from the template's tokenisation at the boundary"
        )
    completion = list(turn.completion_ids)
    if completion and completion[-1] == tokenizer.convert_tokens_to_ids(marker):
        suffix = suffix[len(marker) :]  # the model sampled the end-of-turn token itself
    return list(turn.prompt_ids) + completion + _encode(tokenizer, suffix)


def _leading_special(tokenizer: Any, text: str) -> str | None:
    """The longest special (added) token that `text` starts with, or None."""
    specials = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    found = [t for t in specials if t and text.startswith(t)]
    return max(found, key=len) if found else None


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
