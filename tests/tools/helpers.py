"""One way to build a test sandbox: small limits, a uid range per test module (so modules never share a
uid), started before it is returned (startup is not part of any test's timing)."""

from __future__ import annotations

import warnings

from rolerl.tools import PythonSandbox, SandboxConfig


def make_sandbox(mode: str, uid_base: int, **overrides: object) -> PythonSandbox:
    """`mode` "full" uses every namespace the kernel allows; "fallback" none (the documented fallbacks)."""
    cfg = SandboxConfig(
        timeout_s=5.0,
        memory_mb=512,
        processes=16,
        uid_base=uid_base,
        uid_count=50,
        namespaces=SandboxConfig().namespaces if mode == "full" else (),
        **overrides,
    )
    sb = PythonSandbox(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "runs without namespaces": intended in fallback
        sb.isolation  # noqa: B018 - start now, not inside the first test's timing
    return sb
