"""Token in, token out across calls: a follow-up prompt keeps the previous call's exact ids and adds the
chat template's separator and the new messages (SmolLM2's ChatML template, the byte-level one, Qwen's format and,
when one is on disk, a real Qwen tokenizer)."""

from __future__ import annotations

import copy
import os

import pytest
from transformers import AutoTokenizer

from rolerl.models.tiny import byte_tokenizer
from rolerl.types import Turn
from rolerl.workflows.chat import follow_up_ids


def turn_of(tokenizer, reply_ids: list[int]) -> Turn:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    n = len(reply_ids)
    return Turn("policy", list(prompt), reply_ids, ["reasoning"] * n, [0] * (len(prompt) + n), [0.0] * n)


@pytest.mark.parametrize("which", ["smollm2", "bytes"])
def test_follow_up_equals_the_template_on_the_whole_conversation(tokenizer, which):
    tok = tokenizer if which == "smollm2" else byte_tokenizer()
    reply = tok("It is 5.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    turn = turn_of(tok, reply)
    feedback = [{"role": "user", "content": "Are you sure? Check again."}]
    got = follow_up_ids(tok, turn, feedback)
    whole = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "It is 5."},
        *feedback,
    ]
    want = tok.apply_chat_template(whole, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    assert got == list(want)  # the same ids where re-tokenising the text is harmless ...
    text = tok.decode(got)
    assert text.endswith(
        "It is 5.<|im_end|>\n<|im_start|>user\nAre you sure? Check again.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_follow_up_keeps_ids_that_re_tokenising_would_change(tokenizer):
    """The model sampled `Hel` + `lo` where the tokenizer would write `Hello`: the follow-up keeps the two
    sampled ids (re-rendering the decoded text would give one token the model never sampled), and a reply
    cut by the length limit (no EOS) gets the template's end-of-turn marker."""
    hel = tokenizer("Hel", add_special_tokens=False)["input_ids"]
    lo = tokenizer("lo", add_special_tokens=False)["input_ids"]
    assert tokenizer("Hello", add_special_tokens=False)["input_ids"] != hel + lo
    turn = turn_of(tokenizer, hel + lo)  # no EOS: cut by max_new_tokens
    got = follow_up_ids(tokenizer, turn, [{"role": "user", "content": "go on"}])
    start = len(turn.prompt_ids)
    assert got[: start + len(hel + lo)] == turn.prompt_ids + hel + lo
    assert got[start + len(hel + lo)] == tokenizer.eos_token_id  # the template closes the reply
    with pytest.raises(ValueError, match="at least one message"):
        follow_up_ids(tokenizer, turn, [])


# Qwen's chat format, written here from its documentation (ChatML; a default system message when the
# conversation has none; tool results as a user turn of <tool_response> blocks; the <think> part of
# assistant turns before the last user message dropped), and EOS = <|endoftext|> as in Qwen's base models,
# so the reply's closing marker is not the tokenizer's EOS.
QWEN_FORMAT = (
    "{% if messages[0].role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"  # trim_blocks eats a bare newline
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in m.content %}"
    "<|im_start|>assistant\n{{ m.content.split('</think>')[-1].lstrip() }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_format_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN_FORMAT
    tok.eos_token = "<|endoftext|>"
    return tok


def qwen_tokenizers(tokenizer) -> list:
    """The Qwen-format tokenizer above, and a real Qwen tokenizer when one is on disk
    (`ROLERL_QWEN_TOKENIZER=DIR` or the Hugging Face cache; never downloaded)."""
    found = [qwen_format_tokenizer(tokenizer)]
    for source in filter(
        None, [os.environ.get("ROLERL_QWEN_TOKENIZER"), "Qwen/Qwen3-0.6B", "Qwen/Qwen2.5-0.5B-Instruct"]
    ):
        try:
            found.append(AutoTokenizer.from_pretrained(source, local_files_only=True))
        except (OSError, ValueError):
            continue
    return found


def test_qwen_separators_after_an_assistant_reply(tokenizer):
    """assistant -> user and assistant -> tool in Qwen's format: the follow-up is the reply's ids, the
    `<|im_end|>` the model sampled (not the tokenizer's EOS), then the template's next turn."""
    for tok in qwen_tokenizers(tokenizer):
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        reply = tok("It is 5.", add_special_tokens=False)["input_ids"]
        for ended in (True, False):  # sampled <|im_end|>, or cut by the length limit
            turn = turn_of(tok, reply + [im_end] * ended)
            for after, text in [
                ([{"role": "user", "content": "Check."}], "<|im_end|>\n<|im_start|>user\nCheck.<|im_end|>\n"),
                ([{"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}],
                 "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n"
                 "</tool_response><|im_end|>\n"),
            ]:  # fmt: skip
                got = follow_up_ids(tok, turn, after)
                assert got[: len(turn.ids)] == turn.ids
                assert tok.decode(got[len(turn.prompt_ids) :]) == f"It is 5.{text}<|im_start|>assistant\n"
                assert (
                    got.count(im_end) == turn.prompt_ids.count(im_end) + 1 + len(text.split("<|im_end|>")) - 2
                )
                whole = [
                    {"role": "user", "content": "What is 2+3?"},
                    {"role": "assistant", "content": "It is 5."},
                ]
                want = tok.apply_chat_template([*whole, *after], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]  # fmt: skip
                assert got == list(want)


def test_qwen_follow_up_keeps_the_thinking_the_template_would_drop(tokenizer):
    """Qwen's template drops `<think>` from assistant turns before the last user message; the follow-up
    keeps the ids the model saw and sampled, so the next call continues the same context."""
    tok = qwen_format_tokenizer(tokenizer)
    reply = tok("<think>\n2+3=5\n</think>\n\nIt is 5.", add_special_tokens=False)["input_ids"]
    turn = turn_of(tok, reply + [tok.convert_tokens_to_ids("<|im_end|>")])
    got = follow_up_ids(tok, turn, [{"role": "user", "content": "Check."}])
    assert tok.decode(got).count("2+3=5") == 1 and got[: len(turn.ids)] == turn.ids
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": tok.decode(reply)},
         {"role": "user", "content": "Check."}], add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert "2+3=5" not in rendered


def test_a_template_that_closes_a_reply_with_plain_text_is_refused(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{%- for m in messages %}{{ m.role }}: {{ m.content }}\n\n{%- endfor %}"
    turn = turn_of(qwen_format_tokenizer(tokenizer), [1, 2])
    with pytest.raises(ValueError, match="not a special token"):
        follow_up_ids(tok, turn, [{"role": "user", "content": "go on"}])
