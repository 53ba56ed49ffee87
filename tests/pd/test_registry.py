"""The one registry shape: models, attention backends and KV connectors by name,
imported only when asked for, an unknown name refused with the known ones."""

from __future__ import annotations

import sys

import pytest

from pd.attention import ATTENTION_BACKENDS
from pd.contracts.connector_api import KVConnector, NullConnector
from pd.kv_transfer.connectors import KV_CONNECTORS
from pd.models.registry import MODELS
from pd.registry import Registry


def test_an_entry_is_imported_only_when_asked_for() -> None:
    registry = Registry("thing", {"json": "json.decoder:JSONDecoder", "missing": "pd_no_such_module:X"})
    assert registry.names() == ["json", "missing"] and "json" in registry and "yaml" not in registry
    import json.decoder

    assert registry.get("json") is json.decoder.JSONDecoder
    assert "pd_no_such_module" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        registry.get("missing")


@pytest.mark.parametrize("registry, kind", [(MODELS, "architecture"), (ATTENTION_BACKENDS, "attention backend"),
                                            (KV_CONNECTORS, "KV connector")])
def test_an_unknown_name_is_refused_with_the_known_ones(registry: Registry, kind: str) -> None:
    with pytest.raises(ValueError, match=f"unknown {kind} 'nope'; known: {registry.names()[0]}"):
        registry.get("nope")


def test_every_connector_entry_builds_both_halves() -> None:
    assert KV_CONNECTORS.names() == ["nixl", "null"]
    assert KV_CONNECTORS.get("null") is NullConnector
    assert all(issubclass(KV_CONNECTORS.get(name), KVConnector) for name in KV_CONNECTORS.names())
