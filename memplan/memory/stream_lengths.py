"""One plan's allocation stream at many sequence lengths (`--max-seq`'s search, memplan/plan/limits.py, replays
some thirty lengths of one plan): `StreamLengths` makes the stream (memplan/memory/stream.py) for the first two
lengths asked for; when the two are the same stream but for the sizes, and every size is what its polynomial gives
(`Alloc.poly`, the requested bytes of one storage in s and b, rounded up as the stream rounds a storage: ceil), at
both lengths, the compact form the replay reads (`AllocationStream.ops`) at every later length is the first
stream's, its sizes evaluated from their polynomials, instead of the whole stream made again (llama3-8b's stream
for one H100, hf-sdpa, full recompute: 8,019 events, ~15 ms of CPU to make, its 13 distinct sizes under 0.1 ms to
evaluate). Where a size would be under 1 byte at a length (the stream's term may have no storage there), that
length's stream is made.

What this takes for granted, checked at the two lengths made and by tests/test_replay_speed.py at other lengths of
random plans: the stream's events, their order and every size without a polynomial do not depend on s, and a size
with one is ceil(poly(s, b)) (exact when the plan's divisibility checks hold: memplan/core/symbolic.py `evaluate`).
Where the two streams differ otherwise (context parallelism's s / cp tokens, which the polynomials leave out; a
first step at another length, `Replay.first_step_seq_len`; any size that moves with s without a polynomial, as GPT-3's
learned position embedding, a parameter of s x h), every length's stream is made.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable, Optional

from memplan.core.symbolic import Poly
from memplan.memory.stream_events import Alloc, AllocationStream

_UNDECIDED = object()


def ceil_at(poly: Poly, s: int, b: int) -> Optional[int]:
    """ceil(poly(s, b)) exactly (rational coefficients); None when the polynomial holds another symbol."""
    in_s = in_powers_of_s(poly, b)
    return None if in_s is None else value_at(in_s, s)


def in_powers_of_s(poly: Poly, b: int) -> Optional[tuple[tuple[tuple[int, int], ...], int]]:
    """The polynomial at this b as integers: ((power of s, coefficient), ...) over a common denominator (the value at
    s is ceil(sum(coefficient * s^power) / denominator)); None when it holds another symbol or a negative power."""
    by_power: dict[int, Fraction] = {}
    for mono, coef in poly.terms:
        powers = dict(mono)
        if set(powers) - {"s", "b"} or min(powers.values(), default=0) < 0:
            return None
        k = powers.get("s", 0)
        by_power[k] = by_power.get(k, Fraction(0)) + Fraction(coef) * b ** powers.get("b", 0)
    denominator = math.lcm(*(c.denominator for c in by_power.values())) if by_power else 1
    return tuple((k, int(c * denominator)) for k, c in by_power.items()), denominator


def value_at(in_s: tuple[tuple[tuple[int, int], ...], int], s: int) -> int:
    """ceil(poly(s)) of a polynomial `in_powers_of_s` gave."""
    terms, denominator = in_s
    return -(-sum(c * s ** k for k, c in terms) // denominator)


def _at_least_one(in_s: tuple[tuple[tuple[int, int], ...], int], s: int) -> Optional[int]:
    """`value_at` where poly(s) >= 1 byte; None where less: the stream's term may have no storage there (a size of 0
    bytes, floored, makes no allocation), so that length's stream is made."""
    terms, denominator = in_s
    total = sum(c * s ** k for k, c in terms)
    return -(-total // denominator) if total >= denominator else None


class _Shape:
    """A stream's compact form with its sizes as functions of s: the ops that do not move (frees, sizes without a
    polynomial) and, per distinct polynomial (in powers of s at the plan's b), the positions it sizes."""

    def __init__(self, stream: AllocationStream, ops: list[int], groups: list[tuple[Any, list[int]]]) -> None:
        self.stream, self.ops_const, self.groups = stream, ops, groups

    def ops(self, s: int) -> Optional[list[int]]:
        """The compact form at s; None where a size would be under 1 byte (`_at_least_one`)."""
        out = list(self.ops_const)
        for in_s, positions in self.groups:
            value = _at_least_one(in_s, s)
            if value is None:
                return None
            for at in positions:
                out[at] = value
        return out


def shape_of(first: tuple[int, AllocationStream], second: tuple[int, AllocationStream], b: int) -> Optional[_Shape]:
    """The shape two streams of one plan at lengths s1 != s2 share (their events equal but for the sizes, each size
    with a polynomial ceil(poly(s, b)) at both lengths, each without one equal); None when they do not."""
    (s1, one), (s2, two) = first, second
    events, others = one.events, two.events
    if len(events) != len(others):
        return None
    ops = one.ops()
    polys: dict[Poly, list[int]] = {}  # the positions each sizes
    compiled: dict[Poly, Any] = {}  # its form in powers of s (`in_powers_of_s`)
    for at, (x, y) in enumerate(zip(events, others)):
        if type(x) is not type(y):
            return None
        if type(x) is not Alloc:
            if x != y:
                return None
            continue
        if (x.id, x.kind, x.name, x.poly) != (y.id, y.kind, y.name, y.poly):
            return None
        if x.poly is None:
            if x.size != y.size:
                return None
            continue
        if x.poly not in polys:
            in_s = compiled[x.poly] = in_powers_of_s(x.poly, b)
            polys[x.poly] = []
        else:
            in_s = compiled[x.poly]
        if in_s is None or value_at(in_s, s1) != x.size or value_at(in_s, s2) != y.size:
            return None
        polys[x.poly].append(at)
    return _Shape(one, ops, [(compiled[poly], positions) for poly, positions in polys.items()])


class StreamLengths:
    """The streams of one plan (all but the sequence length fixed; b its micro-batch) at the lengths a search asks
    for, by `key` (what else picks the stream: the stage replayed): `get(key, s, make)` returns the stream and its
    compact form at s, `make()` called only while the shape is not known (module docstring) or where a size would be
    under 1 byte."""

    def __init__(self, b: int) -> None:
        self.b = b
        self.first: dict[Any, tuple[int, AllocationStream]] = {}
        self.shapes: dict[Any, Any] = {}  # key -> _Shape, or None: every length made
        self.made = 0  # streams made (the rest evaluated)
        # the most loaded stage's replays (memplan/plan/stage_verdict.py, `every_stage` False), by (key, s, capacity,
        # replay settings): (stream, its compact form, its replay, the position of the phase it dies in)
        self.replays: dict[tuple, tuple] = {}

    def get(self, key: Any, s: int, make: Callable[[], AllocationStream]) -> tuple[AllocationStream, list[int]]:
        """The stream at length s (the first stream made, for an evaluated length: the same events, other sizes)
        and its compact form at s."""
        shape = self.shapes.get(key, _UNDECIDED)
        if isinstance(shape, _Shape) and (ops := shape.ops(s)) is not None:
            return shape.stream, ops
        stream = make()
        self.made += 1
        if shape is _UNDECIDED:
            first = self.first.setdefault(key, (s, stream))
            if first[0] != s:
                self.shapes[key] = shape_of(first, (s, stream), self.b)
                del self.first[key]
        return stream, stream.ops()
