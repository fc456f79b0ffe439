"""Token kinds, the tag state machine, `shift`, and segment-wise tokenisation (on the real SmolLM2 tokenizer)."""

from __future__ import annotations

import random

import pytest
import torch

from rolerl.roles import (
    ANSWER,
    KIND_INDEX,
    KINDS,
    POLICY_KINDS,
    REASONING,
    TOOL_CALL,
    TOOL_OUTPUT,
    TagEvent,
    Tags,
    TagStateMachine,
    encode_exact,
    format_tool_output,
    kind_table,
    shift,
    shift_batch,
    splice_tokenize,
    split_segments,
    token_bytes,
)

R, C, X, A, P = REASONING, TOOL_CALL, TOOL_OUTPUT, ANSWER, "prompt"  # X: tool output (forced)


def pieces(tok, text: str) -> list[bytes]:
    return [token_bytes(tok)[i] for i in tok.encode(text, add_special_tokens=False)]


def one_token(tok, text: str) -> int:
    """The id of the single token whose bytes are `text` (fails if the vocabulary has none)."""
    matches = [i for i, b in enumerate(token_bytes(tok)) if b == text.encode()]
    assert matches, f"no single token {text!r}"
    return matches[0]


def stream(tok, *texts: str) -> list[int]:
    """Concatenate real tokenisations of `texts`, each tokenised alone (a scripted sampled stream)."""
    return [i for t in texts for i in tok.encode(t, add_special_tokens=False)]


# ---------------------------------------------------------------------------------------------------------
# Kinds and tags


def test_kind_constants():
    assert KINDS == ("prompt", "reasoning", "tool_call", "tool_output", "answer")
    assert frozenset({"reasoning", "tool_call", "answer"}) == POLICY_KINDS
    assert [KIND_INDEX[k] for k in KINDS] == [0, 1, 2, 3, 4]


def test_tags_validation_names_the_field():
    assert Tags(answer_open=None, answer_close=None).answer_open is None
    with pytest.raises(ValueError, match="Tags.tool_close"):
        Tags(tool_close="")
    with pytest.raises(ValueError, match="Tags.output_open.*Tags.tool_open"):
        Tags(output_open="<code>")
    with pytest.raises(ValueError, match="answer_open and Tags.answer_close"):
        Tags(answer_close=None)


# ---------------------------------------------------------------------------------------------------------
# token_bytes


def test_smollm2_merges_tags_with_neighbours(tokenizer):
    # The facts DESIGN relies on: tags span tokens and merge with neighbouring text.
    assert pieces(tokenizer, "</code><output>") == [b"</", b"code", b"><", b"output", b">"]
    assert pieces(tokenizer, ".<code>") == [b".<", b"code", b">"]
    assert pieces(tokenizer, "<code>") == [b"<", b"code", b">"]


