"""Attention backends, imported lazily by name (`ATTENTION_BACKENDS`, see pd/registry.py)."""

from __future__ import annotations

from pd.attention.backend import AttentionBackend
from pd.registry import Registry

ATTENTION_BACKENDS = Registry("attention backend", {"torch": "pd.attention.torch_backend:TorchAttentionBackend"})


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name`; ValueError listing the known ones."""
    return ATTENTION_BACKENDS.get(name)
