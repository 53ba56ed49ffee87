"""What a model's layers need during one forward pass, beyond their inputs.

The model runner builds a `ForwardContext` once per step and installs it with
`set_forward_context`; each attention or Mamba layer looks up its own metadata and KV
cache view by its layer name. Metadata objects are built once per attention group and
shared by every layer of that group, so `attn_metadata[a] is attn_metadata[b]` for two
layers of one group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pd.kv_cache.allocation import LayerCache


@dataclass
class ForwardContext:
    """`attn_metadata`: layer name -> its group's metadata (attention or Mamba);
    `kv_caches`: layer name -> its typed view of the KV cache memory."""

    attn_metadata: dict[str, Any]
    kv_caches: dict[str, LayerCache]


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    global _current
    previous, _current = _current, context
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: layers with KV caches run only inside set_forward_context")
    return _current
