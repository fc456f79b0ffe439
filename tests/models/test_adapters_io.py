"""Adapters saved by rolerl are PEFT directories: the weights round-trip bit for bit, and PEFT loads them."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

import rolerl
from rolerl.models.adapters_io import adapter_state_dict
from tests.models.test_lora import randomize_adapters
from tests.tolerance import assert_close_ulps


def test_save_load_round_trip_keeps_weights_bit_exact(tiny, tmp_path):
    model, tokenizer = tiny
    fresh = copy.deepcopy(model)
    rolerl.add_adapters(
        model, ["reason", "tool"], rank={"reason": 4, "tool": 2}, alpha={"reason": 8, "tool": 3}
    )
    randomize_adapters(model)
    for name in ["reason", "tool"]:
        rolerl.save_adapter(model, name, tmp_path / name)
    # into a model without adapters (created on load) ...
    for name in ["tool", "reason"]:  # another order: indices differ, names carry the identity
        rolerl.load_adapter(fresh, name, tmp_path / name)
    for name in ["reason", "tool"]:
        saved, loaded = adapter_state_dict(model, name), adapter_state_dict(fresh, name)
        assert saved.keys() == loaded.keys() and saved
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)  # a copy of the bits: exact
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(ids, routes=torch.tensor([[0, 0, 1, 1, 0, -1]] * 2)).logits
        b = fresh(ids, routes=torch.tensor([[1, 1, 0, 0, 1, -1]] * 2)).logits  # tool=0, reason=1 here
        base = fresh(ids).logits
    assert (a - base).abs().max() > 1, "the adapters must change the logits"
    # Same weights, but stacked in another order (tool, reason): each routed layer sums its ranks in another
    # order, so the logits differ by rounding (~4 ulps of the largest logit measured on AVX2 and AVX-512,
    # after 2 layers of 7 routed linears); 64 ulps leaves room and still catches a mixed-up adapter.
    assert_close_ulps(b, a, ulps=64)
    # ... and into an existing adapter of the same shape (overwrites it)
    with pytest.raises(ValueError, match="exists with rank=2.*rank=4"):
        rolerl.load_adapter(model, "tool", tmp_path / "reason")


def test_saved_directory_is_peft_format_and_peft_gives_same_logits(tiny, tmp_path):
    model, _ = tiny
    base = copy.deepcopy(model)
    rolerl.add_adapters(
        model, ["reason", "tool"], rank=4, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    randomize_adapters(model, seed=3)
    rolerl.save_adapter(model, "tool", tmp_path / "tool")
    config = json.loads((tmp_path / "tool" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    keys = load_file(tmp_path / "tool" / "adapter_model.safetensors").keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * 3 * model.config.num_hidden_layers

    peft_model = PeftModel.from_pretrained(base, tmp_path / "tool")
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = peft_model(ids).logits
        got = model(ids, routes=torch.ones_like(ids)).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_adapter_on_some_layers_only_writes_full_paths(tiny, tmp_path):
    model, _ = tiny
    rolerl.add_adapters(model, "a", rank=2, target_modules=r"model\.layers\.1\.mlp\.(up|down)_proj")
    rolerl.save_adapter(model, "a", tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"]
    other = copy.deepcopy(model)
    rolerl.load_adapter(other, "a", tmp_path / "a")  # same name, same shape: loads in place


def test_bad_adapter_directories_are_rejected(tiny, tmp_path):
    model, _ = tiny
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter directory"):
        rolerl.load_adapter(model, "a", tmp_path)
    rolerl.add_adapters(model, "a", rank=2)
    rolerl.save_adapter(model, "a", tmp_path / "a")
    config_path = tmp_path / "a" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        rolerl.load_adapter(model, "b", tmp_path / "a")
    with pytest.raises(KeyError, match="unknown adapter 'zzz'"):
        rolerl.save_adapter(model, "zzz", tmp_path / "z")


def test_save_replaces_an_existing_directory_atomically(tiny, tmp_path):
    model, _ = tiny
    rolerl.add_adapters(model, "a", rank=2)
    rolerl.save_adapter(model, "a", tmp_path / "a")
    randomize_adapters(model)
    rolerl.save_adapter(model, "a", tmp_path / "a")
    saved = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert all(torch.equal(v, adapter_state_dict(model, "a")[k]) for k, v in saved.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"], "no temporary directories left behind"
