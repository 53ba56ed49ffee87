"""A prefill server that accepts TCP and never answers the handshake must not stall a
decode server: the handshake runs off the engine step, so D's other streams keep their
pace (gaps measured from the stream's own arrival times), and the stalled request is
computed on D once the handshake times out."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

from launch import http_client
from tests.support.listeners import ConnectionRecorder
from tests.support.server_harness import running_server

pytestmark = pytest.mark.slow
PROMPT = "The keeper counted ships until the lamp went out. " * 3
MAX_GAP_S = 1.0  # the handshake timeout is 5 s: a stalled step would show a gap of about that


def test_a_peer_that_never_answers_does_not_stall_other_streams(tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    recorder = ConnectionRecorder()
    with contextlib.ExitStack() as stack:
        stack.callback(recorder.close)
        unsigned = ("--kv-transfer-secret", "", "--allow-unsigned-kv-params")  # parameters re-pointed below
        p = stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / "p.log", "--role", "prefill",
                                               *unsigned))
        d = stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / "d.log", "--role", "decode",
                                               *unsigned))
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        params = http_client().post(f"{p.url}/v1/completions", timeout=60, json=body | {
            "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        silent = params | {"remote_engine_id": "pd-silent", "remote_port": recorder.port}
        stalled: dict = {}

        def send_stalled() -> None:
            stalled["response"] = http_client().post(f"{d.url}/v1/completions", timeout=60,
                                                     json=body | {"kv_transfer_params": silent})

        arrivals = []
        long = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with http_client().stream("POST", f"{d.url}/v1/completions", json=long, timeout=60) as stream:
            sender = threading.Thread(target=send_stalled)
            for line in stream.iter_lines():
                if not line.startswith("data: {"):
                    continue
                arrivals.append(time.monotonic())
                if len(arrivals) == 5:
                    sender.start()
                if sender.ident is not None and not sender.is_alive():
                    break
        assert recorder.accepted >= 1  # D did try the silent peer meanwhile
        assert stalled["response"].status_code == 200, stalled["response"].text  # computed on D after the timeout
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert arrivals[-1] - arrivals[4] >= 4.0  # the stream ran through the whole handshake timeout
        assert max(gaps) < MAX_GAP_S, f"the longest gap between chunks was {max(gaps):.2f} s"
        assert d.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
