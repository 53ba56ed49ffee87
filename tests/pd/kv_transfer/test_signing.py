"""Signed PD parameters and the peers a decode server trusts (pd/kv_transfer/signing.py)."""

from __future__ import annotations

import msgspec
import pytest

from pd.kv_transfer.params import RemotePrefillParams
from pd.kv_transfer.signing import (
    DEFAULT_ALLOWED_PEERS,
    TransferParamsGuard,
    TransferParamsRefused,
    prompt_digest,
    sign,
)

SECRET = "s3cret"
PROMPT = list(range(100, 140))
NOW = 1_800_000_000.0


def params(**changes) -> RemotePrefillParams:
    base = RemotePrefillParams(True, "pd-p", "127.0.0.1", 5555, "cmpl-1", [[1, 2, 3]], len(PROMPT), 7, 16,
                               lease_expires_at=NOW + 60, prompt_digest=prompt_digest(PROMPT))
    return msgspec.structs.replace(base, **changes)


def guard(secret: str | None = SECRET, allowed_peers: tuple[str, ...] = DEFAULT_ALLOWED_PEERS,
          **kwargs) -> TransferParamsGuard:
    return TransferParamsGuard(secret, allowed_peers, wall_clock=lambda: NOW, **kwargs)


def test_signed_parameters_pass_once() -> None:
    signed = sign(params(), SECRET)
    check = guard()
    check.check(signed, PROMPT)
    with pytest.raises(TransferParamsRefused, match="replay"):
        check.check(signed, PROMPT)


@pytest.mark.parametrize("change", [{"remote_host": "127.0.0.9"}, {"remote_port": 5556},
                                    {"remote_block_ids": [[1, 2, 4]]}, {"remote_request_id": "cmpl-2"},
                                    {"first_token_ids": [8]}, {"lease_expires_at": NOW + 3600}])
def test_any_changed_field_breaks_the_signature(change) -> None:
    forged = msgspec.structs.replace(sign(params(), SECRET), **change)
    with pytest.raises(TransferParamsRefused, match="does not match"):
        guard().check(forged, PROMPT)


def test_unsigned_expired_other_prompt_and_other_secret_are_refused() -> None:
    with pytest.raises(TransferParamsRefused, match="not signed"):
        guard().check(params(), PROMPT)
    with pytest.raises(TransferParamsRefused, match="expired"):
        guard().check(sign(params(lease_expires_at=NOW - 1), SECRET), PROMPT)
    with pytest.raises(TransferParamsRefused, match="another prompt"):
        guard().check(sign(params(), SECRET), PROMPT[:-1] + [5])
    with pytest.raises(TransferParamsRefused, match="does not match"):
        guard().check(sign(params(), "another"), PROMPT)


def test_without_a_secret_parameters_of_another_prompt_are_refused_too() -> None:
    with pytest.raises(TransferParamsRefused, match="another prompt"):
        guard(None).check(params(), PROMPT[:-1] + [5])
    with pytest.raises(TransferParamsRefused, match="another prompt"):
        guard(None).check(params(prompt_digest=None), PROMPT)


def test_without_a_secret_only_allowed_peers_are_trusted() -> None:
    guard(None).check(params(), PROMPT)  # loopback by default
    guard(None).check(params(remote_host="::1"), PROMPT)
    for host in ("10.1.2.3", "example.com", "0.0.0.0"):
        with pytest.raises(TransferParamsRefused, match="allowed peer"):
            guard(None).check(params(remote_host=host), PROMPT)
    narrow = guard(None, allowed_peers=["127.0.0.1/32"])
    with pytest.raises(TransferParamsRefused, match="allowed peer"):
        narrow.check(params(remote_host="127.0.0.2"), PROMPT)


def test_the_digest_depends_on_every_token() -> None:
    assert prompt_digest(PROMPT) == prompt_digest(list(PROMPT))
    assert prompt_digest(PROMPT) != prompt_digest(PROMPT[1:]) != prompt_digest(PROMPT[:-1] + [PROMPT[-1] + 1])


def test_used_signatures_are_forgotten_once_their_lease_ended() -> None:
    clock = [NOW]
    check = TransferParamsGuard(SECRET, DEFAULT_ALLOWED_PEERS, wall_clock=lambda: clock[0])
    for i in range(5):
        check.check(sign(params(remote_request_id=f"cmpl-{i}", lease_expires_at=NOW + 10 + i), SECRET), PROMPT)
    assert len(check._seen) == 5
    clock[0] = NOW + 12.5  # three of the five leases have ended
    check.check(sign(params(remote_request_id="cmpl-new", lease_expires_at=NOW + 100), SECRET), PROMPT)
    assert len(check._seen) == 3  # two left from before, and the new one
