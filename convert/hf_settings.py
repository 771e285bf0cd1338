"""What the transformers mappings share: the refusal of an unsupported model and a config.json's values read
with their types checked (convert/hf_mapping.py for GPT-2 and Llama, convert/hf_moe.py for the MoE families)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class UnsupportedModelError(ValueError):
    """A model or option the mapping does not cover; the message names it."""


class HFSettings:
    """A config.json's values read with their types checked: a missing size or one of the wrong type is one
    line naming the file and the key, not a KeyError deep in the mapping."""

    def __init__(self, config: Mapping[str, object], source: str) -> None:
        self.config, self.source = config, source

    def get(self, key: str, default: object = None) -> Any:
        """A value that needs no check (strings, flags, nested sections: any JSON value), or the default."""
        return self.config.get(key, default)

    def size(self, key: str, default: int | None = None, optional: bool = False) -> int:
        """A positive whole number; `optional`: absent or null gives `default`."""
        value = self.config.get(key)
        if value is None and (optional or default is not None):
            return default  # type: ignore[return-value]  # None only where the caller allows it
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            shown = "missing" if key not in self.config else f"{value!r}, not a whole number >= 1"
            raise UnsupportedModelError(
                f"{self.source}: {key} is {shown}; a {self.config['model_type']} config needs it"
            )
        return value

    def flag(self, key: str, default: bool) -> bool:
        """true or false, or the default when absent."""
        value = self.config.get(key, default)
        if not isinstance(value, bool):
            raise UnsupportedModelError(f"{self.source}: {key} is {value!r}, not true or false")
        return value

    def number(self, key: str, default: float) -> float:
        """A real number (epsilon, dropout, init range, rope theta), or the default when absent."""
        value = self.config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UnsupportedModelError(f"{self.source}: {key} is {value!r}, not a number")
        return float(value)
