"""What torch.compile keeps for the backward of one torchtitan 0.3.0 Qwen3 MoE block (``--compile`` on a Qwen3 MoE
model, memplan/inventory/compiled_moe.py).

torchtitan's apply_compile compiles each TransformerBlock whole (``block.compile(fullgraph=True)``, after AC wraps
it), the MoE blocks too, with ``torch._dynamo.config.capture_scalar_outputs = True`` for the token dispatch's
data-dependent sizes (torchtitan distributed/compile.py).  ``trace_moe_block`` builds the block as
validation/titan_moe.py does (``build_moe_block``: torchtitan's own ``_build_qwen3_moe_layers``, bf16, the sdpa
stand-in for FlexAttention, balanced routing: torchtitan's ``_debug_force_load_balance``), wraps it in torchtitan's
AC (``wrap_ac``: none, selective-op with its shipped save list), compiles it the same way and reads the forward
graph's saved tensors with validation/compiled.py ``trace_compiled_layer`` (inductor's partitioner, dynamic s, b;
each shape a polynomial in s, b and the widths, the routed copies' k s b rows included), then measures the same
compiled block's bytes alive after its forward with real tensors (torch.profiler's allocation events) and the eager
block's for comparison.

    PYTHONPATH=. python -m validation.compiled_moe [none|selective-op] [inductor|aot]

Nothing here computes a byte count from a formula: the trace reads the graph, the measurement reads allocations.
"""

from __future__ import annotations

import sys
import warnings

import torch

from validation.compiled import CompiledLayer, trace_compiled_layer
from validation.titan import loader_positions
from validation.titan_moe import MoeShape, build_moe_block, wrap_ac

# every width distinct (and none a product of two others that a shape could hold), so that a size names one field:
# q = a d = 48 differs from h; the routed copies' rows are k s b (k = 4)
SHAPE = MoeShape(h=40, a=6, g=2, d=8, fe=24, E=10, k=4)


def names(shape: MoeShape) -> dict[int, dict[str, int]]:
    """Each static width of ``shape`` as exponents of memplan's symbols (validation/compiled.py ``_dim``'s table)."""
    q = shape.a * shape.d
    table = {q: {"q": 1}, shape.h: {"h": 1}, shape.fe: {"fe": 1}, shape.a: {"a": 1}, shape.g: {"g": 1},
             shape.d: {"q": 1, "a": -1}, shape.g * shape.d: {"g": 1, "q": 1, "a": -1},
             shape.a // shape.g: {"a": 1, "g": -1}, (shape.a + 2 * shape.g) * shape.d: {"qkv": 1},
             shape.E: {"E": 1}, shape.k: {"k": 1}}
    if len(table) != 11:
        raise ValueError(f"the widths of {shape} are not distinct")
    return table


def trace_moe_block(ac: str = "none", route: str = "inductor", shape: MoeShape = SHAPE, s: int = 20,
                    b: int = 2, balanced: bool = False, positions: bool = True) -> CompiledLayer:
    """The compiled Qwen3 MoE block's saved tensors (dynamic s, b) and its bytes after the forward at s, b;
    ``balanced``: torchtitan's debug round-robin routing (its topk then computed and dropped: dynamo removes it, so
    the compiled block saves the round-robin ids instead), else the router's own top-k (the default: what a run
    routes by; at ep 1 no size depends on the routing, only the grouped GEMMs' offsets' values)."""
    torch.manual_seed(0)
    block = build_moe_block(shape, balanced=balanced)
    eager = wrap_ac(block, ac)

    def inputs(s: int, b: int, seed: int):
        torch.manual_seed(seed)
        pos = loader_positions(b, s) if positions else None  # a batch input, made before the measured window
        return (torch.randn(b, s, shape.h, dtype=torch.bfloat16, requires_grad=True),
                lambda layer, x: layer(x, None, pos))

    with warnings.catch_warnings(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        warnings.simplefilter("ignore")  # CPU autocast refuses fp32 (validation/titan_moe.py)
        return trace_compiled_layer(route, "torchtitan", ac=ac, built=(eager, inputs, names(shape)), s=s, b=b)


def main(argv: list[str]) -> None:
    r = trace_moe_block(argv[0] if argv else "none", argv[1] if argv[1:] else "inductor")
    for t in r.saved:
        print(f"{t.node:16} {t.kind:10} {t.dtype:9} {t.elements}")
    print(f"s={r.s} b={r.b}: after forward {r.after_forward} B (output {r.output_bytes} B), eager "
          f"{r.eager_after_forward} B")


if __name__ == "__main__":
    main(sys.argv[1:])
