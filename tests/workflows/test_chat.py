"""Token in, token out across calls: a follow-up prompt keeps the previous call's exact ids and adds the
chat template's separator and the new messages (SmolLM2's ChatML template, and the byte-level one)."""

from __future__ import annotations

import pytest

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
