"""Errors raised at every layer, kept below them all: any package may raise them without importing the
config (which imports the task and workflow registries to check names)."""


class ConfigError(ValueError):
    """A bad key, type or value in a run configuration; the message names the field and what is allowed."""
