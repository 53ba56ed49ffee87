"""The torch paged-attention backend against dense per-request softmax attention.

Every step runs through `Harness.step`, which checks three things: the output equals a
float64 reference over the request's full K/V (causal, windowed); the cache holds the
step's K/V at the mapped slots; and no other byte of the backing buffers changed. Block 0
and every block a request no longer needs are filled with NaN, so a read of any of them
would turn the output into NaN.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.attention import cpu_kernels, get_attention_backend, torch_backend
from pd.attention.backend import CommonAttentionMetadata
from pd.attention.torch_backend import TorchAttentionBackend, TorchAttentionImpl, TorchAttentionMetadata
from pd.kv_cache.allocation import allocate_kv_caches
from pd.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from tests.support.attention_builders import require_native_kernel, torch_threads

SCALE = 0.37  # not 1/sqrt(D): the caller's scale must be the one used
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: thread spin-up costs more than it saves on a shared CPU."""
    with torch_threads(1):
        yield


@pytest.fixture(autouse=True, params=["native", "native-tile3", "gathered"])
def attention_path(request, monkeypatch) -> str:
    """Every test runs three times: every query through the native CPU kernel (which must
    have been built), in tiles of 8 tokens and of 3 (so tiles end mid-block and
    mid-window), and through the torch path (every device's: gathered decodes, SDPA
    prefills, K/V written by indexing)."""
    if request.param.startswith("native"):
        require_native_kernel()
        if request.param == "native-tile3":
            monkeypatch.setattr(torch_backend, "TILE_TOKENS", 3)
    else:
        monkeypatch.setattr(cpu_kernels, "supports", lambda *args: False)
        monkeypatch.setattr(cpu_kernels, "write_kv", lambda *args: False)
    return request.param


@dataclass(frozen=True)
class Shape:
    block_size: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 8
    window: int | None = None
    dtype: torch.dtype = torch.float32
    num_layers: int = 1
    device: str = "cpu"


@dataclass
class Req:
    """A request's whole sequence per layer: q (L, n, H, D), k and v (L, n, KVH, D)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    blocks: list[int] = field(default_factory=list)  # column j holds positions [j*bs, (j+1)*bs)
    done: int = 0

    @property
    def length(self) -> int:
        return self.q.shape[1]


def plain_caches(shape: Shape, num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    kv = torch.empty(num_blocks, 2, shape.block_size, shape.num_kv_heads, shape.head_size,
                     dtype=shape.dtype, device=shape.device)
    caches = [kv.clone() for _ in range(shape.num_layers)]
    return caches, [c.view(torch.int8) for c in caches]


def allocated_caches(shape: Shape, num_blocks: int, layout: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The views `allocate_kv_caches` gives the last layers of a 3+-layer group."""
    spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=shape.num_kv_heads,
                             head_size=shape.head_size, dtype=str(shape.dtype).removeprefix("torch."))
    names = tuple(f"layer{i}" for i in range(shape.num_layers + 2))
    alloc = allocate_kv_caches(KVCacheConfig(num_blocks=num_blocks, groups=(KVCacheGroup(spec, names),)),
                               device=shape.device, layout=layout)
    for buf in alloc.buffers:
        buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8))  # garbage bytes
    return [alloc.layer_caches[n].kv for n in names[2:]], alloc.buffers


