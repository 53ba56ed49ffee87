"""`pd proxy`'s flags: repeated server flags add their URLs (the probe found only the
last `--prefill` kept, silently), and a URL given twice is refused with a message."""

from __future__ import annotations

import argparse

import pytest

from proxy.main import add_proxy_flags, proxy_config


def parse(*flags: str):
    parser = argparse.ArgumentParser()
    add_proxy_flags(parser)
    return proxy_config(parser.parse_args(list(flags)))


def test_repeated_server_flags_add_their_urls() -> None:
    config = parse("--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:3", "--prefill",
                   "http://127.0.0.1:2", "http://127.0.0.1:4", "--decode", "http://127.0.0.1:5")
    assert config.prefill_urls == ("http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:4")
    assert config.decode_urls == ("http://127.0.0.1:3", "http://127.0.0.1:5")


@pytest.mark.parametrize("flags", [("--prefill", "http://a:1", "--prefill", "http://a:1", "--decode", "http://b:1"),
                                   ("--prefill", "http://a:1", "--decode", "http://b:1", "http://b:1")])
def test_a_url_given_twice_is_refused(flags) -> None:
    with pytest.raises(SystemExit, match=r"pd proxy: http://\w:1 given more than once as --(prefill|decode)"):
        parse(*flags)
