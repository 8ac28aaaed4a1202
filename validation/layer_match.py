"""How much of a decoder layer's recorded allocations an allocation stream reproduces (issue 20 item 5): "memplan's own
stream for the same run must match the recorded one event for event where the code is the same". Measures only
(validation/ never imports memplan): benchmarks/layer_match.py prints the figures for every recording.

A CUDA recording (validation/alloc_trace.py, tests/data/alloc/cuda) has no stack traces: its events are sizes and
addresses in order. The layers are found in it with the trace of the same code (validation/layer_order.py: the step
under FakeTensorMode with symbolic s and b, CUDA's kernels emulated), whose events know their phase and layer:

* the recording's step 2 starts at the last place where the loop's batch is made: two int64 s x b tensors (the input
  ids and the labels, 8 s b bytes each), then the embedding's output (2 h s b bytes, bf16), read off the loop
  (validation/step.py) and transformers' Llama;
* the traced step is cut into pieces (what happens outside the layers, each layer's forward, re-run and backward) and
  each piece, in order, is aligned with the recording from where the previous one ended (the longest common
  subsequence of the allocations' sizes within a window three times the piece's length): a piece's recorded window
  runs from after the previous piece's last matched request to its own last matched request, so a request no piece
  matches belongs to the piece after it;
* in a layer's windows each allocation source is scored by the longest common subsequence of sizes with the
  recorded requests (same size, same order): the trace's own piece, and memplan's stream's events of that layer
  (named "..., layer j, ...": forward before the stream's first backward event, "recomputed" the re-run, the rest
  the backward; benchmarks/layer_match.py reads them off memplan's stream).

What no trace can see is what a kernel allocates inside itself through the caching allocator (cuDNN's attention
backward workspace, cuBLAS's workspace: `unmatched` lists the recorded requests the trace misses, by size).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .layer_order import PIECES, piece_of
from .trace import trace_hf_config
from .trace_poly import evaluate

def lcs_pairs(a: list[int], b: list[int]) -> list[tuple[int, int]]:
    """A longest common subsequence of a and b as (index in a, index in b) pairs, in order (dynamic programming, one
    numpy row at a time: row[j] = the running maximum of max(above[j], above[j - 1] + (a[i] == b[j]))."""
    n, m = len(a), len(b)
    if not n or not m:
        return []
    bb = np.asarray(b, dtype=np.int64)
    table = np.zeros((n + 1, m + 1), dtype=np.int32 if n * m < 1 << 22 else np.int16)
    for i in range(n):
        above = table[i]
        cand = np.maximum(above[1:], above[:-1] + (bb == a[i]))
        table[i + 1, 1:] = np.maximum.accumulate(cand)
    pairs, i, j = [], n, m
    while i and j:
        if a[i - 1] == b[j - 1] and table[i, j] == table[i - 1, j - 1] + 1:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif table[i - 1, j] >= table[i, j - 1]:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


def lcs_length(a: list[int], b: list[int]) -> int:
    return len(lcs_pairs(a, b))


def recorded_allocations(events: list) -> list[int]:
    """The requested sizes of a recording's allocations, in order."""
    return [size for op, _, size, _ in events if op == "alloc"]


def step_start(sizes: list[int], s: int, b: int, h: int) -> int:
    """The allocation number where the recording's last step starts (the loop's batch, then the embedding)."""
    pattern = (8 * s * b, 8 * s * b, 2 * h * s * b)
    starts = [k for k in range(len(sizes) - 2) if tuple(sizes[k:k + 3]) == pattern]
    if not starts:
        raise ValueError("no step start (two int64 s x b tensors, then the embedding's output) in the recording")
    return starts[-1]


def traced_pieces(events: list[tuple], s: int, b: int, layers: int) -> list[tuple]:
    """The traced step's allocations as pieces in order: (piece name, layer or None, sizes at (s, b))."""
    out: list[tuple] = []
    for e in events:
        if e[0] != "+":
            continue
        layer = e[2][1]
        name = next((p for p in PIECES if layer is not None and piece_of(e[2], layer) == p), "outside")
        key = (name, layer)
        if not out or out[-1][:2] != key:
            out.append((name, layer, []))
        out[-1][2].append(evaluate(e[1], s, b))
    return out


@dataclass
class PieceMatch:
    """One piece of a layer: the recorded requests of its window, how many each source reproduces."""

    piece: str
    recorded: list[int]
    traced: int  # of the recorded requests, reproduced by the trace (same size, same order)
    traced_total: int
    memplan: int  # reproduced by memplan's stream
    memplan_total: int
    unmatched: list[int] = field(default_factory=list)  # recorded requests the trace does not reproduce


def align(recorded: list[int], pieces: list[tuple]) -> list[tuple[int, int]]:
    """Each traced piece's recorded window, [start, end) in ``recorded`` (``recorded`` from the step's start): the
    whole traced step aligned with it at once (``lcs_pairs``); a piece's window runs from after the previous piece's
    last matched request to its own last one."""
    traced = [x for _, _, sizes in pieces for x in sizes]
    last = [-1] * len(traced)
    for i, j in lcs_pairs(traced, recorded):
        last[i] = j
    windows, pos, k = [], 0, 0
    for _, _, sizes in pieces:
        end = max([pos - 1] + last[k:k + len(sizes)]) + 1
        windows.append((pos, end))
        pos, k = end, k + len(sizes)
    return windows


def match_layer(recorded_events: list, traced_events: list[tuple], case: dict, layer: int,
                memplan: dict[str, list[int]]) -> list[PieceMatch]:
    """The pieces of decoder layer ``layer`` (0-based) in the recording's last step: the recorded requests of each,
    and how many the trace and memplan's stream (``memplan_pieces``) reproduce."""
    s, b, h = case["s"], case["b"], case["h"]
    sizes = recorded_allocations(recorded_events)
    recorded = sizes[step_start(sizes, s, b, h):]
    pieces = traced_pieces(traced_events, s, b, case["L"])
    windows = align(recorded, pieces)
    out = []
    for (name, where, traced), (lo, hi) in zip(pieces, windows):
        if where != layer:
            continue
        window = recorded[lo:hi]
        pairs = lcs_pairs(window, traced)
        hit = {i for i, _ in pairs}
        ours = memplan.get(name, [])
        out.append(PieceMatch(name, window, len(pairs), len(traced), lcs_length(window, ours), len(ours),
                              [x for i, x in enumerate(window) if i not in hit]))
    return out


@dataclass
class StepMatch:
    """The recording's last step (from its batch to its end, the optimizer step included) against the whole traced
    step: allocations reproduced in order, and, of the reproduced ones, the events (allocations and frees) in the
    same order in both."""

    recorded: int  # allocations from the step's start to the recording's end
    traced: int
    matched: int
    events_traced: int  # allocations and frees of the matched allocations in the trace (frees within the step)
    events_in_order: int  # of those, in the recorded order (a longest common subsequence)
    unmatched: dict = field(default_factory=dict)  # recorded sizes the trace does not make (count by size)


def match_step(recorded_events: list, traced_events: list[tuple], case: dict) -> StepMatch:
    """``StepMatch`` of a recording and the trace of its step (``layer_order.step_order``)."""
    s, b = case["s"], case["b"]
    sizes = recorded_allocations(recorded_events)
    start = step_start(sizes, s, b, case["h"])
    recorded = sizes[start:]
    traced = [evaluate(e[1], s, b) for e in traced_events if e[0] == "+"]
    pairs = lcs_pairs(traced, recorded)
    of_recorded = {j + start: i for i, j in pairs}
    mine: list[int] = []  # the recorded events of matched allocations, as 2 i (+1 for a free), i the traced index
    live: dict = {}
    n = 0
    for op, address, _, _ in recorded_events:
        if op == "alloc":
            if n in of_recorded:
                live[address] = of_recorded[n]
                mine.append(2 * of_recorded[n])
            n += 1
        elif address in live:
            mine.append(2 * live.pop(address) + 1)
    matched = set(of_recorded.values())
    theirs: list[int] = []
    n = 0
    for e in traced_events:
        if e[0] == "+":
            if n in matched:
                theirs.append(2 * n)
            n += 1
        elif e[1] in matched:
            theirs.append(2 * e[1] + 1)
    hit = {j for _, j in pairs}
    unmatched: dict = {}
    for j, x in enumerate(recorded):
        if j not in hit:
            unmatched[x] = unmatched.get(x, 0) + 1
    return StepMatch(len(recorded), len(traced), len(pairs), len(theirs), lcs_length(theirs, mine), unmatched)


def llama_config(case: dict) -> dict:
    """The transformers config.json of a recorded Llama case (validation/hf.py ``build_config``'s fields)."""
    cfg = {"model_type": "llama", "hidden_size": case["h"], "intermediate_size": case["f"],
           "num_attention_heads": case["a"], "num_key_value_heads": case["g"] or case["a"],
           "num_hidden_layers": case["L"], "vocab_size": case["v"], "max_position_embeddings": case["s"],
           "tie_word_embeddings": False, "attention_dropout": case["p_drop"], "bos_token_id": 0, "eos_token_id": 0}
    return {**cfg, **({"head_dim": case["head_dim"]} if case.get("head_dim") else {})}


def traced_steps(case: dict) -> dict[str, list[tuple]]:
    """The whole step of a recorded case's model traced in order (every layer, CUDA's kernels), by recompute."""
    steps: dict = {}
    trace_hf_config(llama_config(case), kernels="cuda", compose=False, layer_order=True, steps=steps)
    return steps