class Harness:
    """Runs steps of a batch through the backend and checks each one (see module doc)."""

    def __init__(self, shape: Shape, caches: list[torch.Tensor], buffers: list[torch.Tensor],
                 stale_ids: bool = False, seed: int = 0) -> None:
        self.shape, self.caches, self.buffers, self.stale_ids = shape, caches, buffers, stale_ids
        self.gen = torch.Generator().manual_seed(seed)
        num_blocks = caches[0].shape[0]
        self.free = random.Random(seed).sample(range(1, num_blocks), num_blocks - 1)  # shuffled ids
        for cache in caches:
            cache.fill_(float("nan"))
        self.builder = TorchAttentionBackend.builder_cls()(shape.window, torch.device(shape.device))
        self.impl = TorchAttentionBackend.impl_cls()(shape.num_heads, shape.num_kv_heads,
                                                    shape.head_size, SCALE, shape.window)

    def request(self, length: int) -> Req:
        s = self.shape
        def rand(heads: int) -> torch.Tensor:
            return torch.randn(s.num_layers, length, heads, s.head_size, generator=self.gen).to(s.dtype)
        return Req(q=rand(s.num_heads), k=rand(s.num_kv_heads), v=rand(s.num_kv_heads))

    def step(self, work: list[tuple[Req, int]], pad: int = 0) -> TorchAttentionMetadata:
        """Compute `n` new tokens of each `(req, n)`, in that batch order, plus `pad` padding rows."""
        for req, n in work:
            assert 0 < n <= req.length - req.done, "test bug: step past the request's end"
            self._prepare(req, req.done + n)
        common = self._common(work, pad)
        metadata = self.builder.build(common)
        self._check_gathers(metadata, work)
        new = [(req, req.done, req.done + n) for req, n in work]
        slots = common.slot_mapping[: common.num_actual_tokens]
        blocks, offsets = slots // self.shape.block_size, slots % self.shape.block_size
        for layer, cache in enumerate(self.caches):
            snapshot = [b.clone() for b in self.buffers]
            old = cache[blocks, :, offsets].clone()
            out = self.impl.forward(*(self._batch(new, layer, name, pad) for name in "qkv"), cache, metadata)
            self._check_output(out, new, layer, pad)
            self._check_cache(cache, blocks, offsets, old, new, layer, snapshot)
        for req, n in work:
            req.done += n
        return metadata

    def _prepare(self, req: Req, end: int) -> None:
        """Give the request blocks up to `end`; free (NaN, null or stale id) those before its window."""
        bs = self.shape.block_size
        while len(req.blocks) * bs < end:
            req.blocks.append(self.free.pop())
        if self.shape.window is None:
            return
        first_col = max(0, req.done - self.shape.window + 1) // bs
        for col in range(first_col):
            if req.blocks[col]:
                for cache in self.caches:
                    cache[req.blocks[col]] = float("nan")
                if not self.stale_ids:
                    req.blocks[col] = 0

    def _common(self, work: list[tuple[Req, int]], pad: int) -> CommonAttentionMetadata:
        bs = self.shape.block_size
        starts = [0]
        for _, n in work:
            starts.append(starts[-1] + n)
        width = max(len(req.blocks) for req, _ in work) + 1  # trailing null entries
        table = torch.zeros(len(work), width, dtype=torch.int32)
        slots = []
        for i, (req, n) in enumerate(work):
            table[i, : len(req.blocks)] = torch.tensor(req.blocks)
            slots += [req.blocks[p // bs] * bs + p % bs for p in range(req.done, req.done + n)]
        seq_lens = [req.done + n for req, n in work]
        dev = self.shape.device
        return CommonAttentionMetadata(
            query_start_loc_cpu=starts, num_computed_tokens_cpu=[req.done for req, _ in work],
            seq_lens_cpu=seq_lens, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), block_table=table.to(dev),
            slot_mapping=torch.tensor(slots + [0] * pad, dtype=torch.int64, device=dev), block_size=bs,
        )

    def _check_gathers(self, metadata: TorchAttentionMetadata, work: list[tuple[Req, int]]) -> None:
        """Each request reads exactly the blocks (prefill) or slots (decode) of the positions
        its queries can see, whatever the block kernels would do with masked reads."""
        bs, window = self.shape.block_size, self.shape.window
        first = [0 if window is None else max(0, req.done - window + 1) for req, _ in work]
        decodes = [(req, f) for (req, n), f in zip(work, first) if n == 1]
        prefills = [(req, n, f) for (req, n), f in zip(work, first) if n > 1]
        for p, (req, n, f) in zip(metadata.prefills, prefills, strict=True):
            assert p.block_ids.tolist() == req.blocks[f // bs : (req.done + n - 1) // bs + 1]
        if not decodes:
            assert metadata.decodes is None
            return
        d = metadata.decodes
        blocks = d.blocks.view(-1, d.blocks_per_req)
        slots = (blocks[:, :, None] * bs + torch.arange(bs, device=blocks.device)).flatten(1)
        seen = ~d.hidden
        for row_blocks, row_slots, row_seen, (req, f) in zip(blocks.tolist(), slots.tolist(), seen.tolist(), decodes,
                                                             strict=True):
            assert set(row_blocks) <= set(req.blocks[f // bs : req.done // bs + 1])  # whole blocks, none outside
            visible = {req.blocks[q // bs] * bs + q % bs for q in range(f, req.done + 1)}
            assert {slot for slot, ok in zip(row_slots, row_seen) if ok} == visible

    def _batch(self, new: list[tuple[Req, int, int]], layer: int, name: str, pad: int) -> torch.Tensor:
        rows = torch.cat([getattr(req, name)[layer, start:end] for req, start, end in new])
        return torch.cat([rows, torch.randn(pad, *rows.shape[1:]).to(rows.dtype)]).to(self.shape.device)

    def _check_output(self, out: torch.Tensor, new: list[tuple[Req, int, int]], layer: int, pad: int) -> None:
        expected = torch.cat([reference(req, layer, start, end, self.shape.window) for req, start, end in new])
        assert out.dtype == self.shape.dtype
        out = out.cpu()
        tol = TOL[self.shape.dtype]
        torch.testing.assert_close(out[: len(expected)].double(), expected, atol=tol, rtol=tol)
        assert torch.equal(out[len(expected):], torch.zeros(pad, *out.shape[1:], dtype=out.dtype))

    def _check_cache(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, old: torch.Tensor,
                     new: list[tuple[Req, int, int]], layer: int, snapshot: list[torch.Tensor]) -> None:
        """The mapped slots hold the new K/V; with their old values put back, every byte
        of every buffer is as before."""
        written = torch.stack([self._batch(new, layer, name, pad=0) for name in "kv"], dim=1)
        assert torch.equal(cache[blocks, :, offsets], written)
        cache[blocks, :, offsets] = old
        for now, before in zip(self.buffers, snapshot):
            assert torch.equal(now, before), "forward changed bytes outside the mapped slots"
        cache[blocks, :, offsets] = written


def reference(req: Req, layer: int, start: int, end: int, window: int | None) -> torch.Tensor:
    """Dense float64 attention of positions [start, end) over positions [0, end)."""
    group = req.q.shape[2] // req.k.shape[2]
    q = req.q[layer, start:end].double()
    k = req.k[layer, :end].double().repeat_interleave(group, dim=1)
    v = req.v[layer, :end].double().repeat_interleave(group, dim=1)
    q_pos, k_pos = torch.arange(start, end)[:, None], torch.arange(end)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def harness(shape: Shape, num_blocks: int = 64, layout: str = "plain", **kw) -> Harness:
    if layout == "plain":
        caches, buffers = plain_caches(shape, num_blocks)
    else:
        caches, buffers = allocated_caches(shape, num_blocks, layout)
    return Harness(shape, caches, buffers, **kw)


# --- hand-picked scenarios ---------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def test_registry_resolves_torch() -> None:
    assert get_attention_backend("torch") is TorchAttentionBackend
    assert TorchAttentionBackend.name == "torch"


@pytest.mark.parametrize("dtype", DTYPES)
def test_pure_prefill_of_several_lengths(dtype: torch.dtype) -> None:
    h = harness(Shape(dtype=dtype))
    h.step([(h.request(n), n) for n in (1, 5, 8, 13)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_reads_earlier_chunks_from_cache(dtype: torch.dtype) -> None:
    h = harness(Shape(dtype=dtype))
    a, b = h.request(23), h.request(10)
    h.step([(a, 6), (b, 3)])
    h.step([(b, 5), (a, 9)])
    h.step([(a, 8), (b, 2)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_batches(dtype: torch.dtype) -> None:
    h = harness(Shape(dtype=dtype))
    reqs = [h.request(n) for n in (7, 12, 4)]
    h.step([(r, r.length - 3) for r in reqs])
    for _ in range(3):
        meta = h.step([(r, 1) for r in reversed(reqs)])
        assert meta.prefills == [] and meta.decodes is not None


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_of_prefills_and_decodes(device: str) -> None:
    h = harness(Shape(device=device))
    a, b, c = h.request(14), h.request(20), h.request(10)
    h.step([(a, 11), (b, 4)])
    meta = h.step([(b, 6), (a, 1), (c, 9)])
    assert len(meta.prefills) == 2 and meta.decodes is not None
    h.step([(c, 1), (b, 10), (a, 1)])


@pytest.mark.parametrize("window", [3, 5, 8, 11, 40])
@pytest.mark.parametrize("stale_ids", [False, True])
def test_sliding_window_never_reads_outside_it(window: int, stale_ids: bool) -> None:
    """Windows smaller than, equal to and larger than the sequence, multiples of the block
    size or not; out-of-window blocks are NaN, and null (0) or stale in the table."""
    h = harness(Shape(window=window), stale_ids=stale_ids)
    a, b, c = h.request(25), h.request(11), h.request(12)
    h.step([(a, 7), (b, 11)])
    h.step([(a, 6), (c, 8)])
    for _ in range(4):
        h.step([(c, 1), (a, 1)])
    h.step([(a, a.length - a.done)])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(1, 1), (4, 4), (6, 2), (8, 1)])
def test_grouped_query_attention(num_heads: int, num_kv_heads: int) -> None:
    h = harness(Shape(num_heads=num_heads, num_kv_heads=num_kv_heads, window=6))
    a, b = h.request(14), h.request(9)
    h.step([(a, 10), (b, 4)])
    h.step([(b, 5), (a, 1)])
    h.step([(a, 1)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["canonical", "per-layer"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allocated_layouts_share_metadata_across_layers(layout: str, dtype: torch.dtype, device: str) -> None:
    """Strided views of a shared buffer: writes land in their bytes only, and one
    metadata object serves two layers."""
    h = harness(Shape(dtype=dtype, num_layers=2, window=7, device=device), num_blocks=24, layout=layout)
    a, b = h.request(18), h.request(6)
    h.step([(a, 9), (b, 6)])
    h.step([(a, 8)])
    h.step([(a, 1)])


def test_padding_rows_are_not_written_and_return_zeros() -> None:
    h = harness(Shape(window=5))
    a, b = h.request(10), h.request(3)
    h.step([(a, 7)], pad=2)
    h.step([(a, 1), (b, 3)], pad=3)


def test_window_mismatch_between_builder_and_layer_is_refused() -> None:
    h = harness(Shape(window=4))
    req = h.request(3)
    h._prepare(req, 3)
    metadata = h.builder.build(h._common([(req, 3)], pad=0))
    layer = TorchAttentionImpl(4, 2, 8, SCALE, sliding_window=None)
    q, kv = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="sliding window"):
        layer.forward(q, kv, kv, h.caches[0], metadata)


def test_decode_gather_reads_only_window_positions() -> None:
    """The decode gather reads whole blocks from each query's first visible one, and
    marks exactly its visible positions."""
    h = harness(Shape(block_size=4, window=6))
    a, b = h.request(30), h.request(3)
    h.step([(a, 29), (b, 2)])
    meta = h.step([(a, 1), (b, 1)])
    assert meta.decodes is not None
    assert (~meta.decodes.hidden).sum(-1).tolist() == [6, 3]
    assert meta.decodes.blocks_per_req == 2  # a sees positions 24..29: blocks 6 and 7
    assert meta.decodes.blocks.view(2, 2).tolist() == [a.blocks[6:8], [b.blocks[0]] * 2]


# --- randomized scenarios --------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_random_schedules_match_dense_attention(data: st.DataObject) -> None:
    """Head sizes 32 and 96 in bfloat16 take the native kernel's AVX512-BF16 path where the
    CPU has it (two keys' values interleaved per 32 values: 96 ends on a lone 32)."""
    kv_heads = data.draw(st.sampled_from([1, 2]))
    shape = Shape(
        block_size=data.draw(st.sampled_from([1, 2, 3, 4, 8])),
        num_kv_heads=kv_heads,
        num_heads=kv_heads * data.draw(st.sampled_from([1, 2, 3, 5])),
        head_size=data.draw(st.sampled_from([4, 8, 32, 96])),
        window=data.draw(st.none() | st.integers(1, 20)),
        dtype=data.draw(st.sampled_from(DTYPES)),
    )
    h = harness(shape, num_blocks=128, stale_ids=data.draw(st.booleans()), seed=data.draw(st.integers(0, 99)))
    reqs = [h.request(data.draw(st.integers(1, 30))) for _ in range(data.draw(st.integers(1, 4)))]
    while any(r.done < r.length for r in reqs):
        live = [r for r in reqs if r.done < r.length]
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, unique_by=id))
        h.step([(r, data.draw(st.integers(1, r.length - r.done))) for r in chosen])


# --- steady decode: no allocator churn -----------------------------------------------


def minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_steady_decode_steps_take_no_page_faults() -> None:
    """8 requests x 8,192 keys, 2 KV heads x 128, bfloat16: on the gathered path, 32 MiB
    of gathered keys and 64 MiB widened to float32 per layer, past the largest size glibc
    serves from its heap (32 MiB, set by the engine at start). A per-step temporary of
    that size would be mmapped and faulted in page by page on every call (16,384 faults
    per 64 MiB); from the builder's workspace, a steady step faults (next to) nothing.
    The native kernel reads the cache in place: no large buffer at all."""
    from pd.worker.memory import keep_freed_memory

    keep_freed_memory()
    bs, n, context, kvh, size = 16, 8, 8192, 2, 128
    per_req = context // bs
    cache = torch.randn(1 + n * per_req, 2, bs, kvh, size).to(torch.bfloat16)
    rows = [list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i in range(n)]
    common = CommonAttentionMetadata.from_requests(rows, [context - 1] * n, [1] * n, bs)
    metadata = TorchAttentionBackend.builder_cls()(None, torch.device("cpu")).build(common)
    impl = TorchAttentionImpl(4, kvh, size, SCALE, None)
    q, k, v = torch.randn(n, 4, size).to(torch.bfloat16), *torch.randn(2, n, kvh, size).to(torch.bfloat16)
    first = impl.forward(q, k, v, cache, metadata)
    impl.forward(q, k, v, cache, metadata)
    before = minor_faults()
    for _ in range(4):
        assert torch.equal(impl.forward(q, k, v, cache, metadata), first)
    assert (minor_faults() - before) / 4 < 256


def test_native_kernel_is_optional(monkeypatch, tmp_path) -> None:
    """No compiler (or PD_NATIVE_KERNELS=0): nothing is built and decodes take the torch
    path; the kernel makes decodes faster, never possible."""
    monkeypatch.setenv("PD_KERNEL_CACHE", str(tmp_path))
    cpu_kernels._library.cache_clear()
    try:
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        assert cpu_kernels._library() is None
        cpu_kernels._library.cache_clear()
        monkeypatch.setenv("CC", "cc")
        monkeypatch.setenv("PD_NATIVE_KERNELS", "0")
        assert cpu_kernels._library() is None
        assert not cpu_kernels.supports(torch.zeros(2, 2, 4, 1, 8, dtype=torch.bfloat16))
        cpu_kernels._library.cache_clear()
        monkeypatch.delenv("PD_NATIVE_KERNELS")
        assert cpu_kernels._library() is not None and list(tmp_path.glob("paged_attention-*.so"))  # built here
    finally:
        cpu_kernels._library.cache_clear()

