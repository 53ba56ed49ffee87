"""Mamba2Mixer over paged state blocks against transformers' BambaMixer on one random checkpoint.

The reference runs a whole sequence at once (no cache); boundary states come from its
cache path over a prefix. Ours runs the same tokens split into steps the way a
scheduler would, with block ids scattered over the pool, in both cache layouts.
"""

from __future__ import annotations

import math
import random
from itertools import accumulate
from typing import TYPE_CHECKING

import pytest
import torch

from pd.attention.backend import CommonAttentionMetadata
from pd.attention.mamba_metadata import build_mamba_metadata
from pd.forward_context import ForwardContext, set_forward_context
from pd.kv_cache.allocation import MambaCache, allocate_kv_caches
from pd.kv_cache.spec import KVCacheConfig, KVCacheGroup
from pd.models.mamba2 import Mamba2Mixer, chunk_ends

if TYPE_CHECKING:  # imported where used: transformers' Bamba costs 1.6 s at every worker's collection
    from transformers import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaMixer

NAME, NEIGHBOUR = "layers.0.mixer", "layers.1.mixer"
BS = 16  # block size
HIDDEN, HEADS, HEAD_DIM, D_STATE, GROUPS, D_CONV, CHUNK = 32, 4, 16, 8, 2, 4, 8
LAYOUTS = ["canonical", "per-layer"]
TOL = 1e-4
observed: dict[str, float] = {}  # largest diffs seen, printed with -s


def _record(kind: str, diff: float) -> float:
    observed[kind] = max(observed.get(kind, 0.0), diff)
    return diff


