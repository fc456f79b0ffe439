"""What each token id is, as bytes: the ground truth the tag state machine reads (never a `decode()` guess).

`token_bytes` maps every id to its exact bytes for byte-level BPE vocabularies (GPT-2 style: SmolLM2,
Llama-3, Qwen) and sentencepiece ones with byte fallback (Llama-2, Mistral, Gemma). `encode_exact`
tokenises a string to ids whose bytes are exactly the string's, which segment-wise tokenisation needs.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Sequence


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, used by every byte-level BPE vocabulary."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte-fallback pieces
_TOKEN_BYTES_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scheme(tokenizer, pieces: Sequence[str | None]) -> str:
    """'byte_level' or 'sentencepiece', from the fast tokenizer's decoder, else from the vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is not None:
        state = decoder.__getstate__()
        state = state.decode() if isinstance(state, bytes) else str(state)
        if '"ByteLevel"' in state:
            return "byte_level"
        if "ByteFallback" in state or "Metaspace" in state or "\u2581" in state:
            return "sentencepiece"
    if hasattr(tokenizer, "sp_model"):
        return "sentencepiece"
    sample = [p for p in pieces[:5000] if p]
    if sum("\u0120" in p for p in sample) > len(sample) // 50:  # 'Ġ' marks a space in byte-level vocabs
        return "byte_level"
    if sum("\u2581" in p for p in sample) > len(sample) // 50:  # '▁' marks a space in sentencepiece
        return "sentencepiece"
    raise ValueError(
        f"cannot tell how {type(tokenizer).__name__} maps tokens to bytes; supported: byte-level BPE "
        "(GPT-2, Llama-3, Qwen, SmolLM) and sentencepiece with byte fallback (Llama-2, Mistral, Gemma)"
    )


def _piece_bytes(piece: str, scheme: str) -> bytes:
    if scheme == "byte_level":
        if all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return piece.encode("utf-8")  # a piece outside the table was stored raw
    m = _BYTE_TOKEN.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def token_bytes(tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """The exact bytes of every token id, cached per tokenizer.

    Byte-level vocabularies map each character back through GPT-2's table; sentencepiece pieces turn `▁`
    into a space and `<0xNN>` into the byte NN; added and special tokens are their content. Joining the
    bytes of a sequence and decoding once gives `tokenizer.decode` (except that a sentencepiece decoder
    strips the first token's leading space). Ids up to `vocab_size` that have no token (a model's padded
    embedding rows) get `b""`.
    """
    n = len(tokenizer)
    try:
        cached = _TOKEN_BYTES_CACHE.get(tokenizer)
    except TypeError:
        cached = None
    if cached is None or cached[0] != n:
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
        scheme = _scheme(tokenizer, pieces)
        table = [b"" if p is None else _piece_bytes(p, scheme) for p in pieces]
        for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if 0 <= i < n:
                table[i] = str(getattr(added, "content", added)).encode("utf-8")
        cached = (n, table)
        with contextlib.suppress(TypeError):  # not weak-referenceable: compute again next time
            _TOKEN_BYTES_CACHE[tokenizer] = cached
    table = cached[1]
    if vocab_size is not None and vocab_size > len(table):
        return table + [b""] * (vocab_size - len(table))
    return table


def encode_exact(tokenizer, text: str) -> list[int]:
    """Token ids whose bytes are exactly `text`'s (no special tokens, no sentencepiece dummy prefix).

    A tokenizer that prepends a space to every call (`▁` dummy prefix) is given a sentinel prefix that is
    then cut off at a token boundary. Raises if no tokenisation reproduces the text (e.g. a normaliser).
    """
    if not text:
        return []
    table = token_bytes(tokenizer)
    want = text.encode("utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if b"".join(table[i] for i in ids) == want:
        return list(ids)
    for sentinel in ("\n", "a", "."):
        ids = tokenizer.encode(sentinel + text, add_special_tokens=False)
        got = [table[i] for i in ids]
        rest = b"".join(got)
        for k in range(len(ids)):
            if rest == want:
                return list(ids[k:])
            if len(rest) <= len(want):
                break
            rest = rest[len(got[k]) :]
    raise ValueError(f"{type(tokenizer).__name__} cannot tokenise {text[:40]!r} to its exact bytes")
