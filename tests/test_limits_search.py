"""The bound's search for the longest length / largest micro-batch (plan/limits.py `largest_under`): the same answer
as the plain doubling-and-bisection `largest` on any non-decreasing need (the largest multiple of the step that fits
is one number, whatever the probes), in fewer probes on the near-affine needs of a plan."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.plan.limits import largest, largest_replayed, largest_under, settled


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=80), st.integers(0, 1500), st.integers(1, 9),
       st.integers(0, 120), st.sampled_from(["steps", "affine", "quadratic"]))
def test_largest_under_is_largest(rises, budget, step, limit, shape):
    # a non-decreasing need of any shape (flat runs, jumps, the cumulative sums of the rises beyond them), checked
    # against `largest` on fits = need <= budget
    sums = list(itertools.accumulate(rises))

    def need(x: int) -> int:
        k = x // step
        if shape == "steps":
            return sums[min(k, len(sums) - 1)] + max(k - len(sums), 0) * rises[-1]
        if shape == "affine":
            return rises[0] + k * (rises[-1] + 1)
        return rises[0] + k * k * (rises[-1] + 1) // 7

    assert largest_under(need, budget, step, limit) == largest(lambda x: need(x) <= budget, step, limit)


def test_few_probes_on_an_affine_need():
    # a need affine in s (bytes = 40e9 + 15e6 per token, the shape of a 530B stage's bound): with the answer at
    # (85.9e9 - 40e9) / 15e6 = 3,060 tokens (in steps of 8: 3,056), `largest` takes 2 + 9 doublings + 9 bisections;
    # the line through the first two probes lands on the answer, checked one step longer: 4 probes
    probes = []

    def need(s: int) -> int:
        probes.append(s)
        return 40 * 10**9 + 15 * 10**6 * s

    assert largest_under(need, 85_900_000_000, 8, 1 << 24) == 3056
    assert len(probes) == 4 and len(set(probes)) == 4
    assert largest(lambda s: need(s) <= 85_900_000_000, 8, 1 << 24) == 3056
    assert len(probes) - 4 >= 18


def test_settled_moves_below_a_shorter_length_that_dies():
    # a replay-like verdict, not monotone: fits up to 1,000 steps except at 900 (a shorter length that dies, as the
    # llama3-8b replay at 13,056 tokens under 14,848 that complete). fits_below / largest_replayed's plain answer is
    # 1,000 (fits, 1,001 not); the window (6 lengths, 1/48 of 1,000 = 20 steps apart: 980 .. 880) holds 900, so the
    # answer goes below it: 899 (fits, 900 not), whose own window (18 steps apart: 881 .. 791) fits
    def fits(x: int) -> bool:
        return x <= 1000 and x != 900

    assert settled(fits, 1000, 1) == 899
    assert largest_replayed(lambda x: x, 1000, fits, 1, 10**6) == 899
    # a length outside the window is not sampled: the answer stays (the window is a sample, not a proof)
    assert settled(lambda x: x <= 1000 and x != 500, 1000, 1) == 1000
    assert settled(lambda x: True, None, 1) is None
