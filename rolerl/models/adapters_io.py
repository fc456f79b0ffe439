"""Adapters on disk in PEFT's format, so `peft.PeftModel.from_pretrained(base, dir)` (and vLLM's LoRA
loader) serve what rolerl trained.

A directory holds `adapter_config.json` (written by `peft.LoraConfig.save_pretrained`) and
`adapter_model.safetensors` with PEFT's key names: `base_model.model.<module path>.lora_A.weight` (r, in)
and `.lora_B.weight` (out, r). Writes are atomic: a crash never leaves a half-written adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from rolerl.models.lora import _candidate_linears, adapter_specs, add_adapters, routed_layers

PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def _peft_targets(model: nn.Module, paths: list[str]) -> list[str]:
    """The shortest PEFT `target_modules` list that matches exactly `paths`: leaf names when the adapter
    covers every decoder linear with those names, else the full module paths."""
    leaves = sorted({p.rsplit(".", 1)[-1] for p in paths})
    covered = [n for n in _candidate_linears(model) if n.rsplit(".", 1)[-1] in leaves]
    return leaves if sorted(covered) == sorted(paths) else sorted(paths)


def adapter_state_dict(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """One adapter's weights under PEFT's key names (the adapter name is not part of the key)."""
    if name not in adapter_specs(model):
        raise KeyError(f"unknown adapter {name!r}; adapters on this model: {list(adapter_specs(model))}")
    out = {}
    for path, layer in routed_layers(model):
        if name in layer.lora_A:
            out[f"{PREFIX}{path}.lora_A.weight"] = layer.lora_A[name].detach().contiguous()
            out[f"{PREFIX}{path}.lora_B.weight"] = layer.lora_B[name].detach().contiguous()
    return out


def save_adapter(model: nn.Module, name: str, path: str | os.PathLike) -> Path:
    """Write adapter `name` of `model` as a PEFT LoRA directory at `path` (replaced atomically)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    spec = adapter_specs(model).get(name)
    if spec is None:
        raise KeyError(f"unknown adapter {name!r}; adapters on this model: {list(adapter_specs(model))}")
    base_name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=_peft_targets(model, spec.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_name,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        config.save_pretrained(tmp)
        save_file(adapter_state_dict(model, name), tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


class CorruptFileError(ValueError):
    """A file rolerl wrote (an adapter's weights or config, a checkpoint's state) cannot be read back:
    truncated or overwritten on disk. `path` names the file."""

    def __init__(self, path: str | os.PathLike, what: str, error: BaseException) -> None:
        self.path = Path(path)
        detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        super().__init__(f"{str(self.path)!r} is not a readable {what} (truncated or damaged: {detail})")


class AdapterMismatchError(ValueError):
    """An adapter directory that does not fit this model (made for another base model)."""


def load_adapter(model: nn.Module, name: str, path: str | os.PathLike) -> nn.Module:
    """Load a PEFT LoRA directory into adapter `name` of `model`, creating the adapter if it is new.

    Weights are copied bit-exactly. The directory may come from rolerl or from PEFT itself. Every file and
    shape is checked before anything is copied, so a failed load leaves `model` as it was.
    """
    path = Path(path)
    if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a PEFT adapter directory: needs {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    config = _read_config(path / CONFIG_NAME)
    _check_supported(config, path)
    weights = _read_weights(path / WEIGHTS_NAME)
    modules = sorted({k[len(PREFIX) :].rsplit(".lora_", 1)[0] for k in weights if k.startswith(PREFIX)})
    if not modules:
        raise ValueError(f"{str(path / WEIGHTS_NAME)!r} holds no LoRA weights under {PREFIX!r}")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    _check_fits(model, path, config, weights, modules, rank)
    spec = adapter_specs(model).get(name)
    if spec is None:
        pattern = "|".join(m.replace(".", r"\.") for m in modules)
        add_adapters(model, name, rank=rank, alpha=alpha, target_modules=f"(?:{pattern})", dropout=0.0)
    elif (spec.rank, spec.alpha) != (rank, alpha) or sorted(spec.target_modules) != modules:
        raise ValueError(
            f"adapter {name!r} exists with rank={spec.rank}, alpha={spec.alpha} on {len(spec.target_modules)} "
            f"modules, but {str(path)!r} has rank={rank}, alpha={alpha} on {len(modules)}; use a new name"
        )
    layers = dict(routed_layers(model))
    with torch.no_grad():
        for module in modules:
            layer = layers[module]
            for which, params in (("A", layer.lora_A), ("B", layer.lora_B)):
                params[name].copy_(weights[f"{PREFIX}{module}.lora_{which}.weight"])
    return model


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError says "line 1 column 1": name the file
        raise CorruptFileError(path, "JSON file", e) from None
    if not isinstance(config, dict) or "r" not in config or "lora_alpha" not in config:
        raise ValueError(f"{str(path)!r} is not a PEFT LoRA config: needs 'r' and 'lora_alpha'")
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types (header, size, dtype) for a bad file
        raise CorruptFileError(path, "safetensors file", e) from None


def _check_fits(
    model: nn.Module,
    path: Path,
    config: dict,
    weights: dict[str, torch.Tensor],
    modules: list[str],
    rank: int,
) -> None:
    """Every module exists in `model` and every tensor has its shape; else say which base model the
    adapter names (its config's `base_model_name_or_path`) and which model this is."""
    linears = _candidate_linears(model)
    problem = None
    missing = [m for m in modules if m not in linears]
    if missing:
        problem = f"its module {missing[0]!r} is not in this model"
    else:
        for module in modules:
            base = linears[module]
            want = {"A": (rank, base.in_features), "B": (base.out_features, rank)}
            for which, shape in want.items():
                got = tuple(weights.get(f"{PREFIX}{module}.lora_{which}.weight", torch.empty(0)).shape)
                if got != shape:
                    problem = f"{module}.lora_{which} has shape {got}, this model needs {shape}"
                    break
            if problem:
                break
    if problem:
        made_for = config.get("base_model_name_or_path") or "an unnamed base model"
        this = getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
        raise AdapterMismatchError(
            f"{str(path)!r} was made for another base model ({made_for!r}; {problem}); this model is "
            f"{this!r}: load the adapter onto the model it was trained on"
        )


def _check_supported(config: dict, path: Path) -> None:
    unsupported = {
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "bias": "none",
    }
    for key, expected in unsupported.items():
        value = config.get(key, expected)
        if value not in (expected, None):
            raise ValueError(
                f"{str(path)!r}: {key}={value!r} is not supported by rolerl; allowed: {expected!r}"
            )
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{str(path)!r}: peft_type={config['peft_type']!r}; only 'LORA' adapters load")
