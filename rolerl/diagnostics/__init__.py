"""Interference diagnostics: how the gradients of roles and token kinds relate (during training:
`rolerl.train.grad_conflict`; per trajectory: `conflict`, `rolerl diagnose grad-conflict`), and how much
of a model's success comes from training capabilities together rather than apart (`interaction`, LEAS /
CEA)."""

from rolerl.diagnostics.conflict import ConflictReport, cosine, episode_gradients, select_params
from rolerl.diagnostics.interaction import attribute, interaction, smoothed_logit, solve_coefficients
from rolerl.train.grad_conflict import role_gradients

__all__ = [
    "ConflictReport",
    "attribute",
    "cosine",
    "episode_gradients",
    "interaction",
    "role_gradients",
    "select_params",
    "smoothed_logit",
    "solve_coefficients",
]
