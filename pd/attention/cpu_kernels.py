"""The native paged attention kernel (`pd/csrc/paged_attention.c`), built by `pd.native`."""

from __future__ import annotations

import ctypes
import functools

import torch

from pd import native

SOURCE = native.SOURCES / "paged_attention.c"
# (query dtype, cache dtype) -> kernel
_SYMBOLS = {(torch.bfloat16, torch.bfloat16): "paged_attention_bf16",
            (torch.float32, torch.float32): "paged_attention_f32",
            (torch.bfloat16, torch.float8_e4m3fn): "paged_attention_bf16_fp8",
            (torch.float32, torch.float8_e4m3fn): "paged_attention_f32_fp8",
            (torch.bfloat16, torch.int8): "paged_attention_bf16_i8",
            (torch.float32, torch.int8): "paged_attention_f32_i8"}
CACHE_DTYPES = {cache for _, cache in _SYMBOLS}
_WRITERS = {torch.bfloat16: "write_kv_i8_bf16", torch.float32: "write_kv_i8_f32"}  # int8 rows, from the model dtype
_I64, _PTR, _F32 = native.I64, native.PTR, native.F32
_ARGTYPES = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64,
             _I64, _I64, _I64, _F32, _PTR, _I64, _I64]


@functools.cache
def _library() -> ctypes.CDLL | None:
    signatures = {symbol: _ARGTYPES for symbol in _SYMBOLS.values()}
    signatures |= {symbol: [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64]
                   for symbol in (*_WRITERS.values(), "write_kv_rows")}
    return native.load(SOURCE, signatures)


def build() -> bool:
    """Build the kernels now (or find them built); whether they are available."""
    return _library() is not None


def supports(cache: torch.Tensor) -> bool:
    """Whether `paged_attention` can read this layer's cache view: on CPU, bfloat16,
    float32, float8_e4m3fn or int8 (rows ending in their scale), head dim contiguous, and
    the kernel built."""
    return cache.device.type == "cpu" and cache.dtype in CACHE_DTYPES and cache.stride(-1) == 1 \
        and _library() is not None


def scratch_size(vectors: int, head_size: int, max_span: int) -> int:
    """float32 elements of scratch for tiles of up to `vectors` query vectors (tokens x
    query heads per KV head): one share per thread the kernel runs on (torch's intra-op
    thread count, passed to it)."""
    padded = -(-head_size // 16) * 16  # the kernel's vectors have 16-lane multiples
    return (vectors * (max_span + 2 * padded) + 4 * padded) * torch.get_num_threads()


def paged_attention(query: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, tiles: torch.Tensor,
                    max_tile: int, window: int | None, scale: float, out: torch.Tensor, scratch: torch.Tensor,
                    max_span: int) -> torch.Tensor:
    """Attention of every tile's query tokens over their visible cached keys (see the C
    source for the tile layout).

    query, out (n, H, D) contiguous, bfloat16 or float32 (the cache's dtype, or any of the
    two over a float8_e4m3fn or int8 cache); cache one layer's (blocks, 2, block_size, KVH,
    D) view (D + 4 for int8: each row's float32 scale after it);
    table int32 (requests, columns) contiguous; tiles int64 (tiles, 4)
    contiguous, each at most `max_tile` tokens and `max_span` keys; scratch float32 of
    `scratch_size(group * max_tile, ...)` elements. A tile outside these bounds is a
    ValueError, raised before anything is read."""
    n, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = cache.shape
    threads = torch.get_num_threads()
    assert scratch.numel() >= scratch_size((num_heads // num_kv_heads) * max_tile, head_size, max_span)
    assert query.is_contiguous() and out.is_contiguous() and out.shape == query.shape
    assert query.dtype == out.dtype and (query.dtype, cache.dtype) in _SYMBOLS
    assert table.is_contiguous() and table.dtype == torch.int32
    assert tiles.is_contiguous() and tiles.dtype == torch.int64 and tiles.shape[1:] == (4,)
    status = getattr(_library(), _SYMBOLS[query.dtype, cache.dtype])(
        query.data_ptr(), out.data_ptr(), cache.data_ptr(), *cache.stride()[:4], table.data_ptr(), table.shape[1],
        table.shape[0], tiles.data_ptr(), tiles.shape[0], max_tile, n, num_heads, num_kv_heads, head_size, block_size,
        window or 0, scale, scratch.data_ptr(), max_span, threads)
    if status:
        raise ValueError(f"paged_attention refused its arguments ({num_heads} heads over {num_kv_heads}, "
                         f"head size {head_size}, or a tile out of bounds)")
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor,
             offsets: torch.Tensor) -> bool:
    """Write new K/V rows (tokens, KVH, D) into one layer's cache view (blocks, 2,
    block_size, KVH, D) at (blocks[t], offsets[t]) in one call: copied into a cache of
    their dtype, quantized into an int8 one (rows of D + 4: the bytes
    `torch_backend.quantize_rows` would write), without a dozen torch ops per layer.
    False (nothing written) where the kernel cannot take them (another dtype, a device,
    strided heads)."""
    if cache.device.type != "cpu" or value.dtype != key.dtype or _library() is None:
        return False
    tokens, kv_heads, size = key.shape
    if key.stride()[1:] != (size, 1) or value.stride()[1:] != (size, 1) or cache.stride(-1) != 1:
        return False
    blocks, offsets = blocks.contiguous(), offsets.contiguous()
    assert blocks.dtype == offsets.dtype == torch.int64 and blocks.numel() == offsets.numel() == tokens
    if cache.dtype == torch.int8 and key.dtype in _WRITERS:
        status = getattr(_library(), _WRITERS[key.dtype])(
            key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), cache.data_ptr(), *cache.stride()[:4],
            blocks.data_ptr(), offsets.data_ptr(), tokens, kv_heads, size)
    elif cache.dtype == key.dtype and cache.shape[-1] == size:
        width = key.element_size()
        status = _library().write_kv_rows(
            key.data_ptr(), value.data_ptr(), key.stride(0) * width, value.stride(0) * width, cache.data_ptr(),
            *(stride * width for stride in cache.stride()[:4]), blocks.data_ptr(), offsets.data_ptr(), tokens,
            kv_heads, size * width)
    else:
        return False
    return status == 0
