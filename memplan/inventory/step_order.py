"""A traced training step's allocations and frees in the real code's order (issue 20): the optional `step_order` of a
traced inventory file (validation/layer_order.py `step_row` writes it, `memplan trace --layer-order`), its schema
(`StepOrder`), and its expansion into the model's whole step (`expand`), which memplan/memory/stream_traced.py makes
the run's allocation stream from.

The file keeps the step of the traced model (the first decoder layer, one in the middle and the last two: a dense
model's 0, n - 2 and n - 1; validation/compose.py) compactly: the pieces outside the decoder layers (`before` the
first layer's forward: the batch, the embedding, the rotary tables; `middle`: the final norm, the head, the loss and
their backward; `after` the first layer's backward: the embedding's), once; each distinct layer's forward, re-run
(gradient checkpointing) and backward once (`templates`), and the template of each of the model's layers
(`layers`). The expansion joins them: `before`, every layer's forward from the first, `middle`, every layer's re-run
and backward from the last, `after`. An entry is an allocation (its size, a polynomial in s and b), a free (the
index of an allocation of the piece's owner: the layer's, counted over its forward, re-run and backward, or the
outside's, counted over its three pieces; "O:i" the outside's i-th; "L-1:i" / "L+1:i" the layer below's / above's;
"L@j:i" layer j's, from outside) or "W1" / "W2": cuBLAS's workspace of the forward's / autograd's thread, after the
output of the first matmul the thread runs, where every CUDA recording makes it (tests/test_layer_order.py).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict

from memplan.core.errors import MemplanError
from memplan.core.symbolic import Poly
from memplan.core.training import Recompute

PIECES = ("forward", "rerun", "backward")  # a decoder layer's pieces, as validation/layer_order.py names them
WORKSPACES = ("W1", "W2")  # cuBLAS's workspace of the forward's thread, of autograd's (the backward's)
_REF = re.compile(r"(O|L[+-]\d+|L@\d+):(\d+)")
Entry = Union[int, str]


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StepTemplate(_Row):
    """One decoder layer's pieces (validation/layer_order.py `layer_pieces`' in step_order's entries)."""

    forward: list[Entry] = []
    rerun: list[Entry] = []
    backward: list[Entry] = []


class StepOrder(_Row):
    """The whole step of one run (without gradient checkpointing: recompute none; with it: full)."""

    recompute: Literal["none", "full"]
    layers: list[int]
    templates: list[StepTemplate]
    before: list[Entry] = []
    middle: list[Entry] = []
    after: list[Entry] = []


def expand(order: StepOrder, num_layers: int, where: str = "step_order") -> tuple[tuple, ...]:
    """The model's whole step: ("+", size Poly, label) allocations numbered in order from 0, ("-", allocation
    number) frees, ("W", thread) workspaces (1: the forward's, 2: the backward's). A free of an allocation not
    made or freed already, an unknown template or a size that is not a polynomial in s and b: MemplanError.
    Each distinct size is one Poly object. Kept per order (a file read once is expanded once)."""
    hit = _EXPANDED.get((id(order), num_layers))
    if hit is not None and hit[0] is order:
        return hit[1]
    out = _expand(order, num_layers, where)
    _EXPANDED[id(order), num_layers] = (order, out)
    return out


_EXPANDED: dict[tuple[int, int], tuple[StepOrder, tuple]] = {}  # the order kept alive while its id is a key


def _expand(order: StepOrder, num_layers: int, where: str) -> tuple[tuple, ...]:
    if len(order.layers) != num_layers:
        raise MemplanError(f"{where}: {len(order.layers):,} layers' templates for a model of {num_layers:,} layers")
    if any(not 0 <= t < len(order.templates) for t in order.layers):
        raise MemplanError(f"{where}: layers name a template the file does not have (0..{len(order.templates) - 1})")
    out: list[tuple] = []
    made: dict = {}  # (owner, index in the owner) -> allocation number; owner "out" or a layer
    counts: dict = {}
    live: set = set()
    polys: dict[str, Poly] = {}
    threads: set = set()

    def run(entries: list, who, label: str) -> None:
        for entry in entries:
            if isinstance(entry, int):
                key = (who, entry)
            elif entry in WORKSPACES:
                thread = WORKSPACES.index(entry) + 1
                if thread not in threads:  # made once, kept (a template's copies in other layers: not again)
                    threads.add(thread)
                    out.append(("W", thread))
                continue
            elif (m := _REF.fullmatch(entry)) is not None:
                ref, index = m.group(1), int(m.group(2))
                key = ("out" if ref == "O" else int(ref[2:]) if ref[1] == "@" else who + int(ref[1:]), index)
            else:
                if entry not in polys:
                    polys[entry] = _size(entry, where)
                made[who, counts.get(who, 0)] = len(made)
                counts[who] = counts.get(who, 0) + 1
                live.add(len(made) - 1)
                out.append(("+", polys[entry], label))
                continue
            n = made.get(key, -1)
            if n not in live:
                raise MemplanError(f"{where}: {label} frees {entry!r}, not a live allocation")
            live.discard(n)
            out.append(("-", n))

    run(order.before, "out", "embedding")
    for j in range(num_layers):
        run(order.templates[order.layers[j]].forward, j, f"layer {j + 1} forward")
    run(order.middle, "out", "head and loss")
    for j in reversed(range(num_layers)):
        template = order.templates[order.layers[j]]
        run(template.rerun, j, f"layer {j + 1} recomputed")
        run(template.backward, j, f"layer {j + 1} backward")
    run(order.after, "out", "embedding backward")
    return tuple(out)


def _size(text: str, where: str) -> Poly:
    try:
        poly = Poly.parse_sum(text)
    except (MemplanError, ValueError, ZeroDivisionError, IndexError):
        raise MemplanError(f"{where}: {text[:60]!r} is neither a size (a polynomial in s and b) nor a free") from None
    if {sym for mono, _ in poly.terms for sym, _ in mono} - {"s", "b"}:
        raise MemplanError(f"{where}: size {text[:60]!r} uses symbols other than s and b")
    return poly


def runs_traced(rows: tuple, plan: Any) -> Any:
    """Which plans (memplan/memory/term_bytes.py PlanValues: scalars, or arrays of candidates) run the code a traced
    step's order is of, `rows` (Inventory.step_order: (recompute, layers, events) of each run traced): one GPU (no
    tensor, pipeline, context or data parallelism), one model chunk, one micro-batch per step (a second one adds
    into the .grad tensors: other code), gradient checkpointing of no layer or of every layer as traced."""
    one = (plan.t == 1) & (plan.p == 1) & (plan.d == 1) & (plan.cp == 1) & (plan.m == 1) & (plan.microbatches == 1)
    traced = False
    for recompute, layers, _ in rows:
        if recompute == "none":
            traced = traced | (plan.recompute == int(Recompute.NONE))
        else:
            traced = traced | ((plan.recompute == int(Recompute.FULL)) & (plan.recomputed_layers == layers))
    return one & traced
