"""Tiny randomly initialised causal LMs (2 layers, width 64) of the families users train, with the
default model's real tokenizer, so unit tests run in seconds yet exercise real HF model code.

`tiny:<arch>:bytes` pairs one with a byte-level tokenizer instead (259 tokens: the 256 bytes and ChatML's
three specials): a second model with its own vocabulary, as a reasoner and a small tool agent of the
`separate` preset would have."""

from __future__ import annotations

from typing import Literal

import torch

Arch = Literal["llama", "qwen2", "qwen3"]
ARCHS: tuple[Arch, ...] = ("llama", "qwen2", "qwen3")


def tiny_config(arch: Arch, vocab_size: int, **overrides):
    """A 2-layer, width-64 config of `arch` with grouped-query attention (4 query / 2 KV heads)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "llama":  # SmolLM2-like: tied embeddings, no biases
        config = LlamaConfig(**common, tie_word_embeddings=True)
    elif arch == "qwen2":  # biases on q/k/v, untied head
        config = Qwen2Config(**common, tie_word_embeddings=False)
    elif arch == "qwen3":  # q/k RMSNorm, explicit head_dim, tied embeddings (as Qwen3-0.6B)
        config = Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    else:
        raise ValueError(f"arch={arch!r} is not a tiny-model family; allowed: {list(ARCHS)}")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(arch: Arch = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, tokenizer=None):
    """Return `(model, tokenizer)`: a randomly initialised tiny `arch` model and the default tokenizer.

    Initialisation is seeded and does not touch the global RNG. Pass `tokenizer` to skip loading it.
    """
    from transformers import AutoModelForCausalLM

    if tokenizer is None:
        tokenizer = default_tokenizer()
    config = tiny_config(arch, vocab_size=len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # HF's init draws small weights (std 0.02), which gives a near-uniform next-token distribution
        # over 49k tokens, where any 1e-7 rounding flips a sampled token. Larger weights give peaked,
        # trained-model-like distributions and make every layer matter to the tests' equivalence checks.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.1)
    model.eval()
    return model, tokenizer


def tiny_from_spec(spec: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """`(model, tokenizer)` for `tiny:<arch>` (the default tokenizer) or `tiny:<arch>:bytes`."""
    parts = spec.split(":")
    if parts[0] != "tiny" or len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "bytes"):
        raise ValueError(
            f"model spec {spec!r}: tiny models are tiny:<arch> or tiny:<arch>:bytes, arch in {list(ARCHS)}"
        )
    if len(parts) == 2:
        return tiny_model(parts[1], seed=seed, dtype=dtype)  # type: ignore[arg-type]
    tokenizer = byte_tokenizer()
    model, tokenizer = tiny_model(parts[1], seed=seed, dtype=dtype, tokenizer=tokenizer)  # type: ignore[arg-type]
    for config in (model.config, model.generation_config):  # the ids tiny_config assumes are SmolLM2's
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        config.bos_token_id = None
    return model, tokenizer


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_tokenizer():
    """A byte-level tokenizer: one token per byte (no merges) plus `<|endoftext|>` (pad), `<|im_start|>`
    and `<|im_end|>` (EOS), with a ChatML chat template. Built in memory, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )


_TOKENIZER = None


def default_tokenizer():
    """The default model's tokenizer (SmolLM2, 49152 tokens, ChatML template), loaded once."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from rolerl.models.load import DEFAULT_MODEL, _load_tokenizer, _resolve_to_directory

        _TOKENIZER = _load_tokenizer(_resolve_to_directory(DEFAULT_MODEL))
    return _TOKENIZER
