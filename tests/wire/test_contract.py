"""The proxy <-> server wire contract is written once: no code outside wire/ spells one of
its codes, header names or kv_transfer_params keys as a literal (docstrings and comments
may name them), and the server's parameter types carry the keys the proxy reads."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec

from pd.kv_transfer.params import RemoteDecodeParams, RemotePrefillParams
from wire import codes, headers, kv_params

ROOT = Path(__file__).resolve().parents[2]
SIDES = ("pd", "proxy", "connectors", "telemetry", "cli", "benchmarks", "launch", "deploy", "kv_events")


def contract_values() -> dict[str, str]:
    """Each literal of the contract (lower case) -> the constant that holds it."""
    values = {}
    for module in (codes, headers, kv_params):
        for name, value in vars(module).items():
            if name.isupper():
                for one in (value if isinstance(value, tuple) else (value,)):
                    values[one.lower()] = f"{module.__name__}.{name}"
    return values


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def literals_of_the_contract(path: Path, values: dict[str, str]) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree)
    return sorted(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{node.lineno}: "
            f"{node.value!r} is {values[node.value.lower()]}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and node.value.lower() in values)


def test_no_literal_of_the_contract_is_left_outside_it() -> None:
    values = contract_values()
    assert len(values) >= 15  # codes, headers and keys were all read
    found = [hit for side in SIDES for path in sorted((ROOT / side).rglob("*.py"))
             for hit in literals_of_the_contract(path, values)]
    assert found == []


def test_the_check_finds_a_literal_in_code_and_not_in_a_docstring(tmp_path) -> None:
    source = tmp_path / "side.py"
    source.write_text('"""Answers 503 "engine_dead"."""\n\n'
                      'def f(response):\n    """Reads x-request-id."""\n'
                      '    return response.headers.get("x-request-id"), "kv_held_limit"\n')
    hits = literals_of_the_contract(source, contract_values())
    assert hits == ["side.py:5: 'kv_held_limit' is wire.codes.KV_HELD_LIMIT",
                    "side.py:5: 'x-request-id' is wire.headers.REQUEST_ID"]


def test_the_servers_parameter_types_carry_the_keys_the_proxy_reads() -> None:
    decode = {f.encode_name for f in msgspec.structs.fields(RemoteDecodeParams)}
    prefill = {f.encode_name for f in msgspec.structs.fields(RemotePrefillParams)}
    assert {kv_params.DO_REMOTE_DECODE, kv_params.PREFIX} <= decode
    assert {kv_params.DO_REMOTE_PREFILL, kv_params.REMOTE_REQUEST_ID, kv_params.SIGNATURE} <= prefill


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    assert headers.retry_after(1) == {"Retry-After": "1"}
    assert headers.retry_after(0.2) == {"Retry-After": "1"}
    assert headers.retry_after(2.5) == {"Retry-After": "3"}
    assert headers.retry_after(-1) == {"Retry-After": "0"}
