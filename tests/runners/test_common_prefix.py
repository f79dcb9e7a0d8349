"""engine.common_prefix (how much of a prompt a slot already holds) against a plain token-by-token count."""

from __future__ import annotations

import random

from daemon.llama.engine import common_prefix


def count(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def test_matches_a_token_by_token_count() -> None:
    rng = random.Random(19)
    for _ in range(5000):
        a = [rng.randint(0, 2) for _ in range(rng.randint(0, 40))]
        b = a[: rng.randint(0, len(a))] + [rng.randint(0, 2) for _ in range(rng.randint(0, 10))]
        assert common_prefix(a, b) == count(a, b) == common_prefix(b, a)


def test_edges() -> None:
    assert common_prefix([], []) == 0
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([5, 2], [1, 2]) == 0
    long = list(range(5000))
    assert common_prefix(long, [*long[:4321], -1]) == 4321
