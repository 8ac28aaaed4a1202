"""What the traced order would change in memplan's verdict (issue 20 item 1): memplan's stream of a recorded CUDA run
with every step's forward and backward replaced by the traced step of the real code (validation/layer_order.py:
every allocation and free in order, the sizes at the run's s and b), replayed through memplan's allocator model and
set beside the recording and memplan's own stream. An experiment, not memplan's stream (memplan/memory/stream.py
does not read the traced order yet).

The splice: memplan's events of the build and the optimizer are kept; of each step's forward and backward only
cuBLAS's workspaces (kept; the trace sees no kernel's own buffers) and the frees of tensors made before the step; the
traced step's events follow, each workspace put where cuBLAS makes it (`workspace_points`): right after the output of
the first matmul of its thread, the forward's (layer 0's q_proj) and autograd's (lm_head's weight gradient), as every
CUDA recording has them; its tensors still alive after the backward (the .grad tensors) are freed after the optimizer
step, where memplan's zero_grad frees its own. With the workspaces there the splice replays the max_memory_reserved of
the 14 committed recordings that trained to the byte but one (2.1 MB short) and the H100's verdict at all 24 recorded
llama3-8b lengths; put at the step's start instead, the 32 MiB blocks sit elsewhere in step 1's segments, the
lazily made AdamW states land in other cached blocks, and llama3-8b with foreach AdamW and checkpointing replayed as
fitting at 10,898 and 11,922 tokens, where the runs died (1.19 GB less stranded in partly used segments at 10,898).
What the trace cannot see is missing here too unless fitted ones are added (``kernel_buffers``: cuDNN attention's
backward workspace, the CUDA reduction's staging buffers; validation/layer_match.py names them): on the recorded
llama3-8b runs they move no figure by a MB (freed at once, they fit in blocks the allocator has cached).

    PYTHONPATH=. python -m validation.layer_replay tests/data/alloc/cuda/*.json.gz
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Callable

import memplan
from memplan.check.allocator import ALLOCATOR_CASES, MAX_SEQ_CASES
from memplan.check.peak import card_preset, peak_config
from memplan.memory.allocator import replay_ops
from memplan.memory.reserved import allocation_stream, allocator_config, replay_stream

from .alloc_trace import load
from .layer_match import traced_steps
from .trace_poly import evaluate


CUDNN_BACKWARD = "ScaledDotProductCudnnAttentionBackward0: _scaled_dot_product_cudnn_attention_backward"


def kernel_buffers(case: dict) -> Callable:
    """The kernels' own buffers after a traced allocation, fitted to the H100 recordings (tests/data/alloc/cuda; not
    derived from the kernels' code): ``(event, next event, bytes) -> [bytes of each buffer]``, each made and freed
    at once. cuDNN attention's backward, after dv: a workspace of s b a (8 d + 4) + 256 B (exact at every recorded
    length of both models); CUDA's reduction kernel staging a global reduction (and 128 B of semaphores) for the
    RMSNorm weight gradients' sums over s b rows: min(s b rounded up to 64, 4,224) x 8 h B (llama3-8b's recordings,
    h 4,096; none at the small runs' 512 rows of h 256)."""
    s, b, a, h = case["s"], case["b"], case["a"], case["h"]
    d = case.get("head_dim") or h // a

    def after(event: tuple, following: tuple | None, nbytes: int) -> list[int]:
        if event[3] == CUDNN_BACKWARD and (following is None or following[0] != "+" or following[3] != CUDNN_BACKWARD):
            return [s * b * a * (8 * d + 4) + 256]
        if event[3] == "MulBackward0: sum" and nbytes == 2 * h and h >= 4096:
            return [min(-(-s * b // 64) * 64, 4224) * 8 * h, 128]
        return []

    return after


MATMULS = ("mm", "addmm", "bmm", "matmul", "_scaled_mm")


def workspace_points(traced: list[tuple]) -> list[int]:
    """Where cuBLAS makes its workspaces in a traced step: after the output of the first matmul the forward runs and
    after the first the backward runs (autograd's device thread has its own handle), as the traced events' positions
    (an event "+" labelled "module: op"). In every H100 recording (tests/data/alloc/cuda) the 32 MiB workspace request
    follows layer 0's q_proj output and lm_head's weight gradient (tests/test_layer_order.py
    `test_workspaces_as_recorded`)."""
    points: list[int] = []
    for phase in ("forward", "backward"):
        points += [next((k for k, e in enumerate(traced) if e[0] == "+" and e[2][0] == phase
                         and e[3].rsplit(": ", 1)[-1] in MATMULS), len(traced) - 1)]
    return points


def spliced_ops(stream, traced: list[tuple], s: int, b: int, buffers: Callable | None = None) -> list[int]:
    """memplan's ``stream`` (an ``AllocationStream``) with each step's forward and backward replaced by the
    ``traced`` step (``layer_order.step_order`` events), in the compact form ``replay_ops`` reads; ``buffers``:
    the kernels' own buffers to add (``kernel_buffers``)."""
    events = stream.events
    phases = stream.phases
    out: list[tuple] = []  # ("+", size, key) / ("-", key)
    dropped: set = set()
    points = workspace_points(traced)
    for (name, start), (_, end) in zip(phases, phases[1:]):
        if name.startswith("step "):
            at: dict = {}  # memplan's workspaces by the traced event they follow
            for e in events[start:end]:
                if type(e).__name__ == "Alloc":
                    if e.kind == "workspace":
                        at.setdefault(points["(backward)" in e.name], []).append(("+", e.size, ("m", e.id)))
                    else:
                        dropped.add(e.id)
                elif e.id not in dropped:
                    out.append(("-", ("m", e.id)))
            step = name
            alive: dict = {}
            made = 0
            for k, e in enumerate(traced):
                if e[0] == "+":
                    key = ("t", step, made)
                    alive[made] = key
                    nbytes = evaluate(e[1], s, b)
                    out.append(("+", nbytes, key))
                    out += at.pop(k, [])
                    extra = buffers(e, traced[k + 1] if k + 1 < len(traced) else None, nbytes) if buffers else []
                    out += [("+", x, key + (j,)) for j, x in enumerate(extra)]
                    out += [("-", key + (j,)) for j in reversed(range(len(extra)))]
                    made += 1
                else:
                    out.append(("-", alive.pop(e[1])))
            out += [w for ws in at.values() for w in ws]  # a workspace whose matmul the trace lacks: after the step
            left = list(alive.values())
            continue
        for e in events[start:end]:
            if type(e).__name__ == "Alloc":
                out.append(("+", e.size, ("m", e.id)))
            elif e.id not in dropped:
                out.append(("-", ("m", e.id)))
        if name.startswith("optimizer step "):
            out += [("-", key) for key in left]
    number: dict = {}
    ops = []
    for e in out:
        if e[0] == "+":
            number[e[2]] = len(number)
            ops.append(e[1])
        else:
            ops.append(~number[e[1]])
    return ops


def verdicts(runs_file: Path, recording: Path) -> None:
    """memplan's verdict and the traced order's at every recorded llama3-8b length (h100_runs.json), on the H100
    preset's capacity (what ``memplan estimate`` replays on); ``recording``: one llama3-8b recording (its model)."""
    model = load(recording).case
    traced = traced_steps(model)
    workspace = card_preset("NVIDIA H100 80GB HBM3").workspace_bytes
    print("plan | allocator | s | the H100 | memplan's stream | the traced order | with the kernels' buffers")
    for run in json.loads(runs_file.read_text(encoding="utf-8"))["runs"]:
        case = next(c for c in MAX_SEQ_CASES if c.name == run["case"])
        s = run["seq_len"]
        reserved = memplan.estimate("llama3-8b", impl="hf-sdpa", gpu="h100-80gb", gpus=1, global_batch=1,
                                    precision="bf16-true", recompute=case.recompute, optimizer_impl=case.optimizer,
                                    seq_len=s, allocator=run["allocator"]).estimate.reserved
        stream = allocation_stream(peak_config(dataclasses.replace(case, s=s)), case.impl, "cuda",
                                   workspace_bytes=workspace)
        fits = [replay_ops(spliced_ops(stream, traced[case.recompute], s, model["b"], extra),
                           reserved.capacity_bytes, allocator_config(run["allocator"])).fits
                for extra in (None, kernel_buffers({**model, "s": s}))]
        word = {True: "fits", False: "dies"}
        print(f"{run['case']} | {run['allocator']} | {s:,} | {run['run']} | {word[reserved.fits]} | "
              f"{word[fits[0]]} | {word[fits[1]]}")


def died(recorded: int | None, *replays) -> str:
    """The request a recorded run died at and each replay's ("-": trained; a recording stops at its out-of-memory)."""
    return " / ".join(f"{x:,}" if x else "-" for x in [recorded] + [r.oom.requested_bytes if r.oom else None
                                                                    for r in replays])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.layer_replay", description=__doc__.split("\n")[0])
    p.add_argument("recordings", nargs="+", help="CUDA recordings (tests/data/alloc/cuda/*.json.gz)")
    p.add_argument("--verdicts", help="h100_runs.json: the verdicts at its lengths (the recordings: one llama3-8b)")
    a = p.parse_args(argv)
    if a.verdicts:
        verdicts(Path(a.verdicts), Path(a.recordings[0]))
        return 0
    workspace = card_preset("NVIDIA H100 80GB HBM3").workspace_bytes
    traces: dict = {}
    print("recording | allocator | recorded reserved (MB = 1e6 B) | memplan's stream | the traced order | with the "
          "kernels' buffers | recorded allocated peak | memplan's | the traced order | with the kernels' buffers "
          "| the request each died at (B) (differences from the recording)")
    for path in a.recordings:
        rec = load(path)
        c = rec.case
        key = (c["h"], c["L"])
        if key not in traces:
            traces[key] = traced_steps(c)
        case = next(x for x in ALLOCATOR_CASES + MAX_SEQ_CASES if x.h == c["h"] and x.L == c["L"]
                    and x.optimizer == c["optimizer"] and x.recompute == c["recompute"])
        case = dataclasses.replace(case, s=c["s"])
        stream = allocation_stream(peak_config(case), case.impl, "cuda", workspace_bytes=workspace)
        small = c["L"] == 2  # the small runs shared the GPU: no capacity (tests/test_alloc_stream_cuda.py)
        capacity = (1 << 40) if small else rec.stats["total_memory"] - rec.stats["outside_pool_bytes"]
        allocator = "expandable" if "expandable_segments:True" in rec.alloc_conf else "default"
        config = allocator_config(allocator)
        ours = replay_stream(stream, capacity, config)
        spliced, buffered = (replay_ops(spliced_ops(stream, traces[key][c["recompute"]], c["s"], c["b"], extra),
                                        capacity, config) for extra in (None, kernel_buffers(c)))
        measured, peak = rec.stats["max_memory_reserved"], rec.live_peak_bytes

        def shown(x: int, truth: int, fits: bool = True) -> str:
            return f"{x / 1e6:,.1f} ({(x - truth) / 1e6:+,.2f}){'' if fits else ' dies'}"

        print(f"{Path(path).name.split('.')[0]} | {allocator} | {measured / 1e6:,.1f} | "
              f"{shown(ours.reserved_peak_bytes, measured, ours.fits)} | "
              f"{shown(spliced.reserved_peak_bytes, measured, spliced.fits)} | "
              f"{shown(buffered.reserved_peak_bytes, measured, buffered.fits)} | {peak / 1e6:,.1f} | "
              f"{shown(ours.requested_peak_bytes, peak)} | {shown(spliced.requested_peak_bytes, peak)} | "
              f"{shown(buffered.requested_peak_bytes, peak)} | {died(rec.stats.get('oom_request_bytes'), ours, spliced)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
