"""Adapter files that cannot be used give one clear error naming the file, and leave the model as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import rolerl
from rolerl.models.adapters_io import AdapterMismatchError, CorruptFileError, adapter_state_dict
from rolerl.models.lora import adapter_specs
from rolerl.models.tiny import tiny_config
from tests.models.test_lora import randomize_adapters


def saved_adapter(model, path, name="policy"):
    rolerl.add_adapters(model, [name], rank=4)
    randomize_adapters(model)
    return rolerl.save_adapter(model, name, path / name)


def other_model(tokenizer, **overrides):
    config = tiny_config("llama", vocab_size=len(tokenizer), **overrides)
    model = AutoModelForCausalLM.from_config(config)
    model.config._name_or_path = "org/other-base"  # what `save_adapter` writes as base_model_name_or_path
    return model


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, "the CLI prints the message as one line"
    return text


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_safetensors_names_the_file(tokenizer, tmp_path, damage):
    model, _ = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    path = saved_adapter(model, tmp_path)
    weights = path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": b"not a tensor" * 50, "empty": b""}[damage]
    )
    fresh, _ = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    with pytest.raises(CorruptFileError) as error:
        rolerl.load_adapter(fresh, "policy", path)
    assert one_line(error).startswith(
        f"{str(weights)!r} is not a readable safetensors file (truncated or damaged"
    )
    assert error.value.path == weights and isinstance(error.value, ValueError)  # the CLI's one-line errors
    assert adapter_specs(fresh) == {}, "nothing was added"


def test_damaged_adapter_config_names_the_file(tokenizer, tmp_path):
    model, _ = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    path = saved_adapter(model, tmp_path)
    (path / "adapter_config.json").write_text('{"r": 4, "lora_al')
    with pytest.raises(CorruptFileError) as error:
        rolerl.load_adapter(model, "policy", path)
    assert one_line(error).startswith(f"{str(path / 'adapter_config.json')!r} is not a readable JSON file")


def test_adapter_of_a_wider_base_model_says_so(tokenizer, tmp_path):
    path = saved_adapter(other_model(tokenizer, intermediate_size=96), tmp_path)
    model, _ = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    with pytest.raises(AdapterMismatchError) as error:
        rolerl.load_adapter(model, "policy", path)
    message = one_line(error)
    assert message.startswith(f"{str(path)!r} was made for another base model ('org/other-base'; ")
    assert "mlp.down_proj.lora_A has shape (4, 96), this model needs (4, 128)" in message  # A is (r, in)
    assert message.endswith("load the adapter onto the model it was trained on")
    assert adapter_specs(model) == {}, "checked before anything is added or copied"


def test_adapter_into_an_existing_adapter_of_another_base_changes_nothing(tokenizer, tmp_path):
    path = saved_adapter(other_model(tokenizer, num_hidden_layers=3), tmp_path)
    model, _ = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ["policy"], rank=4)
    before = {k: v.clone() for k, v in adapter_state_dict(model, "policy").items()}
    with pytest.raises(
        AdapterMismatchError, match=r"'org/other-base'; its module 'model\.layers\.2\."
    ) as error:
        rolerl.load_adapter(model, "policy", path)
    assert "this model is" in one_line(error)
    after = adapter_state_dict(model, "policy")
    assert all(torch.equal(before[k], after[k]) for k in before)
