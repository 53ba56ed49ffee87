"""The runs a READ's descriptors are built from."""

from __future__ import annotations

from connectors.nixl.descriptors import paired_runs


def test_paired_runs_matches_a_brute_force_split() -> None:
    import random

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 12)
        local = [rng.choice([0, rng.randint(1, 20)]) for _ in range(n)]
        remote = [rng.choice([0, rng.randint(1, 20)]) for _ in range(n)]
        runs = paired_runs(local, remote)
        expanded = [(l + i, r + i) for l, r, k in runs for i in range(k)]
        assert expanded == [(l, r) for l, r in zip(local, remote) if l and r]
        for (l0, r0, k0), (l1, r1, _) in zip(runs, runs[1:]):  # maximal: no two runs could merge
            assert (l0 + k0, r0 + k0) != (l1, r1)