def _config() -> BambaConfig:
    """One Mamba layer; transformers' chunk size differs from ours so the chunkings differ."""
    from transformers import BambaConfig

    return BambaConfig(hidden_size=HIDDEN, num_hidden_layers=1, attn_layer_indices=[], mamba_n_heads=HEADS,
                       mamba_d_head=HEAD_DIM, mamba_n_groups=GROUPS, mamba_d_state=D_STATE, mamba_d_conv=D_CONV,
                       mamba_chunk_size=32, mamba_expand=HEADS * HEAD_DIM // HIDDEN, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, vocab_size=64)


def _reference(seed: int = 0) -> BambaMixer:
    from transformers.models.bamba.modeling_bamba import BambaMixer

    ref = BambaMixer(_config(), 0).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # Mamba2's init ranges, plus noise where it initialises constants
        for p in (ref.in_proj.weight, ref.conv1d.weight, ref.conv1d.bias, ref.out_proj.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        dt = torch.exp(torch.empty(HEADS).uniform_(math.log(1e-3), math.log(0.3), generator=g))
        ref.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
        ref.A_log.copy_(torch.log(torch.empty(HEADS).uniform_(1, 16, generator=g)))
        ref.D.copy_(torch.randn(HEADS, generator=g))
        ref.norm.weight.copy_(1 + 0.2 * torch.randn(HEADS * HEAD_DIM, generator=g))
    return ref


def _dynamic_cache():
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=_config())


def _ours(ref: BambaMixer) -> Mamba2Mixer:
    mixer = Mamba2Mixer(NAME, HIDDEN, HEADS, HEAD_DIM, D_STATE, GROUPS, D_CONV, CHUNK, conv_bias=True,
                        proj_bias=False, rms_norm_eps=ref.norm.variance_epsilon)
    mixer.load_state_dict(ref.state_dict())  # strict: the parameter names are transformers'
    return mixer.eval()


@pytest.fixture(scope="module")
def ref() -> BambaMixer:
    return _reference()


@pytest.fixture(scope="module")
def ours(ref: BambaMixer) -> Mamba2Mixer:
    return _ours(ref)


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def ref_out(ref: BambaMixer, tokens: torch.Tensor) -> torch.Tensor:
    return ref(tokens[None])[0]


@torch.no_grad()
def ref_state(ref: BambaMixer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (conv, ssm) state after `tokens`, conv cut to our last d_conv - 1 inputs."""
    cache = _dynamic_cache()
    ref(tokens[None], cache=cache)
    return cache.get_conv_state(0)[0, :, 1:], cache.get_recurrent_state(0)[0]


def _common(rows: list[list[int]], computed: list[int], lens: list[int]) -> CommonAttentionMetadata:
    return CommonAttentionMetadata.from_requests(rows, computed, lens, BS)


class Pool:
    """A Mamba KV cache shared with a neighbour layer, block ids handed out shuffled."""

    def __init__(self, mixer: Mamba2Mixer, layout: str, conv_dtype: str = "float32",
                 ssm_dtype: str = "float32", num_blocks: int = 48) -> None:
        self.mixer = mixer
        spec = mixer.kv_cache_spec(BS, conv_dtype, ssm_dtype)
        config = KVCacheConfig(num_blocks=num_blocks, groups=(KVCacheGroup(spec, (NAME, NEIGHBOUR)),))
        self.alloc = allocate_kv_caches(config, layout=layout)
        self.free = list(range(1, num_blocks))
        random.Random(num_blocks).shuffle(self.free)

    @property
    def cache(self) -> MambaCache:
        return self.alloc.layer_caches[NAME]

    def state(self, block: int, layer: str = NAME) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's (conv, SSM) state in the model's shapes, float32."""
        conv, ssm = self.alloc.layer_caches[layer].read(torch.tensor([block]))
        return conv[0], ssm[0]

    def blocks(self, num_tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-num_tokens // BS))]

    @torch.no_grad()
    def step(self, batch: list[tuple[list[int], int, torch.Tensor]]) -> list[torch.Tensor]:
        """Run one forward over `(block row, num computed tokens, new token inputs)` per request."""
        lens = [len(tokens) for _, _, tokens in batch]
        starts = [0, *accumulate(lens)]
        common = _common([row for row, _, _ in batch], [c for _, c, _ in batch], lens)
        meta = build_mamba_metadata(common, "cpu")
        context = ForwardContext(attn_metadata={NAME: meta}, kv_caches=self.alloc.layer_caches)
        with set_forward_context(context):
            out = self.mixer(torch.cat([tokens for _, _, tokens in batch]).to(self._dtype))
        return [out[s:e] for s, e in zip(starts, starts[1:])]

    @property
    def _dtype(self) -> torch.dtype:
        return self.mixer.in_proj.weight.dtype

    def run(self, tokens: torch.Tensor, splits: list[int], row: list[int] | None = None,
            computed: int = 0) -> torch.Tensor:
        """Feed `tokens` (new tokens after `computed` cached ones) in steps of `splits` tokens."""
        row = row if row is not None else self.blocks(computed + len(tokens))
        outs, done = [], 0
        for n in splits:
            outs += self.step([(row, computed + done, tokens[done:done + n])])
            done += n
        assert done == len(tokens)
        return torch.cat(outs)


def assert_close(kind: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    diff = _record(kind, (got.float() - want.float()).abs().max().item())
    assert diff <= tol, f"{kind}: max abs diff {diff:.3g} > {tol}"


def assert_boundary_states(pool: Pool, ref: BambaMixer, tokens: torch.Tensor, row: list[int],
                           upto: int) -> None:
    """Block j holds the state after (j+1)*BS tokens for every boundary in (0, upto]; the
    running block holds the state after `upto` tokens."""
    ends = [(j + 1) * BS for j in range(upto // BS)]
    if upto % BS:
        ends.append(upto)
    for end in ends:
        conv, ssm = ref_state(ref, tokens[:end])
        block = row[(end - 1) // BS]
        got_conv, got_ssm = pool.state(block)
        assert_close("conv state", got_conv, conv)
        assert_close("ssm state", got_ssm, ssm)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("length", [2, 5, 8, 16, 23, 32, 67])
def test_one_shot_prefill_matches_transformers(ours, ref, layout, length):
    pool = Pool(ours, layout)
    tokens = _tokens(length, seed=length)
    row = pool.blocks(length)
    out = pool.run(tokens, [length], row)
    assert_close("output", out, ref_out(ref, tokens))
    assert_boundary_states(pool, ref, tokens, row, length)
    neighbour = pool.alloc.layer_caches[NEIGHBOUR]
    assert not any(v.any() for v in (neighbour.conv_x, neighbour.conv_bc, neighbour.ssm)), \
        "wrote into the neighbour layer's pages"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("splits", [[7, 13, 1, 20, 9], [16, 16, 18], [3, 1, 1, 40, 5], [50]])
def test_chunked_prefill_then_decode_matches_one_shot(ours, ref, layout, splits):
    pool = Pool(ours, layout)
    tokens = _tokens(56, seed=1)
    row = pool.blocks(56)
    out = pool.run(tokens, splits + [1] * 6, row)
    assert_close("output", out, ref_out(ref, tokens))
    assert_boundary_states(pool, ref, tokens, row, 56)


def test_decode_matches_transformers_cache_path(ours, ref):
    pool = Pool(ours, "canonical")
    tokens = _tokens(24, seed=2)
    ours_out = pool.run(tokens, [19] + [1] * 5)
    cache = _dynamic_cache()
    with torch.no_grad():
        ref_outs = [ref(tokens[None, :19], cache=cache)[0]]
        ref_outs += [ref(tokens[None, t:t + 1], cache=cache)[0] for t in range(19, 24)]
    assert_close("output", ours_out, torch.cat(ref_outs))


@pytest.mark.parametrize("hit", [BS, 2 * BS])
def test_prefix_hit_reads_the_boundary_block_and_leaves_it(ours, ref, hit):
    pool = Pool(ours, "per-layer")
    first = _tokens(41, seed=3)
    first_row = pool.blocks(41)
    pool.run(first, [41], first_row)
    kept = [pool.state(b) for b in first_row[:hit // BS]]
    second = torch.cat([first[:hit], _tokens(30, seed=4)])
    row = first_row[:hit // BS] + pool.blocks(len(second) - hit)
    out = pool.run(second[hit:], [11, 19], row, computed=hit)
    assert_close("output", out, ref_out(ref, second)[hit:])
    assert_boundary_states(pool, ref, second, row, len(second))
    for block, (conv, ssm) in zip(first_row, kept):
        got_conv, got_ssm = pool.state(block)
        assert torch.equal(got_conv, conv) and torch.equal(got_ssm, ssm)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_batch_of_prefills_and_decodes(ours, ref, layout):
    pool = Pool(ours, layout)
    seqs = [_tokens(n, seed=10 + n) for n in (40, 33, 21, 17)]
    rows = [pool.blocks(len(s)) for s in seqs]
    # warm up: request 0 and 1 decode next, request 2 continues a prefill, request 3 starts fresh
    done = [39, 32, 9, 0]
    for seq, row, n in zip(seqs[:3], rows, done):
        pool.run(seq[:n], [n], row)
    batch = [(rows[0], 39, seqs[0][39:40]), (rows[2], 9, seqs[2][9:21]),
             (rows[1], 32, seqs[1][32:33]), (rows[3], 0, seqs[3])]
    outs = pool.step(batch)
    for out, seq, n in zip(outs, [seqs[0], seqs[2], seqs[1], seqs[3]], [39, 9, 32, 0]):
        assert_close("output", out, ref_out(ref, seq)[n:])
    for seq, row in zip(seqs, rows):
        assert_boundary_states(pool, ref, seq, row, len(seq))


def test_granitemoehybrid_mamba_layer_is_the_same_mixer(ours, ref):
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    config = GraniteMoeHybridConfig(hidden_size=HIDDEN, num_hidden_layers=1, mamba_n_heads=HEADS,
                                    mamba_d_head=HEAD_DIM, mamba_n_groups=GROUPS, mamba_d_state=D_STATE,
                                    mamba_d_conv=D_CONV, mamba_chunk_size=32, mamba_expand=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                    rms_norm_eps=ref.norm.variance_epsilon)
    granite = GraniteMoeHybridMambaLayer(config, 0).eval()
    granite.load_state_dict(ref.state_dict())
    tokens = _tokens(37, seed=8)
    out = Pool(ours, "canonical").run(tokens, [21, 14, 1, 1])
    with torch.no_grad():
        assert_close("output", out, granite(tokens[None])[0])


def test_bfloat16_runs_finite_and_close(ref):
    mixer = _ours(ref).to(torch.bfloat16)
    pool = Pool(mixer, "canonical", conv_dtype="bfloat16", ssm_dtype="bfloat16")
    tokens = _tokens(45, seed=5)
    out = pool.run(tokens.bfloat16(), [20, 17] + [1] * 8)
    want = ref_out(ref, tokens)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    scale = want.abs().max().item()
    assert_close("bfloat16 output (relative)", out / scale, want / scale, tol=0.05)


def test_padding_rows_past_the_batch_come_out_zero(ours, ref):
    pool = Pool(ours, "canonical")
    tokens = _tokens(7, seed=6)
    common = _common([pool.blocks(7)], [0], [7])
    context = ForwardContext(attn_metadata={NAME: build_mamba_metadata(common, "cpu")},
                             kv_caches=pool.alloc.layer_caches)
    with set_forward_context(context), torch.no_grad():
        out = ours(torch.cat([tokens, _tokens(3, seed=7)]))  # 3 padding rows, as a CUDA graph pads
    assert_close("output", out[:7], ref_out(ref, tokens))
    assert torch.equal(out[7:], torch.zeros(3, HIDDEN))


@pytest.mark.parametrize("n,points,chunk", [(20, [20], 8), (40, [5, 21, 37, 40], 8), (3, [3], 256),
                                            (33, [16, 32, 33], 16), (9, [1, 9], 4)])
def test_chunk_ends_cut_at_every_point_and_chunk_size(n, points, chunk):
    ends = chunk_ends(n, points, chunk)
    assert ends == sorted(set(ends)) and ends[-1] == n
    assert set(points) <= set(ends)
    assert all(b - a <= chunk for a, b in zip([0, *ends], ends))
    # no cut beyond the needed ones: each segment between points has the fewest chunks
    segments = sorted({0, *points, n})
    assert len(ends) == sum(-(-(b - a) // chunk) for a, b in zip(segments, segments[1:]))


def teardown_module() -> None:
    print("\nmax abs diffs vs transformers:", {k: f"{v:.2e}" for k, v in observed.items()})
