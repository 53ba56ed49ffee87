"""`pd serve --register`: what a server announces and the flags it refuses before its
engine starts (pd/server/main.py `_registrar`, pd/server/registration.py)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import msgspec
import pytest

from pd.config import config_from_args
from pd.server.main import _registrar, add_serve_flags
from wire.fleet import Registration, sign, signed_by


def registrar(*flags: str, secret: str | None = "s" * 64):
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args(["--model", "/nonexistent", "--register", "http://127.0.0.1:8000/", *flags])
    config = config_from_args(args)  # not resolved (no model): the connector as resolve() would make it
    connector = config.transfer.connector if config.transfer.connector != "auto" else \
        ("null" if config.role == "both" else "nixl")
    config = replace(config, transfer=replace(config.transfer, secret=secret, connector=connector))
    return _registrar(args, config)


def test_a_both_server_with_a_connector_registers_both_roles_asking_decode_first() -> None:
    found = registrar("--role", "both", "--kv-connector", "nixl", "--port", "8101")
    assert (found.roles, found.role, found.proxy_urls) == (["prefill", "decode"], "decode", ("http://127.0.0.1:8000",))
    assert registrar("--role", "both", "--kv-connector", "nixl", "--register-role", "prefill").role == "prefill"
    assert registrar("--role", "prefill").roles == ["prefill"]


@pytest.mark.parametrize(("flags", "secret", "message"), [
    (("--role", "both"), "s", "only with a KV connector"),
    (("--role", "decode", "--register-role", "prefill"), "s", "serves only as decode"),
    (("--role", "decode"), None, "deployment's secret"),
    (("--role", "decode", "--host", "0.0.0.0"), "s", "--advertise-url"),
])
def test_flags_that_cannot_register_are_refused(flags, secret, message) -> None:
    with pytest.raises(ValueError, match=message):
        registrar(*flags, secret=secret)


def test_a_registration_is_signed_over_its_exact_bytes() -> None:
    found = registrar("--role", "decode", "--advertise-url", "http://127.0.0.1:9/")
    found.compat_hash = "abc"
    body = found.message()
    sent = msgspec.json.decode(body, type=Registration)
    assert (sent.url, sent.roles, sent.state, sent.compat_hash) == ("http://127.0.0.1:9", ["decode"], "serving", "abc")
    assert signed_by("s" * 64, body, sign("s" * 64, body))
    assert not signed_by("s" * 64, body + b" ", sign("s" * 64, body))
    assert not signed_by("s" * 64, body, "\u00e9" * 64)  # not ASCII: refused, not an error
