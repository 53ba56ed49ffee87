"""The NIXL connector's scheduler half between a P and a D scheduler (real schedulers and
KV cache managers; block contents are not moved here, see test_transport.py for bytes).

Checks the bookkeeping the PD protocol rests on: P keeps exactly the request's blocks
under a lease and hands out their positional ids; D reads exactly the positions it
lacks (past its own prefix hit; only the final Mamba state); bad parameters and early
aborts turn into rejects that let P free at once.
"""

from __future__ import annotations

import pytest

from connectors.nixl.scheduler import NixlConnectorScheduler, ReqToSend
from pd.config import SchedulerConfig, SchedulerSettings
from pd.contracts.connector_api import KVConnectorOutput
from pd.contracts.outputs import ModelRunnerOutput
from pd.contracts.request import Request, RequestStatus
from pd.contracts.sampling_params import SamplingParams
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_cache.layout import make_kv_cache_config
from pd.kv_cache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from pd.kv_transfer.params import RemoteDecodeParams, RemotePrefillParams
from pd.scheduling.scheduler import Scheduler

BLOCK = 16


def attn(window=None):
    kw = dict(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype="float32")
    return SlidingWindowSpec(sliding_window=window, **kw) if window else FullAttentionSpec(**kw)


def ssm():
    return MambaSpec(block_size=BLOCK, num_heads=2, head_dim=8, state_size=8, n_groups=1, conv_width=4,
                     conv_dtype="float32", ssm_dtype="float32")


MODELS = {"full": [attn(), attn()], "gemma3": [attn(40), attn(40), attn()], "bamba": [ssm(), ssm(), attn()]}


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def make_side(model: str, engine_id: str, clock: Clock):
    specs = {f"l{i}": s for i, s in enumerate(MODELS[model])}
    config = make_kv_cache_config(specs, 10**8, 1024)
    kv = KVCacheManager(config, True, 1024)
    sizes = config.block_sizes
    connector = NixlConnectorScheduler(engine_id, "127.0.0.1", 5555, sizes, lease_seconds=30, clock=clock)
    scheduler = Scheduler(SchedulerConfig(SchedulerSettings(8, 64, kv_max_held_fraction=1.0, reserve_growth_tokens=0),
                                          1024, frozenset()), kv, connector)
    return scheduler, kv, connector


def run_step(scheduler: Scheduler, token: int = 7, connector_output: KVConnectorOutput | None = None):
    """One step; every request whose known tokens are all computed samples `token`."""
    so = scheduler.schedule()
    sampled = {r: token for r, n in so.num_scheduled_tokens.items()
               if scheduler.requests[r].num_computed_tokens + n >= scheduler.requests[r].num_tokens}
    out = ModelRunnerOutput(sampled, kv_connector_output=connector_output or KVConnectorOutput())
    return so, scheduler.update_from_output(so, out)


def prefill_on_p(model: str, prompt: list[int]):
    clock = Clock()
    p, p_kv, _ = make_side(model, "P", clock)
    p.add_request(Request("p1", prompt, SamplingParams(max_tokens=1), kv_transfer_params=RemoteDecodeParams(True)))
    finished = []
    while not finished:
        _, outs = run_step(p, token=42)
        finished = [o for o in outs if o.finished]
    return p, p_kv, clock, finished[0]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_p_keeps_the_blocks_under_a_lease_and_hands_out_their_ids(model: str) -> None:
    prompt = list(range(100, 100 + 5 * BLOCK + 3))
    p, p_kv, clock, out = prefill_on_p(model, prompt)
    params = out.kv_transfer_params
    assert out.finish_reason == "length" and out.new_token_ids == [42]
    assert params.do_remote_prefill and params.first_token_ids == [42]
    assert params.num_prompt_tokens == len(prompt) and params.remote_request_id == "p1"
    held = p.remote_kv.delayed_free["p1"]
    assert params.remote_block_ids == p_kv.get_block_ids("p1") and p_kv.usage > 0
    lease = run_step(p)[0].kv_connector_metadata.reqs_to_send  # queued at finish, sent next step
    assert lease == [ReqToSend("p1", clock.now + 30)]
    run_step(p, connector_output=KVConnectorOutput(finished_sending={"p1"}))
    assert "p1" not in p.remote_kv.delayed_free and p_kv.usage == 0.0 and \
        held.status is RequestStatus.FINISHED_LENGTH_CAPPED
    p_kv.check_integrity()


