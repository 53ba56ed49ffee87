"""The native attention kernel's own guards (its results are held against the reference
in test_torch_backend.py)."""

import pytest
import torch

from pd.attention import cpu_kernels
from tests.support.attention_builders import ChunkAndTwoDecodes, require_native_kernel, rows_to_write, torch_threads


@pytest.mark.parametrize("bad", ["too_many_tokens", "past_batch", "table_row", "past_table", "span", "negative"])
def test_native_kernel_refuses_tiles_out_of_bounds(bad) -> None:
    """The kernel follows raw pointers: a tile past the batch, the block table or the
    span its scratch was sized for is refused (ValueError) before anything is read."""
    require_native_kernel()
    bs, kvh, size, heads = 4, 1, 8, 2
    cache = torch.randn(9, 2, bs, kvh, size)
    table = torch.arange(1, 9, dtype=torch.int32).view(2, 4)  # 2 requests x 16 positions
    q = torch.randn(6, heads, size)
    good = [0, 3, 0, 5]  # tokens 0-2 at positions 5-7 of request 0
    tile = {"too_many_tokens": [0, 5, 0, 0], "past_batch": [4, 3, 0, 0], "table_row": [0, 3, 2, 0],
            "past_table": [0, 3, 1, 14], "span": [0, 3, 0, 9], "negative": [0, 3, 0, -1]}[bad]
    span, max_tile = 10, 4
    scratch = torch.empty(cpu_kernels.scratch_size(heads * max_tile, size, 16))
    out = torch.empty_like(q)
    ok = torch.tensor([good], dtype=torch.int64)
    cpu_kernels.paged_attention(q, cache, table, ok, max_tile, None, 0.5, out, scratch, span)
    with pytest.raises(ValueError, match="refused"):
        cpu_kernels.paged_attention(q, cache, table, torch.tensor([good, tile], dtype=torch.int64), max_tile, None,
                                    0.5, out, scratch, span)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 5])
