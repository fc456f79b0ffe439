"""What the vLLM backend checks before it trusts a vLLM engine or server (issue 46, found by running the
backend against real vLLM and reading vLLM's source):

- the version: before vLLM 0.13 a greedy request batched with sampled ones carried a temperature of -1 into
  the processed log-probs (0.10.2's input batch), so a rollout mixing greedy and sampled calls logged wrong
  numbers; 0.13 is the first release we accept;
- the dtype per device: vLLM's GPU LoRA kernels take fp16/bf16 only (fp32 fails in its start-up
  profiling); its CPU build runs LoRA in fp32, the trainer's dtype, which makes the parity exact;
- the temperature: vLLM raises 0 < T < 0.01 to 0.01 and refuses T > 2, so a temperature outside [0.01, 2]
  would sample (or fail) otherwise than the trainer's log-probs assume;
- the engine's context length: a request longer than the server's `--max-model-len` is answered 400;
- whole prefills on a CPU: vLLM's CPU build (0.32.0) kills its engine core ("CPU Generator does not use
  offset") when it splits a seeded request's prefill over steps, so rolerl, which seeds every request,
  gives it a token budget per step that holds every prompt whole (`cpu_scheduling`).

`check_vllm_config` turns what a config gets wrong into `ConfigError`s naming the fields.
"""

from __future__ import annotations

import re
from typing import Any

import torch

MIN_VLLM = (0, 13, 0)
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 2.0  # vLLM's _MAX_TEMP clamp and its [0, 2] validation


def parse_version(text: str) -> tuple[int, int, int]:
    """`0.32.0`, `0.10.2rc1`, `0.11.0+cpu` -> (major, minor, patch); missing parts are 0."""
    m = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(g or 0) for g in m.groups())  # type: ignore[return-value]


def check_vllm_version(version: str, where: str) -> None:
    """Refuse a vLLM older than `MIN_VLLM` (`where`: the engine or the server's URL, for the message)."""
    if parse_version(version) < MIN_VLLM:
        need = ".".join(map(str, MIN_VLLM))
        raise RuntimeError(
            f"{where} runs vLLM {version}; rollout.backend=vllm needs vLLM >= {need}: before it, greedy "
            "requests batched with sampled ones get wrong processed log-probs (a temperature of -1 for greedy "
            f"rows). Upgrade: pip install 'vllm>={need}' (docs/ROLLOUT.md)"
        )


def vllm_dtype(
    requested: str, model_dtype: torch.dtype, device_type: str, bf16_ok: bool | None = None
) -> str:
    """The dtype vLLM's engine runs in (`rollout.vllm.dtype`): `auto` = the trainer's weights' dtype where
    vLLM's LoRA supports it (any on CPU; fp16/bf16 on a GPU, where fp32 maps to bf16, or fp16 without
    bf16). An explicit fp32 on a GPU is refused: vLLM's LoRA kernels would fail on it at start-up."""
    allowed = ("auto", "float32", "bfloat16", "float16")
    if requested not in allowed:
        raise ValueError(f"rollout.vllm.dtype={requested!r}; allowed: {list(allowed)}")
    gpu = device_type == "cuda"
    if bf16_ok is None:  # this machine's GPU (none here: assume one with bf16, as every GPU since Ampere)
        bf16_ok = not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
    if requested == "auto":
        name = str(model_dtype).removeprefix("torch.")
        if gpu and name not in ("bfloat16", "float16"):
            return "bfloat16" if bf16_ok else "float16"
        return name
    if gpu and requested == "float32":
        raise ValueError(
            "rollout.vllm.dtype='float32' on a GPU: vLLM's LoRA kernels take float16 or bfloat16 only; "
            "allowed there: 'auto' (bfloat16, or float16 without bf16), 'bfloat16', 'float16'"
        )
    return requested


CPU_MAX_SEQS = 64  # requests vLLM's CPU build runs at once for rolerl, unless rollout.vllm.max_num_seqs


def cpu_scheduling(options: dict[str, Any], max_len: int) -> dict[str, Any]:
    """The scheduling options vLLM's CPU build needs under rolerl, added to `options` (rollout.vllm's).

    vLLM splits a long prefill over steps when the step's token budget (`max_num_batched_tokens`, 4096 by
    default on a CPU) runs out; at the end of each piece it samples a token, discards it, and rewinds the
    request's random generator. Only seeded requests have one, and on a CPU the rewind raises ("CPU
    Generator does not use offset": torch's CPU generators have no offset, CUDA's do) and the engine core
    dies. rolerl seeds every request (its tokens then do not depend on the batch), so on a CPU a step must
    hold every running request's prompt whole: a budget of `max_num_seqs x max_len`. No warm-up runs a
    batch that size in eager mode (`enforce_eager`, the default set here): vLLM's compiled mode would
    profile one at start. A smaller budget given is refused."""
    from rolerl.errors import ConfigError

    out = dict(options)
    out.setdefault("enforce_eager", True)
    seqs = int(out.setdefault("max_num_seqs", CPU_MAX_SEQS))
    need = seqs * max_len
    given = int(out.setdefault("max_num_batched_tokens", need))
    if given < need:
        raise ConfigError(
            f"rollout.vllm.max_num_batched_tokens={given}: on a CPU it must be at least max_num_seqs x "
            f"rollout.max_len = {seqs} x {max_len} = {need} (or leave it unset): vLLM's CPU build stops its "
            "engine when it splits a seeded request's prefill (docs/ROLLOUT.md)"
        )
    return out


