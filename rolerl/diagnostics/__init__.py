"""Interference diagnostics: how the gradients of roles (and token kinds) on shared adapters relate."""

from rolerl.diagnostics.grad_conflict import role_gradients

__all__ = ["role_gradients"]
