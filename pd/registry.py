"""One shape for every choice made by name: a registry of "module:attribute" entries,
imported only when one is asked for, so the core imports fast and a heavy or optional
backend (torch kernels, NIXL) loads only where it is used.

Used for models (`pd/models/registry.py`, by the `architectures` of config.json),
attention backends (`pd/attention/__init__.py`) and KV connectors
(`pd/kv_transfer/connectors.py`, `--kv-connector NAME`).
"""

from __future__ import annotations

import importlib
from typing import Any


class Registry:
    def __init__(self, kind: str, entries: dict[str, str]) -> None:
        self.kind = kind  # what is named, for errors: "attention backend"
        self.entries = dict(entries)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def get(self, name: str) -> Any:
        """What `name` is registered as, imported now; ValueError naming the known ones."""
        if name not in self.entries:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        module_name, attribute = self.entries[name].split(":")
        return getattr(importlib.import_module(module_name), attribute)
