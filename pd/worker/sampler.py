"""Pick the next token of each request from its logits row.

`adjust`: a request's `logit_bias` is added first, then its penalties are applied, then,
until it has min_tokens, its stop tokens are held back (all in float32; `SamplingParams`
says how). `choose` picks from those logits.
Greedy rows take the first maximum. Others are divided by their temperature, filtered by
min-p, top-k then top-p, and sampled by inverse transform: one uniform draw per row,
located in the row's cumulative distribution (two levels: blocks, then tokens). The draw
comes from the request's own generator when it has a seed, so a seeded request samples
the same tokens whatever it is batched with. One draw per row, not one per vocabulary
entry: on a 262k vocabulary that is 1 ms for a batch of 8 instead of 40.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pd.contracts.sampling_params import SamplingParams
from pd.models import fused

TOP_P_CANDIDATES = 1024  # top-p first looks for its nucleus among this many most likely tokens
BLOCK = 1024  # tokens per block of the two-level inverse transform
SAMPLE_PART_BYTES = 4 << 20  # float32 logits of the rows sampled together (see choose)
History = tuple[list[int], int]  # a row's token ids so far, and how many of them are its prompt


def mask_tokens(logits: torch.Tensor, masks: list[np.ndarray | None]) -> torch.Tensor:
    """The logits with every token a row's grammar mask does not allow at -inf (a copy;
    `logits` itself when no row has a mask). `masks[i]`: row i's int32 words, bit j of
    word w allowing token 32 w + j; tokens past the mask (a vocabulary wider than the
    tokenizer's) are not allowed. A row whose mask allows none of the logits' tokens is
    left as it is: its token then fails its request at the grammar, alone, where a row
    of -inf would make the batch's sampling fail."""
    rows = [i for i, mask in enumerate(masks) if mask is not None]
    if not rows:
        return logits
    words = np.stack([masks[i] for i in rows])
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # little-endian words: token order
    allowed = torch.from_numpy(bits.view(np.bool_)).to(logits.device)
    vocab = logits.shape[-1]
    allowed = F.pad(allowed, (0, max(0, vocab - allowed.shape[1])))[:, :vocab]
    allowed[~allowed.any(dim=1)] = True  # nothing of this vocabulary allowed: left to fail at the token, alone
    masked = torch.where(allowed, logits[rows], torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
    if len(rows) == logits.shape[0]:
        return masked
    logits = logits.clone()
    logits[rows] = masked
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[History] | None = None,
           eos_token_ids: frozenset[int] = frozenset()) -> list[int]:
    """logits (N, V) in the model's dtype, one row per request -> N token ids (`adjust`
    then `choose`)."""
    return choose(adjust(logits, params, histories, eos_token_ids), params, generators)


def adjust(logits: torch.Tensor, params: list[SamplingParams], histories: list[History] | None = None,
           eos_token_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """The logits the rows choose from: with each row's bias, penalties and min_tokens
    hold-back applied, in float32, on a copy (never the caller's tensor); `logits` itself
    when no row has any. `histories[i]` = (row i's token ids so far, how many of them are
    the prompt), needed by rows with penalties or min_tokens; `eos_token_ids`: what
    min_tokens holds back besides the row's stop_token_ids."""
    if not any(p.logit_bias or p.penalized or p.min_tokens for p in params):
        return logits
    if histories is None and any(p.penalized or p.min_tokens for p in params):
        raise ValueError("rows with penalties or min_tokens need their token histories")
    logits = logits.to(torch.float32, copy=True)
    _add_bias_(logits, params)
    _penalize_(logits, params, histories)
    _hold_back_stops_(logits, params, histories, eos_token_ids)
    return logits


def choose(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `adjust`ed logits: greedy rows take the first maximum as
    computed; sampled rows are widened to float32 and drawn from, a few rows at a time
    (`SAMPLE_PART_BYTES` of float32 each: 4 of a 262,144-token vocabulary), so that no
    temporary is large enough for malloc to map it fresh: 64 such rows at once made
    several float32 temporaries of 64 MB, each page-faulted in anew (64 ms a step's
    sampling, against 12 ms in parts, with the engine's malloc settings)."""
    greedy = first_max(logits)
    if all(p.greedy for p in params):
        return greedy.tolist()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    tokens = greedy.clone()
    per_part = max(1, SAMPLE_PART_BYTES // (4 * logits.shape[-1]))
    for start in range(0, len(sampled), per_part):
        rows = sampled[start:start + per_part]
        probs = _filtered_probs(logits[rows].float(), [params[i] for i in rows])
        draws = torch.cat([_draw(generators[i], probs.device) for i in rows])
        tokens[rows] = _inverse_transform(probs, draws).to(tokens.dtype)
    return tokens.tolist()


def first_max(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first maximum, as `logits.max(dim=-1).indices` (argmax is 5x
    slower on bfloat16 CPU). On CPU the native kernel (`fused.first_max`: one pass for the
    maximum, one for its first position; a (1, 262144) bfloat16 row 1.1 -> ~0.05 ms, 8
    rows 0.29 -> ~0.1 ms); without it, over a vocabulary that splits into chunks of up
    to 4,096: each chunk's maximum (a plain reduction, ~3.5x faster than one carrying
    indices), then the index within the first chunk holding the row's maximum."""
    rows, vocab = logits.shape
    if rows and vocab and fused.supports(logits):
        return fused.first_max(logits)
    chunk = next((c for c in (4096, 2048, 1024, 512, 256, 128) if vocab % c == 0 and vocab > c), None)
    if logits.device.type != "cpu" or chunk is None:
        return logits.max(dim=-1).indices
    parts = logits.view(rows, vocab // chunk, chunk)
    best = parts.amax(dim=-1).max(dim=-1).indices  # the first chunk reaching the row's maximum
    return best * chunk + parts[torch.arange(rows), best].max(dim=-1).indices


def _add_bias_(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Each row's `logit_bias` added, in place."""
    pairs = [(i, token, value) for i, p in enumerate(params) for token, value in p.logit_bias]
    if pairs:
        rows, tokens, values = zip(*pairs)
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(index, torch.tensor(values, device=logits.device), accumulate=True)


def _penalize_(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> None:
    """Each penalized row's penalties applied, in place."""
    for i, p in enumerate(params):
        if not p.penalized:
            continue
        tokens, num_prompt = histories[i]
        row = logits[i]
        if p.repetition_penalty != 1.0 and tokens:
            seen = torch.tensor(sorted(set(tokens)), device=logits.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if tokens[num_prompt:] and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(tokens[num_prompt:], device=logits.device).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty


def _hold_back_stops_(logits: torch.Tensor, params: list[SamplingParams], histories: list[History],
                      eos_token_ids: frozenset[int]) -> None:
    """Rows short of their min_tokens cannot pick a token that would stop them, in place."""
    for i, p in enumerate(params):
        if not p.min_tokens:
            continue
        tokens, num_prompt = histories[i]
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if len(tokens) - num_prompt < p.min_tokens and stops:
            logits[i, sorted(stops)] = float("-inf")


def _draw(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1), from the request's generator (on its device) if it has one."""
    return torch.rand(1, generator=generator, dtype=torch.float64,
                      device=generator.device if generator is not None else device).to(device)


def _inverse_transform(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative mass first exceeds draw x total, found in
    two levels: among blocks of BLOCK tokens by their masses, then inside the block (each
    sum short enough for float32 to keep it exact enough; the running totals in float64).
    `right=True` finds the first entry strictly above the target, so a token of
    probability 0 (filtered out) is never the one found."""
    rows, vocab = probs.shape
    blocks = F.pad(probs, (0, -vocab % BLOCK)).view(rows, -1, BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    target = draws[:, None] * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(rows, device=probs.device), block[:, 0]].double().cumsum(dim=-1)
    rest = torch.minimum(target - before, inner[:, -1:] * (1 - 1e-12))  # rounding between the two levels
    index = torch.searchsorted(inner, rest, right=True).clamp(max=BLOCK - 1)
    return (block * BLOCK + index)[:, 0]


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    logits = logits / temps
    vocab = logits.shape[-1]
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if any(p.top_k is not None for p in params):
        ks = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=logits.device)
        kth = logits.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        logits = _top_p(logits, torch.tensor([p.top_p for p in params], device=logits.device))
    return logits.softmax(dim=-1)


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one).
    The set is looked for among the TOP_P_CANDIDATES most likely tokens, and over the
    whole sorted vocabulary only for a row too flat for them to reach top_p."""
    probs = logits.softmax(dim=-1)
    k = min(TOP_P_CANDIDATES, logits.shape[-1])
    values, order = probs.topk(k, dim=-1)
    if k < logits.shape[-1] and not bool((values.sum(dim=-1) >= top_p).all()):
        values, order = probs.sort(dim=-1, descending=True)
    keep = (values.cumsum(dim=-1) - values) < top_p.unsqueeze(1)  # the mass before it is short of top_p
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, keep)
    return logits.masked_fill(~kept, float("-inf"))


def make_generator(seed: int | None, device: torch.device | str, drawn: int = 0) -> torch.Generator | None:
    """A seeded request's generator, past the `drawn` uniforms its tokens so far took (one
    per sampled token): a request that arrives with tokens sampled elsewhere (D, after P's
    first) or recomputed after preemption draws what it would have drawn uninterrupted."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for _ in range(drawn):
        _draw(generator, generator.device)
    return generator
