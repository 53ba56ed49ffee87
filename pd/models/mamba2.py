"""The Mamba2 mixer over paged state blocks (shared by Bamba and GraniteMoeHybrid).

Each step the mixer reads every request's state (conv + SSM) from the block its
`MambaMetadata` names, advances it over the request's new tokens and writes the states
the metadata asks for (see `pd/attention/mamba_metadata.py`). Prefills run a chunked SSD
scan (quadratic within a chunk, a recurrence across chunks) whose chunk boundaries
include every write point, so the states to store fall out of the scan; single-token
decodes run one recurrence step, batched. The scan runs in float32; states are stored
in the cache dtypes. Parameter names follow transformers' `BambaMixer`, so checkpoint
weights load as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pd.attention.mamba_metadata import MambaMetadata, MambaRequestSlice
from pd.distributed.collectives import all_reduce
from pd.distributed.shard import TPShard
from pd.forward_context import get_forward_context
from pd.kv_cache.allocation import MambaCache
from pd.kv_cache.spec import MambaSpec
from pd.models.layers import MergedLinear
from pd.models.parallel import RowParallelLinear, tp_reduce


class GatedRMSNorm(nn.Module):
    """`weight * rmsnorm(y * silu(gate))`, the RMS taken over groups of `group_size`
    channels (transformers' `MambaRMSNormGated`: gate first, then normalise).

    Under tensor parallelism a rank holds `hidden_size` of the channels; when that is
    less than a group (more ranks than Mamba groups), the group's sum of squares is
    summed over the ranks sharing it: an all-reduce of a (tokens, groups) tensor in
    which each rank fills its group's column."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, shard: TPShard = TPShard(),
                 group: int = 0, num_groups: int = 1) -> None:
        super().__init__()
        if hidden_size % min(group_size, hidden_size) or (hidden_size < group_size and group_size % hidden_size):
            raise ValueError(f"group size {group_size} and {hidden_size} channels do not tile")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps
        self.shard, self.group, self.num_groups = shard, group, num_groups

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """y, gate (T, hidden) -> (T, hidden) float32."""
        y = y.float() * F.silu(gate.float())
        if y.shape[-1] < self.group_size:  # part of one group: its other channels are on other ranks
            sums = y.new_zeros(y.shape[0], self.num_groups)
            sums[:, self.group] = y.pow(2).sum(-1)
            mean = all_reduce(sums, self.shard)[:, self.group, None] / self.group_size
            return self.weight.float() * (y * torch.rsqrt(mean + self.eps))
        groups = y.unflatten(-1, (-1, self.group_size))
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * groups.flatten(-2)


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer, named `layer_name` in the KV cache config.

    `forward` takes the step's new tokens of all requests, concatenated, and reads its
    `MambaMetadata` and `MambaCache` from the forward context. Rows no request covers
    (padding) come out as the projection of zeros.

    Under tensor parallelism (`shard`) a rank holds a run of the heads (`n_heads`,
    `intermediate_size` and `conv_dim` are then this rank's) and the Mamba groups they
    read (split, or one replicated when there are fewer groups than ranks); in_proj is
    column-parallel by those parts, out_proj row-parallel.
    """

    def __init__(self, layer_name: str, hidden_size: int, n_heads: int, head_dim: int, d_state: int,
                 n_groups: int, d_conv: int, chunk_size: int, conv_bias: bool, proj_bias: bool,
                 rms_norm_eps: float, time_step_limit: tuple[float, float] = (0.0, math.inf),
                 shard: TPShard = TPShard()) -> None:
        super().__init__()
        if n_heads % n_groups:
            raise ValueError(f"{n_groups} groups do not split {n_heads} heads")
        if d_conv < 2 or chunk_size < 1:
            raise ValueError(f"need d_conv >= 2 and chunk_size >= 1, got {d_conv} and {chunk_size}")
        first_head, local_heads = shard.split(n_heads, "Mamba heads")
        first_group, local_groups = shard.replicated_split(n_groups, "Mamba groups")
        self.layer_name, self.shard = layer_name, shard
        self.n_heads, self.head_dim, self.d_state = local_heads, head_dim, d_state
        self.n_groups, self.d_conv, self.chunk_size = local_groups, d_conv, chunk_size
        self.time_step_limit = time_step_limit
        self.intermediate_size = local_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * local_groups * d_state
        inner, bc = n_heads * head_dim, n_groups * d_state
        heads = slice(first_head * head_dim, (first_head + local_heads) * head_dim)
        b = slice(first_group * d_state, (first_group + local_groups) * d_state)
        conv_rows = [heads, _shift(b, inner), _shift(b, inner + bc)]  # x, B, C of the published conv channels
        self.head_range = slice(first_head, first_head + local_heads)
        local_bc = local_groups * d_state
        self.in_proj = MergedLinear(  # [gate | x | B | C | dt], each part this rank's rows
            hidden_size, [self.intermediate_size, self.intermediate_size, local_bc, local_bc, local_heads],
            bias=proj_bias, source_rows=[heads, heads, b, b, self.head_range],
            published_sizes=[inner, inner, bc, bc, n_heads])
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim,
                                bias=conv_bias, padding=d_conv - 1)
        self.conv1d.shard_source = lambda leaf, index, published: torch.cat([published[r] for r in conv_rows])
        self.dt_bias = nn.Parameter(torch.ones(local_heads))
        self.A_log = nn.Parameter(torch.empty(local_heads, dtype=torch.float32))  # read from the checkpoint
        self.D = nn.Parameter(torch.ones(local_heads))
        self.norm = GatedRMSNorm(self.intermediate_size, inner // n_groups, rms_norm_eps, shard,
                                 first_group, n_groups)
        self.norm.shard_source = lambda leaf, index, published: published[heads]
        self.out_proj = RowParallelLinear(inner, hidden_size, shard, bias=proj_bias, unit=head_dim)

    def shard_source(self, leaf: str, index: int | None, published: torch.Tensor) -> torch.Tensor:
        """dt_bias, A_log and D: this rank's heads."""
        return published[self.head_range]

    def kv_cache_spec(self, block_size: int, conv_dtype: str, ssm_dtype: str) -> MambaSpec:
        """Conv state: the last `d_conv - 1` pre-conv inputs, `(conv_dim, d_conv - 1)`
        oldest first; SSM state `(n_heads, head_dim, d_state)`."""
        return MambaSpec(block_size=block_size, num_heads=self.n_heads, head_dim=self.head_dim,
                         state_size=self.d_state, n_groups=self.n_groups, conv_width=self.d_conv - 1,
                         conv_dtype=conv_dtype, ssm_dtype=ssm_dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, hidden_size) -> (T, hidden_size); writes the requests' states."""
        context = get_forward_context()
        meta: MambaMetadata = context.attn_metadata[self.layer_name]
        cache: MambaCache = context.kv_caches[self.layer_name]
        gate, xbc, dt = self.in_proj(hidden).split([self.intermediate_size, self.conv_dim, self.n_heads], dim=-1)
        y = torch.zeros(hidden.shape[0], self.intermediate_size, dtype=torch.float32, device=hidden.device)
        for req in meta.prefills:
            rows = slice(req.query_start, req.query_start + req.query_len)
            y[rows] = self._prefill(req, xbc[rows], dt[rows], cache)
        if meta.num_decodes:
            rows = meta.decode_token_indices
            y[rows] = self._decode(meta, xbc[rows], dt[rows], cache)
        return tp_reduce(self.out_proj(self.norm(y, gate).to(hidden.dtype)), self.shard)

    def _prefill(self, req: MambaRequestSlice, xbc: torch.Tensor, dt: torch.Tensor,
                 cache: MambaCache) -> torch.Tensor:
        """One request's n new tokens: xbc (n, conv_dim), dt (n, H) -> y (n, intermediate) float32."""
        conv_state, ssm_state = self._read_state(req.read_block, cache, xbc.device)
        window = torch.cat([conv_state, xbc.float().T], dim=1)  # (conv_dim, d_conv - 1 + n)
        weight, bias = self._conv_params()
        conv_out = F.silu(F.conv1d(window[None], weight[:, None], bias, groups=self.conv_dim)[0].T)
        x, B, C = self._split_xbc(conv_out)
        points = [n for n, _ in req.writes]
        ends = chunk_ends(req.query_len, points, self.chunk_size)
        y, end_states = ssd_scan(x, self._dt(dt), self._A(), B, C, ends, ssm_state)
        blocks = torch.tensor([block for _, block in req.writes], dtype=torch.int64, device=xbc.device)
        # window[:, p : p + d_conv - 1] holds the last d_conv - 1 inputs after p new tokens
        conv_states = window.unfold(1, self.d_conv - 1, 1)[:, points].transpose(0, 1)
        cache.write(blocks, conv_states, end_states[[ends.index(p) for p in points]])
        return (y + x * self.D.float()[:, None]).flatten(1)

    def _decode(self, meta: MambaMetadata, xbc: torch.Tensor, dt: torch.Tensor,
                cache: MambaCache) -> torch.Tensor:
        """All single-token requests: xbc (R, conv_dim), dt (R, H) -> y (R, intermediate) float32."""
        reads, has_state = meta.decode_read_blocks, meta.decode_has_state
        conv_read, ssm_read = cache.read(reads)
        conv_state = torch.where(has_state[:, None, None], conv_read, 0.0)
        window = torch.cat([conv_state, xbc.float()[:, :, None]], dim=2)  # (R, conv_dim, d_conv)
        weight, bias = self._conv_params()
        conv_out = (window * weight).sum(-1)
        x, B, C = self._split_xbc(F.silu(conv_out if bias is None else conv_out + bias))
        dt = self._dt(dt)
        ssm = torch.where(has_state[:, None, None, None], ssm_read, 0.0)
        ssm = ssm * torch.exp(dt * self._A())[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None]
        y = torch.einsum("rhpn,rhn->rhp", ssm, C) + x * self.D.float()[:, None]
        cache.write(meta.decode_write_blocks, window[:, :, 1:], ssm)
        return y.flatten(1)

    def _read_state(self, block: int | None, cache: MambaCache,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 copies of a block's conv and SSM states, zeros when there is none yet."""
        if block is None:
            return (torch.zeros(self.conv_dim, self.d_conv - 1, device=device),
                    torch.zeros(self.n_heads, self.head_dim, self.d_state, device=device))
        conv, ssm = cache.read(torch.tensor([block], device=device))  # copies: written later this step
        return conv[0], ssm[0]

    def _conv_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Depthwise conv weight (conv_dim, d_conv) and bias, float32."""
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        return self.conv1d.weight[:, 0].float(), bias

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, conv_dim) -> x (T, H, P), B and C (T, H, N): head h uses group h // (H / G)."""
        group_width = self.n_groups * self.d_state
        x, B, C = xbc.split([self.intermediate_size, group_width, group_width], dim=-1)
        per_group = self.n_heads // self.n_groups
        B, C = (t.unflatten(-1, (self.n_groups, self.d_state)).repeat_interleave(per_group, dim=1) for t in (B, C))
        return x.unflatten(-1, (self.n_heads, self.head_dim)), B, C

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        """The step sizes (T, H): softplus(dt + dt_bias) clamped to `time_step_limit`."""
        low, high = self.time_step_limit
        return F.softplus(dt.float() + self.dt_bias.float()).clamp(min=low, max=high)

    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())


def _shift(rows: slice, offset: int) -> slice:
    return slice(rows.start + offset, rows.stop + offset)


def chunk_ends(n: int, points: list[int], chunk_size: int) -> list[int]:
    """Sorted chunk end positions covering `(0, n]`: every point in `points` (each in
    `(0, n]`) and `n` end a chunk, and no chunk is longer than `chunk_size`."""
    ends: list[int] = []
    start = 0
    for point in sorted({*points, n}):
        ends.extend(range(start + chunk_size, point, chunk_size))
        ends.append(point)
        start = point
    return ends


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             ends: list[int], initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of one sequence over chunks ending at `ends` (see `chunk_ends`).

    x (n, H, P), dt (n, H), A (H,), B and C (n, H, N), initial_state (H, P, N), all float32.
    Returns y (n, H, P) without the D skip, and the state after each chunk (len(ends), H, P, N).
    Chunks are padded to the longest with dt = 0, which neither decays nor feeds the state.
    """
    # index tensors from host lists: no device sync
    starts_list = [0, *ends[:-1]]
    longest = max(e - s for s, e in zip(starts_list, ends))
    starts = torch.tensor(starts_list, device=x.device)
    lengths = torch.tensor(ends, device=x.device) - starts
    offsets = torch.arange(longest, device=x.device)
    valid = offsets < lengths[:, None]  # (c, L)
    index = torch.where(valid, starts[:, None] + offsets, 0)
    dt_c = dt[index] * valid[..., None]  # (c, L, H)
    x_dt = x[index] * dt_c[..., None]  # (c, L, H, P)
    B_c, C_c = B[index], C[index]  # (c, L, H, N)
    A_dt = (dt_c * A).permute(2, 0, 1)  # (H, c, L)
    A_cumsum = A_dt.cumsum(-1)
    # within a chunk: y_l = sum_{s <= l} C_l . B_s exp(A_cumsum_l - A_cumsum_s) x_dt_s
    decay = torch.exp(segment_sum(A_dt)).permute(1, 2, 3, 0)  # (c, L, S, H)
    scores = torch.einsum("clhn,cshn->clsh", C_c, B_c) * decay
    y = torch.einsum("clsh,cshp->clhp", scores, x_dt)
    # each chunk's own contribution to the state at its end, then the recurrence across chunks
    to_end = torch.exp(A_cumsum[..., -1:] - A_cumsum)  # (H, c, L)
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", B_c, to_end, x_dt)
    states = torch.cat([initial_state[None], chunk_states])  # (c + 1, H, P, N)
    across = torch.exp(segment_sum(F.pad(A_cumsum[..., -1], (1, 0))))  # (H, c + 1, c + 1)
    states = torch.einsum("hij,jhpn->ihpn", across, states)  # [i]: the state after chunk i - 1
    y = y + torch.einsum("clhn,chpn->clhp", C_c, states[:-1]) * torch.exp(A_cumsum).permute(1, 2, 0)[..., None]
    chunk_of = torch.repeat_interleave(torch.arange(len(ends), device=x.device), lengths, output_size=x.shape[0])
    padded_row = chunk_of * longest + torch.arange(x.shape[0], device=x.device) - starts[chunk_of]
    return y.flatten(0, 1)[padded_row], states[1:]


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """(..., L) -> (..., L, L): out[..., i, j] = a[j+1] + ... + a[i] for j <= i, -inf above
    the diagonal (transformers' masked-cumsum form, stable in float32)."""
    length = a.shape[-1]
    a = a[..., None].expand(*a.shape, length)
    strict = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = a.masked_fill(~strict, 0).cumsum(dim=-2)
    lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~lower, -torch.inf)
