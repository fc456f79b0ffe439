"""Shared fixtures: tiny random models of each family and (for `slow` tests) the real default model."""

from __future__ import annotations

import pytest
import torch

from rolerl.models.tiny import ARCHS, default_tokenizer, tiny_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(params=ARCHS)
def tiny(request, tokenizer):
    """`(model, tokenizer)` for each tiny family, fresh per test (tests modify models in place)."""
    return tiny_model(request.param, seed=0, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def default_model_cpu():
    """The real default model (SmolLM2-135M-Instruct), fp32. Tests must not modify it: deepcopy first."""
    from rolerl import load_model

    return load_model("default", dtype="float32")
