"""What torchtitan's compiled Qwen3 MoE and DeepSeek-V3 blocks hold inside their backward: Inductor's generated
backward replayed with s, b symbolic and measured on CPU (validation/compiled_backward.py's ``compile_block``,
``replay``, ``front``, ``measure``, run on these blocks).

The blocks are validation/compiled_moe.py's (torchtitan's Qwen3 MoE block at h 40, q 48, a 6, g 2, d 8, fe 24, E 10,
k 4) and validation/compiled_dsv3.py's (DeepSeek-V3's dense first layer and MoE layer at its SHAPE, FlexAttention
stood in by ``flex_lse``), wrapped as torchtitan's AC modes wrap them (none, full, selective-op), compiled with
Inductor dynamic in s, b (``capture_scalar_outputs`` on, as torchtitan's apply_compile sets it) and called with the
dataloader's positions.  The router's own top-k routes the tokens (no forced balance): at ep 1 every routed size is
k s b rows whatever the routing (torchtitan's token dispatch pads nothing on CPU), so the generated backward's buffers
are polynomials in s, b, the data-dependent part being only the grouped GEMMs' offsets' values (an E-sized int32
input of the backward, its ``cumsum``: the replay binds no unbacked size, and the expert GEMMs run as the fake
``aten._grouped_mm``, their outputs sized k s b rows or E whole weights).

DeepSeek-V3's stand-in attention (``flex_lse``) takes its backward as one custom op (``flex_lse_backward``), as torch's
FlexAttention backward is one kernel: its s x s temporaries are that op's own (the measurement's scratch), the replay
sees its dQ, dK, dV (before, Inductor decomposed the stand-in's formula and the generated backward held the s x s
scores: not a s b + d s + c).  memplan models the Qwen3 MoE block's moments (memplan/inventory/compiled_moe_moments.py);
DeepSeek-V3's are recorded here, not modelled yet.

The replay's front leaves out the backward's token-less saved inputs (the grouped GEMMs' int32 offsets, E x 4 B, and
route_scale, 4 B: roles "param", as for the Llama block the CPU generator state): the measured peak holds those that
are alive at it.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m validation.compiled_moe_backward tests/data/compiled_moe_backward.json

Nothing here computes a byte count from a formula: the replay reads the generated code, the measurement reads
allocations.
"""

from __future__ import annotations

import torch

from .compiled_backward import compile_block, front, measure, replay, write_recording
from .titan import AC_MODES

SIZES = ((32, 2), (64, 3))  # (s, b) of the measured runs (validation/compiled_backward.py SIZES)
BLOCKS = ("qwen3-moe", "dsv3-dense", "dsv3-moe")


def build(kind: str, ac: str):
    """(shape, the block wrapped for ``ac``) of ``kind`` (BLOCKS)."""
    torch.manual_seed(0)
    if kind == "qwen3-moe":
        from .compiled_moe import SHAPE
        from .titan_moe import build_moe_block, wrap_ac

        return SHAPE, wrap_ac(build_moe_block(SHAPE, balanced=False), ac)
    from . import compiled_dsv3

    return compiled_dsv3.SHAPE, compiled_dsv3.build(compiled_dsv3.SHAPE, kind == "dsv3-moe", ac)


def run(kind: str, ac: str) -> dict:
    """One block under one AC mode: ``measured`` at SIZES and the replay's ``front`` (one row per (a, d, c))."""
    shape, block = build(kind, ac)
    c = compile_block(ac, shape, block=block)
    measured = [{"s": s, "b": b, **measure(c["compiled"], shape.h, s, b, ac)} for s, b in SIZES]
    samples, roles = replay(c["source"], c["graph"])
    rows = {(r["a"], r["d"], r["c"]): r for r in front(samples, roles)}
    return {"block": kind, "ac": ac, "measured": measured, "front": list(rows.values())}


def record(path: str, kinds: tuple = BLOCKS) -> None:
    """Every block of ``kinds`` under every AC mode, written as JSON (tests/data/compiled_moe_backward.json)."""
    import json

    cases = []
    for kind in kinds:
        for ac in AC_MODES:
            cases.append(run(kind, ac))
            print(json.dumps({k: cases[-1][k] for k in ("block", "ac", "measured")}), flush=True)
    write_recording(path, f"validation.compiled_moe_backward {path}", cases)


if __name__ == "__main__":
    import sys

    record(sys.argv[1], tuple(sys.argv[2:]) or BLOCKS)
