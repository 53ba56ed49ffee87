"""sample(): greedy, temperature, top-k, top-p, min-p, logit_bias and per-request seeds."""

from __future__ import annotations

import pytest
import torch

from pd.contracts.sampling_params import SamplingParams
from pd.worker import sampler
from pd.worker.sampler import first_max, make_generator, sample
from tests.support.sampling_reference import brute_force_penalized


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_argmax() -> None:
    x = logits()
    assert sample(x, [SamplingParams(temperature=0)] * 4, [None] * 4) == x.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [262144, 151936, 4096, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_first_max_is_the_first_maximum_of_each_row(vocab: int, dtype: torch.dtype) -> None:
    """Chunked on CPU where the vocabulary splits (1000 does not: one plain reduction); a
    maximum repeated in a later chunk, later in its own chunk, or earlier in a chunk than
    its first occurrence elsewhere, still gives the first."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    top = logits.max() + 1
    logits[1, [vocab - 1, vocab // 2 + 5, vocab // 2 + 3]] = top  # first at vocab // 2 + 3
    logits[2, [vocab - 2, 7]] = top  # first at 7, the other in the last chunk
    logits[3, [3, 2]] = top  # two in the first chunk
    logits[4] = top  # all equal: 0
    logits[5, [vocab - 130, vocab - 1]] = top  # the last chunk alone
    expected = logits.max(dim=-1).indices
    assert expected[1:].tolist() == [vocab // 2 + 3, 7, 2, 0, vocab - 130]
    assert torch.equal(first_max(logits), expected)
    assert first_max(logits[:0]).shape == (0,)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    x = logits()
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)] * 2
    gens = [make_generator(i, "cpu") for i in range(4)]
    assert sample(x, params, gens) == x.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_most_likely() -> None:
    x = logits(rows=1)
    top3 = set(x[0].topk(3).indices.tolist())
    seen = {sample(x, [SamplingParams(top_k=3, seed=s)], [make_generator(s, "cpu")])[0] for s in range(200)}
    assert seen <= top3 and len(seen) > 1


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {sample(x, [SamplingParams(top_p=0.7)], [make_generator(s, "cpu")])[0] for s in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7 needs the second; 0.8 >= 0.7 stops there


def test_a_seeded_request_samples_the_same_whatever_its_batch() -> None:
    x = logits(rows=3)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(x[1:2], [p], [make_generator(42, "cpu")])[0] for _ in range(1)]
    batched = sample(x, [SamplingParams(temperature=0.7), p, SamplingParams(temperature=0)],
                     [None, make_generator(42, "cpu"), None])
    assert batched[1] == alone[0]


def test_rows_sampled_in_parts_draw_what_one_part_would(monkeypatch) -> None:
    """Sampled rows go through in parts of SAMPLE_PART_BYTES (no temporary large enough
    to be mapped fresh by malloc): parts of one and of three rows give each seeded row
    the token that all rows at once give it, with filters and greedy rows between them."""
    x = torch.randn(7, 3000, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(temperature=0.7 + i / 10, seed=i, top_k=50 if i % 2 else None,
                             top_p=0.9 if i % 3 else 1.0) for i in range(7)]
    params[4] = SamplingParams(temperature=0.0)

    def drawn(part_bytes: int) -> list[int]:
        monkeypatch.setattr(sampler, "SAMPLE_PART_BYTES", part_bytes)
        return sample(x, params, [make_generator(i, "cpu") for i in range(7)])

    whole = drawn(1 << 30)
    assert drawn(4 * 3000) == whole and drawn(3 * 4 * 3000) == whole
    assert whole[4] == int(x[4].argmax())


def test_temperature_sampling_follows_the_softmax() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0]])
    gen = make_generator(0, "cpu")
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(x, [SamplingParams(temperature=1.0)], [gen])[0]] += 1
    expected = x.softmax(-1)[0] * 3000
    assert ((counts - expected).abs() < 0.1 * 3000).all()
    cold = torch.zeros(3)
    for _ in range(500):
        cold[sample(x, [SamplingParams(temperature=0.1)], [gen])[0]] += 1
    assert cold[2] > 490  # a low temperature concentrates on the argmax


def test_sampling_over_a_large_vocabulary_follows_the_softmax() -> None:
    """Mass in tokens of different blocks of the two-level search (the vocabulary is not
    a multiple of the block), and everywhere else next to none."""
    vocab, hot = 262_147, [0, 1023, 1024, 200_000, 262_146]
    x = torch.full((1, vocab), -30.0)
    x[0, hot] = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.5])
    gen = make_generator(1, "cpu")
    counts = {t: 0 for t in hot}
    for _ in range(4000):
        token = sample(x, [SamplingParams(temperature=1.0)], [gen])[0]
        assert token in counts
        counts[token] += 1
    expected = x[0, hot].softmax(-1) * 4000
    assert all(abs(counts[t] - e) < 0.1 * 4000 for t, e in zip(hot, expected.tolist()))


def test_filtered_tokens_are_never_sampled_even_at_the_edges() -> None:
    """top-k leaves the first and last tokens of the vocabulary; draws near 0 and 1 must
    not land on the zero-probability tokens around them."""
    x = torch.zeros(1, 5000)
    x[0, [0, 4999]] = 5.0
    for seed in range(300):
        assert sample(x, [SamplingParams(top_k=2, seed=seed)], [make_generator(seed, "cpu")])[0] in (0, 4999)


def test_top_p_over_a_flat_row_looks_past_the_candidates() -> None:
    """A flat row: the 1,024 most likely tokens hold too little mass, so the whole sorted
    vocabulary decides (half of 4,096 equal tokens for top_p=0.5)."""
    x = torch.zeros(1, 4096)
    x[0, :2048] = 1e-3  # a hair more likely: these are the nucleus
    seen = {sample(x, [SamplingParams(top_p=0.5, seed=s)], [make_generator(s, "cpu")])[0] for s in range(400)}
    assert max(seen) < 2048 and len(seen) > 300


def brute_force_token(x: torch.Tensor, bias: dict[int, float], temperature: float, min_p: float,
                      draw: float) -> int:
    """The reference: float64, one token at a time, the same inverse transform of one draw."""
    row = x.double().clone()
    for token, value in bias.items():
        row[token] += value
    probs = (row / temperature).softmax(-1)
    probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
    cdf = (probs / probs.sum()).cumsum(-1)
    return int((cdf > draw).nonzero()[0])


def test_logit_bias_and_min_p_sample_as_a_brute_force_sampler() -> None:
    """Mixed batch: a greedy row with a bias that overturns its argmax, seeded rows with
    bias and min_p, a plain row; each seeded row's token is the brute-force sampler's for
    the same uniform draw."""
    x = logits(rows=4, vocab=40, seed=3)
    first = int(x[0].argmax())
    params = [SamplingParams(temperature=0, logit_bias=((first, -100.0), (7, 2.5))),
              SamplingParams(temperature=0.8, logit_bias=((3, 5.0), (11, -100.0)), min_p=0.05),
              SamplingParams(temperature=1.3, min_p=0.2),
              SamplingParams(temperature=0)]
    for seed in range(60):
        gens = [None, make_generator(seed, "cpu"), make_generator(seed + 1000, "cpu"), None]
        draws = [None] + [float(torch.rand(1, generator=make_generator(s, "cpu"), dtype=torch.float64))
                          for s in (seed, seed + 1000)]
        got = sample(x.clone(), params, gens)
        expected_greedy = (x[0] + torch.nn.functional.one_hot(torch.tensor(first), 40) * -100.0
                           + torch.nn.functional.one_hot(torch.tensor(7), 40) * 2.5).argmax()
        assert got[0] == int(expected_greedy) != first
        assert got[1] == brute_force_token(x[1], {3: 5.0, 11: -100.0}, 0.8, 0.05, draws[1])
        assert got[2] == brute_force_token(x[2], {}, 1.3, 0.2, draws[2])
        assert got[3] == int(x[3].argmax())


def test_logit_bias_does_not_touch_the_callers_logits() -> None:
    x = logits(rows=1)
    kept = x.clone()
    sample(x, [SamplingParams(temperature=0, logit_bias=((0, 50.0),))], [None])
    assert torch.equal(x, kept)


def test_min_p_keeps_only_tokens_near_the_most_likely() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {sample(x, [SamplingParams(min_p=0.35)], [make_generator(s, "cpu")])[0] for s in range(300)}
    assert seen == {0, 1}  # 0.15 < 0.35 x 0.5


def test_bad_bias_and_min_p_are_refused() -> None:
    for bad in (dict(min_p=1.5), dict(min_p=-0.1), dict(logit_bias=((1, 100.5),)),
                dict(logit_bias=((1, float("nan")),)), dict(logit_bias=((1, 1.0), (1, 2.0)))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_a_generator_made_after_k_tokens_draws_what_the_uninterrupted_one_draws() -> None:
    """D makes its generator after P's first token; a preempted request remakes its own."""
    x = logits(rows=1)
    params = [SamplingParams(temperature=1.0, seed=5)]
    uninterrupted = make_generator(5, "cpu")
    tokens = [sample(x, params, [uninterrupted])[0] for _ in range(6)]
    resumed = make_generator(5, "cpu", drawn=2)
    assert [sample(x, params, [resumed])[0] for _ in range(4)] == tokens[2:]


def test_penalties_match_a_brute_force_computation() -> None:
    """Greedy rows whose argmax the penalties decide: each row's choice is the brute-force
    argmax, and the unpenalized row in the batch is untouched."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(40):
        x = torch.randn(3, 30, generator=gen)
        histories = [(torch.randint(0, 30, (12,), generator=gen).tolist(), 5) for _ in range(3)]
        settings = [(0.7, 0.4, 1.3), (-0.5, 1.5, 1.0), (0.0, 0.0, 1.0)]
        params = [SamplingParams(temperature=0, presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
                  for p, f, r in settings]
        got = sample(x, params, [None] * 3, histories)
        for i, (p, f, r) in enumerate(settings):
            expected = brute_force_penalized(x[i], *histories[i], p, f, r)
            assert got[i] == int(expected.argmax()), (trial, i)


def test_penalized_rows_need_their_histories() -> None:
    with pytest.raises(ValueError, match="histories"):
        sample(logits(rows=1), [SamplingParams(temperature=0, presence_penalty=1.0)], [None])


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached() -> None:
    x = torch.zeros(2, 10)
    x[:, 3] = 5.0  # EOS would win
    x[:, 4] = 4.0  # then a stop token
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(4,)),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(4,), ignore_eos=True)]
    short = [([1, 2, 7], 2), ([1, 2, 7], 2)]  # one output token of two
    # row 0: EOS and the stop token held back, the first of the rest (all 0) wins; row 1
    # ignores EOS, so only its stop token is held back
    assert sample(x, params, [None, None], short, eos_token_ids=frozenset({3})) == [0, 3]
    reached = [([1, 2, 7, 8], 2)] * 2
    assert sample(x, params, [None, None], reached, eos_token_ids=frozenset({3})) == [3, 3]


def test_grammar_masks_leave_only_the_allowed_tokens() -> None:
    """Bit j of word w allows token 32 w + j; a row without a mask is untouched, tokens
    past the mask (a vocabulary wider than the tokenizer's) are not allowed, and the
    caller's logits are not modified."""
    import numpy as np

    from pd.worker.sampler import mask_tokens

    x = logits(rows=3, vocab=70)
    kept = x.clone()
    allow = np.zeros(2, dtype=np.int32)  # the tokenizer knows 64 tokens
    allow[0] |= 1 << 5
    allow[1] = np.array([(1 << 31) | (1 << 2)], dtype=np.uint32).view(np.int32)[0]  # tokens 63 and 34
    masked = mask_tokens(x, [allow, None, allow])
    assert torch.equal(x, kept) and torch.equal(masked[1], x[1])
    for row in (0, 2):
        assert torch.isfinite(masked[row]).nonzero().flatten().tolist() == [5, 34, 63]
    assert sample(masked, [SamplingParams(temperature=1.0, seed=s) for s in range(3)],
                  [make_generator(s, "cpu") for s in range(3)])[0] in (5, 34, 63)
    assert mask_tokens(x, [None] * 3) is x
    nothing = np.zeros(2, dtype=np.int32)
    assert torch.equal(mask_tokens(x, [nothing, allow, None])[0], x[0])  # left to fail at the grammar, alone


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_first_max_takes_the_first_nan_as_torch_does(dtype: torch.dtype) -> None:
    """A NaN counts as the largest value (its first one wins), an all -inf row gives 0, and a
    row whose maximum sits in the tail past the last 16 lanes is found there."""
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits[0, [700, 30, 999]] = float("nan")
    logits[1] = float("-inf")
    logits[2, 995] = 1e4
    logits[3, [0, 500]] = torch.tensor([-0.0, 1e4]).to(dtype)
    expected = logits.max(dim=-1).indices
    assert expected.tolist() == [30, 0, 995, 500]
    assert torch.equal(first_max(logits), expected)
    assert torch.equal(first_max(logits[:, 1:]), logits[:, 1:].max(dim=-1).indices)  # rows not 64-byte aligned
