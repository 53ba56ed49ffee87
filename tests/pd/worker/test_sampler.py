"""sample(): greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import torch

from pd.request import SamplingParams
from pd.worker.sampler import make_generator, sample


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_argmax() -> None:
    x = logits()
    assert sample(x, [SamplingParams(temperature=0)] * 4, [None] * 4) == x.argmax(-1).tolist()


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
