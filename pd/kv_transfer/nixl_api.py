"""The NIXL Python API, imported on first use: by the NIXL connector (connectors/nixl/)
and the disk tier (pd/kv_offload/), which `pd` must not reach through the connector."""

from __future__ import annotations

import importlib
from typing import Any


def load_nixl() -> tuple[Any, tuple[type[Exception], ...]]:
    """The NIXL Python API module and its exception types, imported on first use."""
    for package in ("nixl", "nixl_cu12", "nixl_cu13"):
        try:
            api = importlib.import_module(f"{package}._api")
        except ImportError:
            continue
        errors = tuple(v for k, v in vars(api.nixlBind).items()
                       if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type))
        return api, errors
    raise ImportError("NIXL is not installed (pip install nixl-cu12)")