def remote_request(req_id: str, prompt: list[int], params: RemotePrefillParams) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=4), kv_transfer_params=params)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_d_reads_exactly_the_positions_it_lacks(model: str) -> None:
    prompt = list(range(100, 100 + 5 * BLOCK + 3))
    _, _, _, out = prefill_on_p(model, prompt)
    d, d_kv, _ = make_side(model, "D", Clock())
    d.add_request(remote_request("d1", prompt, out.kv_transfer_params))
    so, _ = run_step(d)
    (recv,) = so.kv_connector_metadata.reqs_to_recv
    assert d.requests["d1"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert recv.remote.remote_request_id == "p1" and recv.remote_block_ids == out.kv_transfer_params.remote_block_ids
    local = d_kv.get_block_ids("d1")
    for group, spec in enumerate(d_kv.config.groups):
        reads = [i for i, b in enumerate(recv.local_block_ids[group]) if b]
        if isinstance(spec.spec, MambaSpec):
            assert reads == [len(prompt) // BLOCK]  # only the block with the final state
        elif isinstance(spec.spec, SlidingWindowSpec):
            assert reads == [i for i, b in enumerate(local[group]) if b]  # the window's blocks
            assert reads[0] > 0
        else:
            assert reads == list(range(len(prompt) // BLOCK + 1))  # every block, partial last one too
        assert all(recv.remote_block_ids[group][i] for i in reads), "P must hold what D reads"
    # the read lands: D continues from P's first token without recomputing the prompt
    so, outs = run_step(d, token=9, connector_output=KVConnectorOutput(finished_recving={"d1"}))
    assert outs[0].new_token_ids == [42]
    so, outs = run_step(d, token=9)
    assert so.num_scheduled_tokens == {"d1": 1} and outs[0].new_token_ids == [9]


def test_a_d_prefix_hit_shrinks_what_is_read_for_a_hybrid_too() -> None:
    shared = list(range(500, 500 + 4 * BLOCK))
    first, second = shared + [1, 2, 3], shared + list(range(7, 7 + BLOCK + 5))
    d, d_kv, _ = make_side("bamba", "D", Clock())
    reads = []
    for i, prompt in enumerate((first, second)):
        _, _, _, out = prefill_on_p("bamba", prompt)
        d.add_request(remote_request(f"d{i}", prompt, out.kv_transfer_params))
        so, _ = run_step(d)
        (recv,) = so.kv_connector_metadata.reqs_to_recv
        reads.append(sum(1 for ids in recv.local_block_ids for b in ids if b))
        run_step(d, connector_output=KVConnectorOutput(finished_recving={f"d{i}"}))
        while f"d{i}" in d.requests:
            run_step(d)
    assert d_kv.stats.group_hits[2] >= 4 * BLOCK  # the attention group hit the shared prefix
    attention_reads_second = reads[1] - 2  # two Mamba groups read one block each
    assert attention_reads_second == 2  # blocks 4 and 5 only, not 0..5


def test_bad_params_are_computed_locally_and_rejected_to_p() -> None:
    prompt = list(range(100, 140))
    _, _, _, out = prefill_on_p("full", prompt)
    d, d_kv, connector = make_side("full", "D", Clock())
    wrong = remote_request("d1", prompt + [5], out.kv_transfer_params)  # one token more than P saw
    d.add_request(wrong)
    so, _ = run_step(d)
    assert so.num_scheduled_tokens == {"d1": len(prompt) + 1}  # computed here
    assert "do not fit" in wrong.kv_load_error and not wrong.do_remote_prefill
    (remote, reason), = so.kv_connector_metadata.reqs_to_reject
    assert remote.remote_request_id == "p1" and "41" in reason and connector.num_rejected == 1


def test_refused_params_on_a_hybrid_use_the_local_hit_not_the_remote_one() -> None:
    """A remote prefill's hit skips the Mamba groups (their state comes from P); once its
    parameters are refused the request is computed here and must start from a hit whose
    Mamba state exists here."""
    shared = list(range(500, 500 + 4 * BLOCK))
    _, _, _, out = prefill_on_p("bamba", shared + [1, 2, 3])
    d, d_kv, _ = make_side("bamba", "D", Clock())
    d.add_request(remote_request("d0", shared + [1, 2, 3], out.kv_transfer_params))
    run_step(d)  # attention blocks and only the final Mamba state are read from P, then cached
    run_step(d, connector_output=KVConnectorOutput(finished_recving={"d0"}))
    while "d0" in d.requests:
        run_step(d)
    prompt = shared + list(range(7, 27))  # P's parameters were for another prompt length
    _, remote_hit = d_kv.get_computed_blocks(remote_request("probe", prompt, out.kv_transfer_params),
                                             d_kv.partial_prefix_groups)
    _, local_hit = d_kv.get_computed_blocks(Request("probe", prompt, SamplingParams()))
    assert remote_hit == 4 * BLOCK and local_hit < remote_hit
    d.add_request(remote_request("d1", prompt, out.kv_transfer_params))
    so, _ = run_step(d)
    assert so.new_requests[0].num_computed_tokens == local_hit  # not the attention-only remote hit
    assert so.num_scheduled_tokens["d1"] > 0


def test_aborting_before_admission_rejects_to_p() -> None:
    prompt = list(range(100, 140))
    _, _, _, out = prefill_on_p("full", prompt)
    d, d_kv, _ = make_side("full", "D", Clock())
    d.add_request(remote_request("d1", prompt, out.kv_transfer_params))
    d.abort_requests(["d1"])
    so, _ = run_step(d)
    assert [r.remote_request_id for r, _ in so.kv_connector_metadata.reqs_to_reject] == ["p1"]
    assert d_kv.usage == 0.0


def test_an_aborted_p_request_keeps_nothing() -> None:
    clock = Clock()
    p, p_kv, _ = make_side("full", "P", clock)
    p.add_request(Request("p1", list(range(100, 140)), SamplingParams(max_tokens=1),
                          kv_transfer_params=RemoteDecodeParams(True)))
    (out,) = p.abort_requests(["p1"])
    assert out.kv_transfer_params is None and not p.remote_kv.delayed_free and p_kv.usage == 0.0


def test_p_refuses_prefills_for_decode_servers_past_its_held_share_and_a_release_frees_them() -> None:
    from pd.errors import HeldBlocksLimitError

    specs = {"l0": attn(), "l1": attn()}
    config = make_kv_cache_config(specs, 10**8, 1024)
    kv = KVCacheManager(config, True, 1024)
    connector = NixlConnectorScheduler("P", "127.0.0.1", 5555, [BLOCK], lease_seconds=30, clock=Clock())
    limit = 0.01
    p = Scheduler(SchedulerConfig(SchedulerSettings(8, 4096, kv_max_held_fraction=limit, reserve_growth_tokens=0),
                                  1024, frozenset()), kv, connector)
    prompts = [list(range(100 + 200 * i, 100 + 200 * i + 8 * BLOCK)) for i in range(40)]
    held = 0
    for i, prompt in enumerate(prompts):
        try:
            p.add_request(Request(f"p{i}", prompt, SamplingParams(max_tokens=1),
                                  kv_transfer_params=RemoteDecodeParams(True)))
        except HeldBlocksLimitError as exc:
            assert "retry later" in str(exc)
            break
        while f"p{i}" in p.requests:
            run_step(p)
        held += 1
    else:
        pytest.fail("the held-blocks limit never refused a prefill")
    assert p.remote_kv.num_held_blocks >= limit * kv.num_usable_blocks > (held - 1) * 8
    p.add_request(Request("local", list(range(5, 40)), SamplingParams(max_tokens=1)))  # its own requests go on
    assert p.remote_kv.release_held(["p0", "nope"]) == ["p0"]
    so, _ = run_step(p)
    assert so.kv_connector_metadata.reqs_to_release == ["p0"]
    run_step(p, connector_output=KVConnectorOutput(finished_sending={"p0"}))  # what the worker then reports
    assert "p0" not in p.remote_kv.delayed_free and p.remote_kv.num_held_blocks == (held - 1) * 8


def test_d_keeps_p_s_lease_alive_while_the_request_waits_and_reads_under_the_extended_lease() -> None:
    prompt = list(range(100, 140))
    _, _, _, out = prefill_on_p("full", prompt)
    params = out.kv_transfer_params
    assert params.lease_seconds == 30
    wall = Clock()
    wall.now = params.lease_expires_at - 30  # when P issued them
    d, d_kv, connector = make_side("full", "D", Clock())
    connector.wall_clock = wall
    request = remote_request("d1", prompt, params)
    connector.requests_waiting([request])
    assert connector.build_connector_meta().reqs_to_keep_alive == []  # most of the lease is left
    wall.now += 16  # past half of it
    connector.requests_waiting([request])
    (kept,) = connector.build_connector_meta().reqs_to_keep_alive
    assert kept.remote_request_id == "p1" and kept.remote_port == params.remote_port
    connector.requests_waiting([request])  # sent once per half lease, not every step
    assert connector.build_connector_meta().reqs_to_keep_alive == []
    d.add_request(request)
    so, _ = run_step(d)
    (recv,) = so.kv_connector_metadata.reqs_to_recv
    assert recv.remote.lease_expires_at == pytest.approx(wall.now + 30 * 0.9)  # what the KeepAlive bought
    assert recv.remote.lease_expires_at > params.lease_expires_at


def export_on_d(model: str, prompt: list[int]) -> RemotePrefillParams:
    """A decode server's parameters for `prompt` as a prefix (the proxy's export of what
    it holds: a one-token completion kept for a reader)."""
    return prefill_on_p(model, prompt)[3].kv_transfer_params


def prefix_request(req_id: str, prompt: list[int], prefix: RemotePrefillParams) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=1),
                   kv_transfer_params=RemoteDecodeParams(True, prefix=prefix))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_p_reads_the_prefix_from_d_then_computes_the_rest_and_keeps_all_for_d(model: str) -> None:
    prompt = list(range(100, 100 + 7 * BLOCK + 3))
    prefix = export_on_d(model, prompt[:4 * BLOCK])
    p, p_kv, _ = make_side(model, "P", Clock())
    p.add_request(prefix_request("p1", prompt, prefix))
    so, _ = run_step(p)
    (recv,) = so.kv_connector_metadata.reqs_to_recv
    assert recv.remote.remote_request_id == "p1" and so.num_scheduled_tokens == {}  # D's export: waits for it
    for group, spec in enumerate(p_kv.config.groups):
        reads = [i for i, b in enumerate(recv.local_block_ids[group]) if b]
        assert len(recv.local_block_ids[group]) == 4  # the prefix's positions
        if isinstance(spec.spec, MambaSpec):
            assert reads == [3]  # the state at the prefix's end
        elif not isinstance(spec.spec, SlidingWindowSpec):
            assert reads == [0, 1, 2, 3]
    _, outs = run_step(p, connector_output=KVConnectorOutput(finished_recving={"p1"}))
    assert outs == [] and p.requests["p1"].kv_transfer_params == RemoteDecodeParams(True)  # no first token from D
    so, outs = run_step(p, token=42)
    assert so.new_requests[0].num_computed_tokens == 4 * BLOCK and so.num_scheduled_tokens["p1"] == 3 * BLOCK + 3
    assert p.prompt_sources.counts == {"computed": 3 * BLOCK + 3, "local_cache": 0, "remote": 4 * BLOCK}
    (out,) = outs
    assert out.new_token_ids == [42] and out.kv_transfer_params.num_prompt_tokens == len(prompt)  # all, for D
    assert "p1" in p.remote_kv.delayed_free


def test_a_prefix_p_cannot_read_is_computed_on_p_even_under_the_fail_policy() -> None:
    prompt = list(range(100, 100 + 5 * BLOCK))
    prefix = export_on_d("bamba", prompt[:2 * BLOCK])
    p, p_kv, _ = make_side("bamba", "P", Clock())
    p.remote_kv.load_failure_policy = "fail"
    p.add_request(prefix_request("p1", prompt, prefix))
    run_step(p)
    so, outs = run_step(p, connector_output=KVConnectorOutput(failed_recving={"p1": "D is gone"}))
    assert outs == [] and p.remote_kv.load_failures == {"recompute": 1, "fail": 0}
    so, _ = run_step(p)  # computed from scratch, its Mamba state too
    assert so.new_requests[0].num_computed_tokens == 0 and so.num_scheduled_tokens["p1"] == 4 * BLOCK  # a chunk


@pytest.mark.parametrize("arch", ["gemma3", "bamba"])
def test_a_prefix_p_holds_already_is_not_read_and_d_is_told_to_free_it(arch) -> None:
    """Not a load failure (the probe saw every such turn counted as one on Bamba, the
    reason nowhere): counted as a read skipped, and P goes on from its own hit."""
    prompt = list(range(100, 100 + 5 * BLOCK))
    prefix = export_on_d(arch, prompt[:2 * BLOCK])
    p, p_kv, connector = make_side(arch, "P", Clock())
    p.add_request(Request("warm", prompt[:4 * BLOCK], SamplingParams(max_tokens=1)))
    while "warm" in p.requests:
        run_step(p)
    p.add_request(prefix_request("p1", prompt, prefix))
    so, _ = run_step(p)
    assert so.kv_connector_metadata.reqs_to_recv == [] and connector.num_rejected == 0
    assert [(r.remote_request_id, why) for r, why in so.kv_connector_metadata.reqs_to_reject] == [
        ("p1", f"the prefix's {2 * BLOCK} tokens are held here already")]
    assert so.new_requests[0].num_computed_tokens == 4 * BLOCK  # its own hit (all groups), computed on
    assert p.remote_kv.load_failures == {"recompute": 0, "fail": 0} and p.remote_kv.reads_skipped == 1
    assert "p1" in p.remote_kv.delayed_free  # finished, its blocks kept for D as any prefill's
