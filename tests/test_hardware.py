"""Precision follows what the CPU reports, never the machine the defaults were written on."""

from __future__ import annotations

import logging

import pytest
import torch

from rolerl.config import ConfigError, load_config
from rolerl.hardware import (
    CpuInfo,
    bf16_choice,
    cpu_info,
    describe,
    parse_cpuinfo,
    resolve_bf16,
    resolve_precision,
)

AVX2 = CpuInfo("AVX2", name="AMD EPYC (AVX2 only)")
AVX512_NO_BF16 = CpuInfo("AVX512", name="Intel Skylake-SP")
AVX512_BF16 = CpuInfo("AVX512", avx512_bf16=True, name="AMD EPYC Zen 4")
AMX = CpuInfo("AVX512", amx_bf16=True, name="Intel Sapphire Rapids")
FORCED_AVX2 = CpuInfo("AVX2", avx512_bf16=True, name="Zen 4 with ATEN_CPU_CAPABILITY=avx2")


@pytest.mark.parametrize(
    ("cpu", "bf16"),
    [(AVX2, False), (AVX512_NO_BF16, False), (AVX512_BF16, True), (AMX, True), (FORCED_AVX2, False)],
)
def test_bf16_only_where_the_cpu_has_native_bf16(cpu, bf16):
    ok, why = bf16_choice("cpu", cpu)
    assert ok is bf16
    assert cpu.capability in why  # the log says what the CPU reported


def test_auto_logs_its_choice_and_explicit_settings_are_kept(caplog, monkeypatch):
    import rolerl.hardware as hw

    monkeypatch.setattr(hw, "cpu_info", lambda: AVX2)
    with caplog.at_level(logging.INFO, logger="rolerl.hardware"):
        assert resolve_bf16("auto", "cpu") is False
        assert resolve_precision("auto", "cpu") == "float32"
    assert "train.bf16=auto -> fp32" in caplog.text and "AVX2" in caplog.text
    assert resolve_bf16(True, "cpu") is True and resolve_bf16(False, "cpu") is False
    assert resolve_precision("bfloat16", "cpu") == "bfloat16"
    monkeypatch.setattr(hw, "cpu_info", lambda: AMX)
    assert resolve_bf16("auto", "cpu") is True and resolve_precision("auto", "cpu") == "bfloat16"


def test_this_machine_is_described_consistently_with_torch():
    info = cpu_info()
    assert info.capability == torch.backends.cpu.get_cpu_capability()
    if info.capability in ("AVX2", "DEFAULT", "NO AVX"):  # bf16 instructions need AVX-512 or AMX
        assert not info.native_bf16
    assert info.capability in describe()


ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16
power management:

processor\t: 1
cpu family\t: 25
model\t\t: 1
model name\t: another CPU
flags\t\t: fpu avx2 amx_bf16
"""


def test_cpuinfo_gives_the_first_processors_generation_and_flags():
    assert parse_cpuinfo(ZEN5) == {
        "avx512_bf16": True, "amx_bf16": False, "name": "AMD EPYC", "model": "family 26 model 2",
        "vendor": "AuthenticAMD", "flags": ["avx2", "avx512_bf16", "avx512f", "fpu"],
    }  # fmt: skip
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU part\t: 0xd0c\n"
    assert parse_cpuinfo(arm) == {
        "avx512_bf16": False,
        "amx_bf16": False,
        "name": "",
        "model": "",
        "vendor": "",
        "flags": [],
    }
    assert parse_cpuinfo("")["model"] == ""


def test_description_names_the_generation(monkeypatch):
    import rolerl.hardware as hw

    monkeypatch.setattr(
        hw, "cpu_info", lambda: CpuInfo("AVX512", True, name="AMD EPYC", model="family 26 model 2")
    )
    assert describe().startswith("AMD EPYC, family 26 model 2 (AVX512, avx512_bf16), ")
    monkeypatch.setattr(hw, "cpu_info", lambda: CpuInfo("AVX2"))
    assert describe().startswith("unknown CPU (AVX2, no native bf16), ")


def test_config_accepts_auto_and_booleans_for_train_bf16():
    assert load_config().train.bf16 == "auto"
    assert load_config(None, ["train.bf16=false"]).train.bf16 is False
    assert load_config(None, ["train.bf16=true"]).train.bf16 is True
    with pytest.raises(ConfigError, match=r"train\.bf16='sometimes'; allowed: true, false or auto"):
        load_config(None, ["train.bf16=sometimes"])
    assert load_config(None, ["model.dtype=float16"]).model.dtype == "float16"


def test_policy_resolves_auto_for_its_device(monkeypatch):
    import rolerl.hardware as hw
    from rolerl.run.policy import build_policy

    for cpu, expect in ((AVX2, False), (AVX512_BF16, True)):
        monkeypatch.setattr(hw, "cpu_info", lambda cpu=cpu: cpu)
        cfg = load_config(None, ["model.spec=tiny:llama", "model.device=cpu"])
        assert build_policy(cfg, ["policy"]).bf16 is expect


def test_cuda_on_a_cpu_only_torch_is_a_clear_error():
    from rolerl.run.policy import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="sees no CUDA device; use model.device=auto or cpu"):
        resolve_device("cuda")


def test_benchmarks_measure_bf16_only_where_it_is_native(monkeypatch):
    import rolerl.hardware as hw

    monkeypatch.setattr(hw, "cpu_info", lambda: AVX2)
    assert hw.fast_dtypes() == ["float32"]
    monkeypatch.setattr(hw, "cpu_info", lambda: AMX)
    assert hw.fast_dtypes() == ["float32", "bfloat16"]
