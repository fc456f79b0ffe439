"""Fixtures of the engine's tests."""

from __future__ import annotations

import pytest

from rolerl.rollout import native


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """The native kernels' `kernel()` rebuilt into an empty cache directory; the real one restored after."""
    monkeypatch.setenv("ROLERL_CACHE", str(tmp_path))
    native.kernel.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    native.kernel.cache_clear()
