"""What the machine can do fast, and the precision choices that follow from it.

Machines of one kind differ: one CPU has AVX-512 with native bf16 (AVX512-BF16) or AMX, another AVX2
only, where torch emulates bf16 and a bf16 matmul is ~45x slower than fp32 (measured: 270 ms vs 6.4 ms,
one thread). So `bf16: auto` asks the hardware, never a default that suited one machine:

- CUDA: bf16 where `torch.cuda.is_bf16_supported()` (Ampere and newer);
- CPU: bf16 only with AVX512-BF16 or AMX-BF16 (oneDNN's native kernels); fp32 everywhere else.

`describe()` is the one-line machine description every benchmark and documented figure carries.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

log = logging.getLogger(__name__)

Precision = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class CpuInfo:
    """What the CPU reports. `capability` is `torch.backends.cpu.get_cpu_capability()` (`AVX2`, `AVX512`,
    `DEFAULT`, ...); the flags say whether bf16 matmuls run natively."""

    capability: str
    avx512_bf16: bool = False
    amx_bf16: bool = False
    name: str = ""
    # "family 26 model 2" on x86 Linux: CPUs of one name and the same flags differ (two "AMD EPYC"s with
    # AVX512-BF16 ran the demo in 8.5 and 4.1 min, docs/RESULTS.md), so figures carry the generation too
    model: str = ""
    vendor: str = ""  # `vendor_id`: "GenuineIntel", "AuthenticAMD" (x86 Linux), "" elsewhere

    @property
    def native_bf16(self) -> bool:
        # torch dispatching below AVX-512 (an AVX2 CPU, or ATEN_CPU_CAPABILITY=avx2) means no bf16 kernels
        # of its own, whatever the flags say
        return (self.avx512_bf16 or self.amx_bf16) and self.capability not in ("AVX2", "DEFAULT", "NO AVX")

    def flags(self) -> str:
        have = [f for f, on in (("avx512_bf16", self.avx512_bf16), ("amx_bf16", self.amx_bf16)) if on]
        return ", ".join(have) if have else "no native bf16"


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU: the flags from torch's own cpuinfo (torch >= 2.6) or `/proc/cpuinfo`, the
    generation from `/proc/cpuinfo`."""
    capability = torch.backends.cpu.get_cpu_capability()
    info = _torch_cpu_flags()
    proc = _proc_cpuinfo()
    if info is None:
        info = proc
    name = info["name"] or proc["name"] or platform.processor()
    return CpuInfo(capability, info["avx512_bf16"], info["amx_bf16"], name, proc["model"], proc["vendor"])


def _torch_cpu_flags() -> dict | None:
    try:
        raw = torch._C._cpu._get_cpu_capability()  # a dict of cpuinfo's flags (private; absent before 2.6)
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(raw, dict) or "avx512_bf16" not in raw:
        return None
    return {
        "avx512_bf16": bool(raw.get("avx512_bf16")),
        "amx_bf16": bool(raw.get("amx_bf16")),
        "name": str(raw.get("cpu_name", "")),
    }


def _proc_cpuinfo() -> dict:
    """`parse_cpuinfo` of this machine's `/proc/cpuinfo` (empty fields where there is none)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return parse_cpuinfo("")


def cpu_flags() -> set[str]:
    """The instruction-set flags `/proc/cpuinfo` lists for this CPU (empty where there is none)."""
    return set(_proc_cpuinfo()["flags"])


def parse_cpuinfo(text: str) -> dict:
    """`/proc/cpuinfo`'s first processor: `avx512_bf16`, `amx_bf16`, `name`, `model` ("family F model M"),
    `vendor` and `flags` (sorted)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep and fields:  # the blank line after the first processor
            break
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    return {
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "name": fields.get("model name", ""),
        "model": f"family {family} model {model}" if family and model else "",
        "vendor": fields.get("vendor_id", ""),
        "flags": sorted(flags),
    }


def bf16_choice(device: torch.device | str, cpu: CpuInfo | None = None) -> tuple[bool, str]:
    """Whether bf16 is the fast path on `device`, and why (for the log)."""
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cuda"
        return ok, f"{name} {'supports' if ok else 'does not support'} bf16"
    if device.type != "cpu":
        return False, f"device {device.type}: bf16 speed unknown, fp32 kept"
    cpu = cpu or cpu_info()
    if cpu.native_bf16:
        return True, f"the CPU has native bf16 ({cpu.flags()}; capability {cpu.capability})"
    return False, (
        f"no native bf16 here (torch capability {cpu.capability}, CPU flags: {cpu.flags()}): bf16 matmuls "
        "are emulated, tens of times slower than fp32"
    )


def resolve_bf16(setting: bool | str, device: torch.device | str, what: str = "train.bf16") -> bool:
    """`True`/`False` as given; `"auto"` -> `bf16_choice`, logged with its reason."""
    if setting != "auto":
        return bool(setting)
    ok, why = bf16_choice(device)
    log.info("%s=auto -> %s: %s", what, "bf16" if ok else "fp32", why)
    return ok


def resolve_precision(name: Precision | str, device: torch.device | str, what: str = "dtype") -> str:
    """A weights dtype name: `"auto"` -> `"bfloat16"` where bf16 is native on `device`, else `"float32"`."""
    if name != "auto":
        return name
    ok, why = bf16_choice(device)
    log.info("%s=auto -> %s: %s", what, "bfloat16" if ok else "float32", why)
    return "bfloat16" if ok else "float32"


def fast_dtypes(device: torch.device | str = "cpu") -> list[str]:
    """The dtypes worth measuring on `device`: float32, plus bfloat16 where it is native (emulated bf16 is
    ~45x slower on an AVX2 CPU: a benchmark of it would measure the emulation). Benchmarks' default."""
    return ["float32", "bfloat16"] if bf16_choice(device)[0] else ["float32"]


def fp32_gemm_choice(device: torch.device | str, cpu: CpuInfo | None = None) -> tuple[str, str]:
    """`train.kernels: auto`: the library for the trainer's fp32 products with frozen weights on `device`
    (`onednn` or `torch`, whose CPU BLAS is MKL), and why (`rolerl.gemm`). MKL is Intel's: on an AMD CPU
    with AVX-512 it ran at its AVX2 speed, and oneDNN at 1.7-2.8x it (Zen 5); on an Intel Xeon with AMX, oneDNN ran at 0.77-1.04x MKL. Measured on those two
    (docs/BENCHMARKS.md, "fp32 training GEMMs"); every other CPU keeps torch's."""
    device = torch.device(device)
    if device.type != "cpu":
        return "torch", f"the model is on {device.type}"
    cpu = cpu or cpu_info()
    if cpu.vendor == "AuthenticAMD":
        return (
            "onednn",
            "an AMD CPU, where MKL's fp32 GEMMs ran at their AVX2 speed (measured on a Zen 5): oneDNN's instead",
        )
    return "torch", f"{cpu.vendor or 'an unknown CPU vendor'}: torch's own fp32 GEMMs (MKL on x86)"


def describe() -> str:
    """One line: CPU name and generation, torch's capability, native bf16 flags, threads, torch version (and
    the GPU)."""
    cpu = cpu_info()
    name = ", ".join(x for x in (cpu.name or "unknown CPU", cpu.model) if x)
    line = (
        f"{name} ({cpu.capability}, {cpu.flags()}), "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    if torch.cuda.is_available():
        line += f", {torch.cuda.get_device_name(0)}"
    return line
