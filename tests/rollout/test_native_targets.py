"""The native kernels built for another target than this CPU (`ROLERL_NATIVE_MARCH`): an `x86-64-v3` build
runs the AVX2 code (8 float lanes) whatever this CPU has, and passes every kernel-level test the native
build passes, so an AVX-512 machine tests the code an AVX2-only CPU runs; a build this CPU cannot run, or a
name that is not a target, is refused with the reason and the engine keeps torch's ops."""

from __future__ import annotations

import inspect
import logging
import platform

import pytest
import torch

from rolerl.rollout import native
from tests.rollout import test_native, test_native_gemm, test_native_lora, test_native_norm, test_native_step
from tests.rollout.test_native import needs_kernel

MODULES = (test_native, test_native_lora, test_native_norm, test_native_step, test_native_gemm)
x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 is an x86 target")


def kernel_tests():
    """`(name, function, kwargs)` for every case of the kernel-level tests of `MODULES`: the tests whose
    arguments are all their own parameters (the engine-level ones take fixtures)."""
    for module in MODULES:
        for name, fn in vars(module).items():
            if not name.startswith("test_") or not inspect.isfunction(fn):
                continue
            cases: list[dict] = [{}]
            for mark in getattr(fn, "pytestmark", []):
                if mark.name != "parametrize":
                    continue
                names = mark.args[0]
                names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
                values = [v if len(names) > 1 else (v,) for v in mark.args[1]]
                cases = [c | dict(zip(names, v, strict=True)) for c in cases for v in values]
            if set(inspect.signature(fn).parameters) != set(cases[0]):
                continue
            for kwargs in cases:
                yield f"{module.__name__.rsplit('.', 1)[1]}::{name}", fn, kwargs


@needs_kernel
@x86
def test_an_avx2_build_passes_every_kernel_test(fresh_build, monkeypatch):
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    avx2 = native.kernel()
    if avx2 is None and "x86-64-v3" in native._failure:  # GCC < 11 and Clang < 12 do not know the name
        pytest.skip(f"this compiler has no x86-64-v3 target: {native._failure}")
    assert avx2 is not None and avx2.isa == 256  # the 8-lane code
    assert avx2.path.parent == fresh_build / "native"
    cases = list(kernel_tests())
    names = {name for name, _, _ in cases}
    assert (
        len(cases) >= 150
        and {
            "test_native::test_decode_attention_equals_the_reference",
            "test_native_lora::test_lora_add_equals_the_reference",
            "test_native_norm::test_the_sum_is_torchs_and_the_norm_is_hfs",
            "test_native_step::test_the_fused_step_is_the_torch_path_bit_for_bit",
            "test_native_gemm::test_linear_is_within_the_fp32_bound_of_the_exact_product",
        }
        <= names
    )
    for module in MODULES:
        monkeypatch.setattr(module, "KERNEL", avx2)
    for name, fn, kwargs in cases:
        try:
            fn(**kwargs)
        except BaseException as e:
            raise AssertionError(f"{name} {kwargs} failed on the x86-64-v3 build") from e


def test_a_target_that_is_not_a_name_is_refused(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv(native.MARCH_ENV, "native -fplugin=./x.so")
    with caplog.at_level(logging.WARNING, logger="rolerl.rollout.native"):
        assert native.kernel() is None
    assert "ROLERL_NATIVE_MARCH='native -fplugin=./x.so' is not a compiler target name" in caplog.text
    assert native.resolve_attention("auto", torch.device("cpu")) is None
    with pytest.raises(RuntimeError, match="did not build"):
        native.resolve_attention("native", torch.device("cpu"))
    assert list(fresh_build.rglob("*.so")) == []


@needs_kernel
def test_code_this_cpu_cannot_run_is_refused_before_it_runs(fresh_build, monkeypatch, caplog):
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"fpu", "sse2"})  # as if this CPU had neither ISA
    with caplog.at_level(logging.WARNING, logger="rolerl.rollout.native"):
        built = native.kernel()
    if native.NativeKernel(next(fresh_build.rglob("*.so"))).isa == 0:
        pytest.skip("a build without vector code runs on any CPU")
    assert built is None
    assert "which this CPU lacks" in caplog.text
    assert native.resolve_pointwise("auto", torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("flags", "for_512", "for_256"),
    [
        ({"avx512f", "avx2", "fma"}, "", ""),
        ({"avx2", "fma"}, "avx512f", ""),
        ({"avx2"}, "avx512f", "fma"),
        ({"sse2"}, "avx512f", "avx2 fma"),
        (set(), "", ""),  # no /proc/cpuinfo: unknown, so nothing is refused
    ],
)
def test_the_instructions_a_build_needs(monkeypatch, flags, for_512, for_256):
    monkeypatch.setattr(native, "_cpu_flags", lambda: set(flags))
    assert (native._missing_instructions(512), native._missing_instructions(256)) == (for_512, for_256)
    assert native._missing_instructions(0) == ""  # scalar code runs anywhere
