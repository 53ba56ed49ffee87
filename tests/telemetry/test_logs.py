"""Log lines as text or JSON, naming the request (and trace) bound to the task that wrote them."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from telemetry import logs


@pytest.fixture
def captured(monkeypatch):
    """The root logger's handler, configured as `configure` would, writing into a list."""
    lines: list[str] = []

    def configure(fmt: str) -> None:
        logs.configure("info", fmt)
        handler = logging.getLogger().handlers[0]
        handler.emit = lambda record: lines.append(handler.format(record))

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # restored afterwards, and the level
    monkeypatch.setattr(root, "level", root.level)
    return configure, lines


def test_json_lines_name_the_request_and_trace_bound_to_the_task(captured) -> None:
    configure, lines = captured
    configure("json")
    log = logging.getLogger("pd.test")

    async def serve(request_id: str, trace_id: str | None) -> None:
        logs.bind(request_id, trace_id)
        await asyncio.sleep(0)
        log.warning("serving %s", request_id)

    async def both() -> None:  # two requests' tasks at once: each line names its own
        await asyncio.gather(serve("cmpl-1", "ab" * 16), serve("cmpl-2", None))
        log.info("between requests")

    asyncio.run(both())
    records = [json.loads(line) for line in lines]
    assert [(r["message"], r.get("request_id"), r.get("trace_id")) for r in records] == [
        ("serving cmpl-1", "cmpl-1", "ab" * 16), ("serving cmpl-2", "cmpl-2", None), ("between requests", None, None)]
    assert records[0]["level"] == "warning" and records[0]["logger"] == "pd.test"
    assert records[0]["time"].endswith("Z") and "T" in records[0]["time"]


def test_a_json_line_carries_the_traceback_and_text_lines_stay_text(captured) -> None:
    configure, lines = captured
    configure("json")
    try:
        raise ValueError("bad \"quote\"\nand a newline")
    except ValueError:
        logging.getLogger("pd.test").exception("failed")
    record = json.loads(lines[-1])  # one line whatever the message holds
    assert "\n" not in lines[-1] and "ValueError" in record["exc_info"]
    configure("text")
    logging.getLogger("pd.test").warning("plain")
    assert lines[-1].endswith("WARNING pd.test: plain")


def test_a_child_process_takes_the_format_from_the_environment(monkeypatch, captured) -> None:
    for name in (logs.ENV_FORMAT, logs.ENV_LEVEL):  # as they were afterwards: set, then removed
        monkeypatch.setenv(name, "")  # (a delenv of an unset name would record nothing to restore)
        monkeypatch.delenv(name)
    logs.configure("warning", "json", children=True)
    assert (logs.os.environ[logs.ENV_FORMAT], logs.os.environ[logs.ENV_LEVEL]) == ("json", "warning")
    logging.getLogger().handlers.clear()
    logs.configure_from_env()
    assert isinstance(logging.getLogger().handlers[0].formatter, logs.JsonFormatter)
    assert logging.getLogger().level == logging.WARNING


def test_the_environment_is_left_as_it_was() -> None:  # after the test above, in the same process
    assert logs.os.environ.get(logs.ENV_FORMAT) != "json"


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="json"):
        logs.configure("info", "yaml")
