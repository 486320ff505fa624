"""The model and data of the command-line app (``make train``): a small character-level GPT on a corpus
built from text that ships with Python. Importable as ``lightning_zero.demo.gpt`` / ``lightning_zero.demo.data``."""

from __future__ import annotations

from typing import Any

__all__ = ["DemoSettingError", "check_settings"]


class DemoSettingError(ValueError):
    """A value of the example model or data that cannot work (the app prints it as one line)."""


def check_settings(group: str, rules: dict[str, tuple[Any, bool, str]]) -> None:
    """``rules``: name -> (value, valid, what it must be). The first invalid one is named with its app key."""
    for name, (value, valid, must) in rules.items():
        if not valid:
            raise DemoSettingError(f"{group}.{name}={value!r} is invalid: it must be {must}.")