def test_token_bytes_round_trip_natural_text(tokenizer):
    table = token_bytes(tokenizer)
    assert len(table) == len(tokenizer) == 49152
    assert table[0] == b"<|endoftext|>"  # special tokens are their content
    assert token_bytes(tokenizer) is table  # cached
    text = (
        "Déjà vu: naïve café owners in Zürich ate crème brûlée 😀🎉 while 東京 の 天気 was "
        "sunny; Ωmega ≈ 3.14 × r² — “quotes” and tabs\tand\nnewlines <code>x = 1</code> 👩‍👩‍👧."
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Some emoji really are split across tokens (a token ending inside a UTF-8 sequence).
    assert any(not _utf8_complete(table[i]) for i in ids)
    assert b"".join(table[i] for i in ids).decode() == text
    rng = random.Random(0)
    for _ in range(200):  # windows that start and end inside multi-byte characters
        a = rng.randrange(len(ids))
        b = rng.randrange(a, len(ids) + 1)
        window = ids[a:b]
        assert b"".join(table[i] for i in window).decode("utf-8", "replace") == tokenizer.decode(window)


def _utf8_complete(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_token_bytes_pads_model_vocab(tokenizer):
    table = token_bytes(tokenizer, vocab_size=len(tokenizer) + 3)
    assert len(table) == len(tokenizer) + 3 and table[-1] == b""


def _sentencepiece_tokenizer():
    """A tiny Llama-2-style tokenizer: Metaspace with a dummy prefix, BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{i:02X}>": 3 + i for i in range(256)})
    for p in ["▁", "h", "e", "l", "o", "w", "r", "d", "c", "<", ">", "/", "é", "▁h", "▁he", "▁hel"]:
        vocab[p] = len(vocab)
    for p in ["▁hell", "▁hello", "▁w", "▁wo", "▁wor", "▁worl", "▁world", "<c", "<co", "od", "<cod"]:
        vocab[p] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o"), ("▁", "w")]
    merges += [
        ("▁w", "o"),
        ("▁wo", "r"),
        ("▁wor", "l"),
        ("▁worl", "d"),
        ("<", "c"),
        ("<c", "o"),
        ("<co", "d"),
    ]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_token_bytes_sentencepiece_byte_fallback():
    tok = _sentencepiece_tokenizer()
    table = token_bytes(tok)
    ids = tok.encode("hello world 😀 é<code>", add_special_tokens=False)
    assert "<0xF0>" in tok.convert_ids_to_tokens(ids)  # the emoji went through byte fallback
    joined = b"".join(table[i] for i in ids)
    assert joined == b" hello world \xf0\x9f\x98\x80 \xc3\xa9<code>"  # the dummy prefix is a real byte
    assert joined.decode()[1:] == tok.decode(ids)  # the decoder strips the first space
    assert table[1] == b"<s>"
    # encode_exact cuts the dummy prefix off, so segments concatenate to exactly their text.
    exact = encode_exact(tok, "hello world")
    assert b"".join(table[i] for i in exact) == b"hello world"
    ids, kinds = splice_tokenize(tok, [(R, "hello"), (C, " world")])
    assert b"".join(table[i] for i in ids) == b"hello world" and kinds[0] == R and kinds[-1] == C


# ---------------------------------------------------------------------------------------------------------
# The tag state machine


def machine(tokenizer, tags: Tags | None = None, start: str = R) -> TagStateMachine:
    return TagStateMachine(tags or Tags(), token_bytes(tokenizer), start_kind=start)


def test_tool_call_with_merged_tags_and_splice(tokenizer):
    m = machine(tokenizer)
    sampled = stream(tokenizer, "Let me compute.<code>", "\nprint(6*7)\n</code>")
    assert pieces(tokenizer, "Let me compute.<code>")[-3:] == [b".<", b"code", b">"]
    kinds, events = m.feed_all(sampled)
    n_open = len(tokenizer.encode("Let me compute.<code>"))
    # The opening tag's tokens (`.<`, `code`, `>`) are reasoning: the state at their left edge.
    assert kinds == [R] * n_open + [C] * (len(sampled) - n_open)
    assert events == [TagEvent(TOOL_CALL, "\nprint(6*7)\n")]
    assert m.kind_of_next() == R
    forced = encode_exact(tokenizer, format_tool_output(Tags(), "42\n"))
    m.feed_forced(forced)
    assert m.kind_of_next() == R
    kinds, events = m.feed_all(stream(tokenizer, "So the answer is<answer>42</answer>"))
    n_ans_open = len(tokenizer.encode("So the answer is<answer>"))
    assert kinds == [R] * n_ans_open + [A] * (len(kinds) - n_ans_open)
    assert events == [TagEvent(ANSWER, "42")]


def test_close_tag_merged_with_model_written_output(tokenizer):
    # The model writes `</code><output>` itself: tokens `</ code >< output >`. The call closes inside `><`,
    # which keeps its id and its left-edge kind (tool_call); `output >` are policy text, never tool_output.
    m = machine(tokenizer, start=C)
    ids = stream(tokenizer, "x</code><output>")
    assert [token_bytes(tokenizer)[i] for i in ids] == [b"x", b"</", b"code", b"><", b"output", b">"]
    events_at = []
    kinds = []
    for t in ids:
        kinds.append(m.kind_of_next())
        events_at.append(m.feed(t))
    assert kinds == [C, C, C, C, R, R]
    assert events_at[3] == [TagEvent(TOOL_CALL, "x")] and sum(map(len, events_at)) == 1
    assert all(k in POLICY_KINDS for k in kinds)


def test_close_and_reopen_inside_one_token(tokenizer):
    # `</code><code>`: `><` closes the call and starts the next opening tag in the same token.
    m = machine(tokenizer, start=C)
    kinds, events = m.feed_all(stream(tokenizer, "a</code><code>b</code>"))
    assert [token_bytes(tokenizer)[i] for i in stream(tokenizer, "a</code><code>b</code>")][:6] == [
        b"a",
        b"</",
        b"code",
        b"><",
        b"code",
        b">",
    ]
    assert kinds[:6] == [C, C, C, C, R, R] and kinds[6:] == [C] * (len(kinds) - 6)
    assert events == [TagEvent(TOOL_CALL, "a"), TagEvent(TOOL_CALL, "b")]


def test_tag_split_at_odd_boundaries(tokenizer):
    lt, co, de, gt = (one_token(tokenizer, s) for s in ("<", "co", "de", ">"))
    m = machine(tokenizer)
    kinds, _ = m.feed_all([lt, co, de, gt, one_token(tokenizer, "x")])
    assert kinds == [R, R, R, R, C]  # `<` `co` `de` `>` completes the tag only at `>`
    # A partial tag that never completes: `<cod` then text.
    m = machine(tokenizer)
    cod = one_token(tokenizer, "cod")
    kinds, events = m.feed_all([lt, cod, *stream(tokenizer, "e is fun> and more")])
    assert set(kinds) == {R} and events == [] and m.kind_of_next() == R
    # ...after which a real tag still works.
    kinds, _ = m.feed_all(stream(tokenizer, " <code>y"))
    assert kinds[-1] == C


def test_model_written_output_block_is_policy(tokenizer):
    m = machine(tokenizer)
    kinds, events = m.feed_all(stream(tokenizer, "Sure.<output>\n42\n</output>\nDone"))
    assert set(kinds) == {R} and events == []


def test_unbalanced_and_nested_tags(tokenizer):
    m = machine(tokenizer)
    kinds, events = m.feed_all(stream(tokenizer, "stray </code> and </answer> close tags"))
    assert set(kinds) == {R} and events == []
    # Inside a call only the closing tool tag counts: `<code>` and `<answer>` are body text.
    body = "s = '<code>' + '<answer>1'\n"
    kinds, events = m.feed_all(stream(tokenizer, "<code>", body, "</code>"))
    assert events == [TagEvent(TOOL_CALL, body)]
    # An unclosed call stays open (the engine ends it by length or stop and reports the finish reason).
    kinds, events = m.feed_all(stream(tokenizer, "<code>while True: pass"))
    assert kinds[-1] == C and m.kind_of_next() == C and events == []
    # Inside an answer, a tool tag is answer text.
    m = machine(tokenizer)
    _, events = m.feed_all(stream(tokenizer, "<answer>use <code>x</code></answer>"))
    assert events == [TagEvent(ANSWER, "use <code>x</code>")]


def test_body_decodes_multibyte_split_across_tokens(tokenizer):
    m = machine(tokenizer)
    body = "print('😀 café')"
    ids = stream(tokenizer, "<code>", body, "</code>")
    assert any(not _utf8_complete(token_bytes(tokenizer)[i]) for i in ids)
    assert m.feed_all(ids)[1] == [TagEvent(TOOL_CALL, body)]


def test_forced_tokens_break_a_partial_tag(tokenizer):
    # `</code><` is sampled (the `<` a partial new tag), output is spliced, then the model writes `code>`:
    # the bytes are not adjacent in the sequence, so no tag opens.
    m = machine(tokenizer, start=C)
    m.feed_all(stream(tokenizer, "</code><"))
    m.feed_forced(stream(tokenizer, "<output>\n1\n</output>\n"))
    kinds, _ = m.feed_all(stream(tokenizer, "code>x"))
    assert set(kinds) == {R}


def test_answer_tags_disabled_and_custom_tags(tokenizer):
    m = machine(tokenizer, Tags(answer_open=None, answer_close=None))
    kinds, events = m.feed_all(stream(tokenizer, "<answer>4</answer>"))
    assert set(kinds) == {R} and events == []
    m = machine(tokenizer, Tags(tool_open="```python\n", tool_close="```\n"))
    kinds, events = m.feed_all(stream(tokenizer, "Run:\n```python\nprint(1)\n```\nok"))
    assert events == [TagEvent(TOOL_CALL, "print(1)\n")] and kinds[-1] == R


def test_copy_is_independent_and_bad_ids_are_empty(tokenizer):
    m = machine(tokenizer)
    m.feed_all(stream(tokenizer, "<code>ab"))
    c = m.copy()
    assert c.feed_all(stream(tokenizer, "</code>"))[1] == [TagEvent(TOOL_CALL, "ab")]
    assert m.kind_of_next() == C and c.kind_of_next() == R
    assert m.feed_all(stream(tokenizer, "c</code>"))[1] == [TagEvent(TOOL_CALL, "abc")]
    assert m.feed(10**9) == [] and m.feed(-1) == []  # padded-vocab ids have no bytes
    with pytest.raises(ValueError, match="start_kind"):
        machine(tokenizer, start=X)


# ---------------------------------------------------------------------------------------------------------
# shift


def test_shift_hand_examples():
    route_of = {P: 0, R: 0, C: 1, X: 0, A: 2}
    #          predicts: P  R  R  C  C  X  X  R  A  (last: own)
    kinds = [P, P, R, R, C, C, X, X, R, A]
    assert shift(kinds, route_of) == [0, 0, 0, 1, 1, 0, 0, 0, 2, 2]
    assert shift([], route_of) == [] and shift([C], route_of) == [1]
    assert shift([P, C], {P: -1, C: 3}) == [3, 3]
    with pytest.raises(ValueError, match="no route for kind 'answer'"):
        shift([P, A], {P: 0})


def test_shift_batch_matches_shift_per_row():
    rng = random.Random(1)
    tables = [{k: rng.randrange(-1, 3) for k in KINDS} for _ in range(6)]
    rows = [[rng.choice(KINDS) for _ in range(rng.randrange(1, 9))] for _ in range(6)]
    t = max(map(len, rows)) + 2
    for side in ("left", "right"):
        kind_ids = torch.full((6, t), -7, dtype=torch.long)  # junk at pads on purpose
        pad = torch.ones(6, t, dtype=torch.bool)
        for i, row in enumerate(rows):
            sl = slice(t - len(row), t) if side == "left" else slice(0, len(row))
            kind_ids[i, sl] = torch.tensor([KIND_INDEX[k] for k in row])
            pad[i, sl] = False
        per_row = torch.stack([kind_table(tb) for tb in tables])  # (B, K)
        got = shift_batch(kind_ids, per_row, pad)
        for i, row in enumerate(rows):
            assert got[i][~pad[i]].tolist() == shift(row, tables[i])
            assert (got[i][pad[i]] == -1).all()
        one = shift_batch(kind_ids, kind_table(tables[0]), pad.int())  # one table; an int mask works too
        assert one[0][~pad[0]].tolist() == shift(rows[0], tables[0])


# ---------------------------------------------------------------------------------------------------------
# Segment-wise tokenisation


TRAJECTORY = (
    "I will compute 6*7.<code>\nprint(6 * 7)\n</code><output>\n42\n</output>\n"
    "The tool says 42 😀.<answer>42</answer>"
)


def test_split_segments_follows_the_machine_convention():
    assert split_segments(TRAJECTORY, Tags()) == [
        (R, "I will compute 6*7.<code>"),
        (C, "\nprint(6 * 7)\n</code>"),
        (X, "<output>\n42\n</output>\n"),
        (R, "The tool says 42 😀.<answer>"),
        (A, "42</answer>"),
    ]
    # Whitespace between the call and its output block joins the block.
    assert split_segments("<code>x</code>\n <output>1</output>", Tags())[-1] == (X, "\n <output>1</output>")
    # A model-written output block with no call before it stays reasoning.
    assert split_segments("hi <output>1</output>", Tags()) == [(R, "hi <output>1</output>")]


def test_splice_round_trip_and_kinds_agree_with_machine(tokenizer):
    segments = split_segments(TRAJECTORY, Tags())
    ids, kinds = splice_tokenize(tokenizer, segments)
    assert tokenizer.decode(ids) == TRAJECTORY and len(kinds) == len(ids)
    # The output block tokenises to exactly the ids the engine forces for that tool result.
    start = kinds.index(X)
    assert ids[start : start + kinds.count(X)] == encode_exact(tokenizer, format_tool_output(Tags(), "42"))
    # No token spans a segment boundary, and the machine, fed the same stream the way the engine feeds it
    # (sampled tokens through `feed`, forced ones through `feed_forced`), assigns the same kinds.
    m = machine(tokenizer)
    for i, k in zip(ids, kinds, strict=True):
        if k == X:
            m.feed_forced([i])
        else:
            assert m.kind_of_next() == k
            m.feed(i)
    whole = tokenizer.encode(TRAJECTORY, add_special_tokens=False)
    assert b"><" in [token_bytes(tokenizer)[i] for i in whole]  # whole-text tokenisation merges `</code><`
    assert b"><" not in [token_bytes(tokenizer)[i] for i in ids]  # ...which a splice never produces
    with pytest.raises(ValueError, match="unknown kind"):
        splice_tokenize(tokenizer, [("code", "x")])
    assert splice_tokenize(tokenizer, [(R, ""), (X, "")]) == ([], [])


def test_format_tool_output():
    assert format_tool_output(Tags(), "42\n") == "<output>\n42\n</output>\n"
    assert format_tool_output(Tags(), "42") == "<output>\n42\n</output>\n"
    assert format_tool_output(Tags(), "") == "<output>\n\n</output>\n"
    custom = Tags(output_open="[out]", output_close="[/out]")
    assert format_tool_output(custom, "a\n\n") == "[out]\na\n\n[/out]\n"
