"""The events of an allocation stream (`Alloc`, `Free`), the stream itself (`AllocationStream`, which
memplan/memory/stream.py builds) and the repetition of its repeated pieces (`Repeats`): a
layer's forward or backward makes the same events for every micro-batch and layer of a step (only the tensor ids and
the labels in the names change), so memplan/memory/stream.py makes a piece once per distinct shape, keeps it as a
template, and stamps later copies from it (new ids, the new labels, the same sizes, kinds, polynomials and order):
the stream is the same event for event as made piece by piece (tests/test_stream.py), made several times faster.
A copy is kept as one `Stamp` (in each of its positions of the event list) holding its compact form for the replay
(`AllocationStream.ops`); its events are made only when the stream's `events` are first asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, NamedTuple, Optional

from memplan.core.symbolic import Poly
from memplan.memory.timeline import StepPeak

KINDS = ("parameter", "gradient", "optimizer_state", "saved_activation", "transient", "communication", "workspace")


class Alloc(NamedTuple):
    id: int
    size: int  # bytes requested (before the caching allocator's rounding)
    stream: int  # 0: the default compute stream
    kind: str  # one of KINDS
    name: str
    poly: Optional[Poly]  # the requested bytes as a polynomial in s and b (None: a state sized by shapes)
    bytes: int  # as the step timeline counts it (a term's storage rounded to the inventory's granularity)


class Free(NamedTuple):
    id: int


new_event = tuple.__new__  # an event made without the NamedTuple's Python-level __new__ (a stream makes many)


@dataclass(frozen=True)
class AllocationStream:
    """The run's allocations and frees on one GPU of `stage`, with `marks`: (index into `step.events`, number
    of stream events before that event's point) for the last step, `phases`: (what starts, position), and `periods`:
    the (start, end) positions of the steady state's (forward, backward) pairs, the pieces a step repeats
    (benchmarks/replay_period.py measures whether the allocator's state repeats with them).
    `raw`: the events as made, a template's copy a `Stamp` in each of its positions (`events` expands them when
    first asked for; a replay reads `ops()`, which does not)."""

    raw: list
    marks: list[tuple[int, int]]
    phases: list[tuple[str, int]]
    step: StepPeak  # the timeline walk of the stage (the steady-state step)
    stage: int
    periods: tuple[tuple[int, int], ...] = ()

    @cached_property
    def events(self) -> list:
        """Alloc | Free, in order."""
        return expand(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def event_at(self, index: int) -> Any:
        """`events[index]`, without expanding the other events (a replay that dies names the one it dies at)."""
        if "events" in self.__dict__:
            return self.events[index]
        e = self.raw[index]
        if type(e) is not Stamp:
            return e
        start = index  # a copy stands in each of its positions: its first is where the run of the same Stamp starts
        while start and self.raw[start - 1] is e:
            start -= 1
        return e.events()[index - start]

    def live_bytes(self) -> list[int]:
        """Bytes alive (as the timeline counts them) after each event."""
        size = {e.id: e.bytes for e in self.events if type(e) is Alloc}
        live, out = 0, []
        for e in self.events:
            live += size[e.id] if type(e) is Alloc else -size[e.id]
            out.append(live)
        return out

    def at_marks(self) -> list[tuple[int, int]]:
        """(timeline event index, the stream's live bytes at its point)."""
        live = [0] + self.live_bytes()
        return [(i, live[pos]) for i, pos in self.marks]

    def ops(self) -> list[int]:
        """The stream in the compact form memplan.memory.allocator.replay_ops replays: an allocation's requested
        bytes, ~id for a free (ids are given in allocation order from 0, every event on stream 0)."""
        return compact(self.raw)

    @property
    def peak_bytes(self) -> int:
        return max(self.live_bytes(), default=0)


class Repeats:
    """Templates of a stream's repeated pieces, by the caller's key (what makes a piece's events differ other than
    its ids and labels). A piece is `body()`, which appends events to `run.events` numbering allocations from
    `run.nid` (advancing it) and changes the dicts of `live` (name -> {index: [tensor ids]}, the tensors alive
    that the piece frees or adds to) in place; its labels are `where` and `label` ("layer j, micro-batch mb",
    "micro-batch mb"), which a name ends with as "(... where)" or "(... label)"."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.templates: dict[Any, Any] = {}

    def piece(self, run: Any, key: Any, live: dict[str, dict], where: str, label: str, variable: str,
              body: Callable[[], None]) -> None:
        """Run `body()`, or stamp its template when one was made for `key`. `variable`: a text no name made
        from a constant may hold (what else differs between copies, e.g. "layer j"): a piece whose names hold it
        other than in the labels is not templated."""
        template = self.templates.get(key) if self.enabled else False
        if template:
            self._stamp(run, template, live, where, label)
            return
        base, start = run.nid, len(run.events)
        outside = {i: (name, index, k) for name, d in live.items() for index, ids in d.items()
                   for k, i in enumerate(ids)}
        body()
        if template is None:
            self.templates[key] = _template(run.events[start:], base, outside, live, where, label, variable) or False

    @staticmethod
    def _stamp(run: Any, template: tuple, live: dict[str, dict], where: str, label: str) -> None:
        events, outside, after, allocations, (relative, from_before, own) = template
        base = run.nid
        ext = [live[name][index][k] for name, index, k in outside] if outside else outside  # the tensors from
        # before, as ~position
        # the copy's compact form now (what a replay reads), its events when the stream's are asked for: one
        # `Stamp` standing in each of its positions of run.events. A copy that frees nothing has the template's
        # form itself (allocations alone: the same requested bytes in every copy; a Stamp's ops are only read)
        ops = relative
        if own or from_before:
            ops = relative.copy()
            for at in own:  # a free of the copy's own tensor: ~(base + v) = ~v - base
                ops[at] -= base
            for at, k in from_before:
                ops[at] = ~ext[k]
        run.events += [Stamp(events, base, ext, where, label, ops)] * len(events)
        run.nid = base + allocations
        for name, d in after.items():
            alive = live[name]
            alive.clear()
            for index, refs in d:
                if len(refs) == 1:  # (the usual case, without a comprehension's call)
                    r = refs[0]
                    alive[index] = [base + r if r >= 0 else ext[~r]]
                else:
                    alive[index] = [base + r if r >= 0 else ext[~r] for r in refs]


class Stamp(NamedTuple):
    """A template's copy in a stream's event list (`Repeats._stamp`), in each of its positions: the template's
    events, the copy's first id, the tensors from before it (`ext`), its labels, its events in the compact form."""

    template: list
    base: int
    ext: list
    where: str
    label: str
    ops: list

    def events(self) -> list:
        base, tails, ext = self.base, ("", self.where + ")", self.label + ")"), self.ext
        return [new_event(Alloc, (base + e[0], e[1], 0, e[2], e[3] + tails[e[4]], e[5], e[6]))
                if type(e) is tuple else new_event(Free, (base + e if e >= 0 else ext[~e],)) for e in self.template]


def expand(raw: list) -> list:
    """A stream's events with every `Stamp` replaced by the events it stands for."""
    out: list = []
    i, n = 0, len(raw)
    while i < n:
        e = raw[i]
        if type(e) is Stamp:
            out += e.events()
            i += len(e.template)
        else:
            out.append(e)
            i += 1
    return out


def compact(raw: list) -> list[int]:
    """A stream's events (`Stamp`s in place) in the compact form of memplan.memory.allocator.replay_ops."""
    out: list[int] = []
    i, n = 0, len(raw)
    while i < n:
        e = raw[i]
        t = type(e)
        if t is Stamp:
            out += e.ops
            i += len(e.template)
            continue
        out.append(e.size if t is Alloc else ~e.id)
        i += 1
    return out


def _template(events: list, base: int, outside: dict, live: dict[str, dict], where: str, label: str,
              variable: str) -> Optional[tuple]:
    """The piece's events with ids relative to `base` (a tensor from before the piece as ~its position in a list of
    (dict, index, position) places), its names as text + which label ends them, the dicts' contents after it; None
    when a free or a tensor left alive is of neither, or a name holds a label or `variable` other than at its end."""
    tails = (where + ")", label + ")")
    places: dict[tuple, int] = {}

    def ref(i: int) -> int:
        if i >= base:
            return i - base
        return ~places.setdefault(outside[i], len(places))

    out: list = []
    allocations = 0
    try:
        for e in events:
            if type(e) is Free:
                out.append(ref(e.id))
                continue
            name, mode = e.name, 0
            for m, tail in enumerate(tails, 1):
                if name.endswith(tail):
                    name, mode = name[:-len(tail)], m
                    break
            if label in name or variable in name or e.id != base + allocations or e.stream:
                return None
            out.append((allocations, e.size, e.kind, name, mode, e.poly, e.bytes))
            allocations += 1
        after = {name: {index: [ref(i) for i in ids] for index, ids in d.items()} for name, d in live.items()}
    except KeyError:
        return None
    # the compact form relative to the copy's first id: an allocation's requested bytes, ~relative id for a free of
    # the piece's own tensor; a free of one from before (0 here) as (position, its position in ext)
    relative = [e[1] if type(e) is tuple else ~e if e >= 0 else 0 for e in out]
    from_before = [(at, ~e) for at, e in enumerate(out) if type(e) is int and e < 0]
    own = [at for at, e in enumerate(out) if type(e) is int and e >= 0]  # the piece's own tensors freed
    return (out, list(places), {name: list(d.items()) for name, d in after.items()}, allocations,
            (relative, from_before, own))