def check_temperature(value: float, field: str) -> None:
    """A sampling temperature vLLM honours as given: greedy (0) or within [0.01, 2]."""
    if value != 0 and not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        from rolerl.errors import ConfigError

        raise ConfigError(
            f"{field}={value} with rollout.backend=vllm: vLLM raises 0 < T < {MIN_TEMPERATURE} to "
            f"{MIN_TEMPERATURE} and refuses T > {MAX_TEMPERATURE}, so its samples and log-probs would not be "
            f"the trainer's at T={value}; allowed: 0 (greedy, evaluation only) or a number in "
            f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]"
        )


def engine_max_len(llm: Any) -> int | None:
    """The longest sequence (prompt + completion) the engine accepts: a server's `max_model_len` as
    `/v1/models` reports it, the offline engine's model config; None where neither says (a fake)."""
    value = getattr(llm, "max_model_len", None)
    if value is None:
        config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
        value = getattr(config, "max_model_len", None)
    return int(value) if isinstance(value, int) else None


def check_vllm_config(cfg, policy) -> None:
    """The settings the vLLM backend cannot honour, as `ConfigError`s naming the fields."""
    from rolerl.errors import ConfigError

    mode = cfg.rollout.vllm.get("logprobs", "processed")
    top_ps = [cfg.rollout.top_p, *(c.top_p for c in cfg.roles.values() if c.top_p is not None)]
    if min(top_ps) < 1.0 and not (mode == "recompute" and cfg.algorithm.old_logp == "recompute"):
        raise ConfigError(
            f"rollout.top_p={min(top_ps)} with rollout.backend=vllm: vLLM's log-probs are renormalised over the "
            "kept tokens and the trainer's are not; set rollout.vllm.logprobs=recompute and "
            "algorithm.old_logp=recompute (or top_p 1)"
        )
    check_temperature(cfg.rollout.temperature, "rollout.temperature")
    if cfg.eval.every:  # evaluation during training samples through this backend too
        check_temperature(cfg.eval.temperature, "eval.temperature")
    if not cfg.rollout.vllm.get("url"):  # a server's dtype is its own (--dtype)
        weights = {next(m.model.parameters()).dtype for m in policy.members.values()}
        try:
            served = {
                vllm_dtype(str(cfg.rollout.vllm.get("dtype", "auto")), w, policy.device.type) for w in weights
            }
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if {
            str(w).removeprefix("torch.") for w in weights
        } != served and cfg.algorithm.old_logp != "recompute":
            raise ConfigError(
                f"vLLM serves the model in {sorted(served)} on {policy.device.type} while the trainer's weights "
                f"are {sorted(map(str, weights))}: set algorithm.old_logp=recompute (and algorithm.tis_cap, e.g. 2.0)"
            )  # fmt: skip
    routed = [role for role, table in policy.route_of.items() if len(set(table.values())) > 1]
    if routed and cfg.algorithm.old_logp != "recompute":
        raise ConfigError(
            f"roles {routed} route tokens to several adapters (adapters.preset={cfg.adapters.preset!r}): vLLM "
            "applies one adapter per segment, so the rollout's log-probs are not the true routing's; set "
            "algorithm.old_logp=recompute (and algorithm.tis_cap, e.g. 2.0, to correct the mismatch)"
        )


def vllm_installed() -> bool:
    """Whether `import vllm` can find vLLM here (without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def choose_backend(device: str, vllm_available: bool, url: str | None = None) -> tuple[str, str]:
    """`rollout.backend: auto`: the backend for a model on `device` (`cpu`, `cuda`, ...), and why.

    On CPU the built-in engine decoded ~1.5-3x faster than vLLM's CPU build on the same cores, prompts and
    sampling, and kept its lead with tool calls (docs/ROLLOUT.md "vLLM", `benchmarks/rollout.py --cases
    vllm`), so CPU runs keep it. On a GPU vLLM is the engine people sample with at scale (paged attention,
    CUDA graphs); the built-in engine was written for CPUs. A server URL is an explicit choice of vLLM."""
    if url:
        return "vllm", f"rollout.vllm.url={url!r} names a vLLM server"
    if device == "cuda" and vllm_available:
        return "vllm", "the model is on a GPU and vLLM is installed"
    if device == "cuda":
        return "lockstep", "the model is on a GPU but vLLM is not installed (pip install 'rolerl[vllm]')"
    return "lockstep", (
        f"the model is on {device}: the built-in engine measured faster there than vLLM's CPU build "
        "(docs/ROLLOUT.md)"
    )


def resolve_backend(cfg, policy):
    """`cfg` with `rollout.backend: auto` resolved for `policy`'s device (`choose_backend`), and why."""
    import dataclasses

    if cfg.rollout.backend != "auto":
        return cfg, f"rollout.backend={cfg.rollout.backend}"
    name, why = choose_backend(policy.device.type, vllm_installed(), cfg.rollout.vllm.get("url"))
    resolved = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, backend=name))
    return resolved, f"rollout.backend=auto -> {name}: {why}"
