"""Attention backends, imported lazily by name (see `get_attention_backend`)."""

from __future__ import annotations

import importlib

from pd.attention.backend import AttentionBackend

_BACKENDS = {"torch": "pd.attention.torch_backend:TorchAttentionBackend"}


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name`; ValueError listing the known ones."""
    try:
        module_name, class_name = _BACKENDS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(sorted(_BACKENDS))}") from None
    return getattr(importlib.import_module(module_name), class_name)
