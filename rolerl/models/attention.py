"""Switching a Hugging Face model's attention implementation for the duration of a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def attention_implementation(model, name: str) -> Iterator[None]:
    """Run the block with `model`'s attention set to `name` (a transformers attention implementation or a
    name registered with `AttentionInterface`), on the config and any nested text config; restore after."""
    configs = {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c is not None}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    for c in configs.values():
        c._attn_implementation = name
    try:
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]