def test_an_fp8_cache_is_read_as_the_values_it_holds(query_dtype, window) -> None:
    """`--kv-cache-dtype fp8_e4m3`: the kernel over an 8-bit cache gives, bitwise, what it
    gives over a cache of the query's dtype holding the same values (every e4m3 value is
    exact in bfloat16), subnormals and the largest magnitudes included."""
    require_native_kernel()
    bs, kvh, size, heads = 4, 2, 24, 4
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(9, 2, bs, kvh, size, generator=gen) * torch.logspace(-3, 2.4, size)  # 0.001 .. ~250
    values[0, 0, 0, 0, :4] = torch.tensor([448.0, -448.0, 2.0 ** -9, -(2.0 ** -7)])  # extremes, subnormals
    fp8 = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    wide = fp8.to(query_dtype)
    batch = ChunkAndTwoDecodes(heads, kvh, size)
    q = torch.randn(batch.num_tokens, heads, size, generator=gen).to(query_dtype)
    outs = [batch.attend(q, cache, window) for cache in (wide, fp8)]
    assert torch.equal(outs[0], outs[1])
    assert outs[1].isfinite().all()


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_an_int8_cache_is_read_as_its_values_times_their_row_scales(query_dtype) -> None:
    """`--kv-cache-dtype int8`: each row is head_size int8 values and a float32 scale; the
    kernel gives, bitwise, what it gives over a float32 cache of value x scale."""
    from pd.attention.torch_backend import quantize_rows, widen_rows

    require_native_kernel()
    bs, kvh, size, heads = 4, 2, 24, 4
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(9, 2, bs, kvh, size, generator=gen) * torch.logspace(-2, 2, size)
    values[1, 0, 0, 0] = 0  # an all-zero row: scale 1
    rows = quantize_rows(values)
    assert rows.shape[-1] == size + 4 and rows.dtype == torch.int8
    wide = widen_rows(rows, torch.float32)
    assert (wide - values).abs().max() <= values.abs().amax() / 254 * 1.001  # half a level of the largest row
    batch = ChunkAndTwoDecodes(heads, kvh, size)
    q = torch.randn(batch.num_tokens, heads, size, generator=gen)
    outs = [batch.attend(query, cache).float() for cache, query in ((wide, q), (rows, q.to(query_dtype)))]
    if query_dtype == torch.float32:
        assert torch.equal(outs[0], outs[1])
    else:  # the queries rounded to bfloat16, the output too
        torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2 * outs[0].abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_native_int8_writer_writes_the_bytes_the_torch_path_writes(dtype) -> None:
    """Rows of K (contiguous, as RoPE returns it) and V (a slice of the fused qkv), a zero
    row among them, written where their blocks and offsets say and nowhere else."""
    from pd.attention.torch_backend import quantize_rows

    bs, kvh, size = 4, 2, 24
    rows = rows_to_write(kvh, size, dtype, torch.Generator().manual_seed(11), scale=5)
    rows.value[2, 1] = 0
    native = torch.full((9, 2, bs, kvh, size + 4), 99, dtype=torch.int8)
    expected = native.clone()
    assert cpu_kernels.write_kv(rows.key, rows.value, native, rows.blocks, rows.offsets)
    expected[rows.blocks, 0, rows.offsets] = quantize_rows(rows.key)
    expected[rows.blocks, 1, rows.offsets] = quantize_rows(rows.value)
    assert torch.equal(native, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("size", [40, 64])
def test_a_lone_decode_split_among_threads_gives_the_one_thread_result(dtype, threads, window, size) -> None:
    """With fewer (tile, KV head) pairs than threads, a decode's keys are split among the
    threads: the same output as one thread's, float32 summation order apart, for spans
    that do and do not divide into the threads' shares (and a two-key one); size 64 in
    bfloat16 on the AVX512-BF16 path where the CPU has it."""
    require_native_kernel()
    bs, kvh, heads, blocks = 16, 1, 4, 12
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(blocks + 1, 2, bs, kvh, size, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen).add(1).to(torch.int32).view(1, blocks)
    q = torch.randn(1, heads, size, generator=gen).to(dtype)
    scratch = torch.empty(cpu_kernels.scratch_size(heads, size, bs * blocks) * threads)
    for position in (1, 150, 190):
        tiles = torch.tensor([[0, 1, 0, position]], dtype=torch.int64)
        outs = []
        for n in (1, threads):
            out = torch.full_like(q, float("nan"))
            with torch_threads(n):
                cpu_kernels.paged_attention(q, cache, table, tiles, 1, window, 0.3, out, scratch, bs * blocks)
            outs.append(out.float())
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
        if dtype == torch.float32 and position == 1:
            assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_native_writer_copies_rows_into_a_strided_cache_of_their_dtype(dtype) -> None:
    """A cache in the model's dtype (a view with a block stride wider than its rows, as the
    cross-layer allocation gives): the rows land where indexing puts them, nothing else
    changes; another dtype (fp8) is left to the torch path."""
    bs, kvh, size = 4, 2, 24
    gen = torch.Generator().manual_seed(13)
    rows = rows_to_write(kvh, size, dtype, gen)
    backing = torch.randn(9, 3, 2, bs, kvh, size, generator=gen).to(dtype)  # 3 layers a block
    native = backing[:, 1]
    expected = backing.clone()
    expected[rows.blocks, 1, 0, rows.offsets] = rows.key
    expected[rows.blocks, 1, 1, rows.offsets] = rows.value
    assert cpu_kernels.write_kv(rows.key, rows.value, native, rows.blocks, rows.offsets)
    assert torch.equal(backing, expected)
    fp8 = torch.zeros(9, 2, bs, kvh, size, dtype=torch.float8_e4m3fn)
    assert not cpu_kernels.write_kv(rows.key, rows.value, fp8, rows.blocks, rows.offsets)
    assert not fp8.view(torch.uint8).any()
