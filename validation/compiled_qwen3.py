"""What torch.compile keeps for the backward of one torchtitan 0.3.0 dense Qwen3 block (``--compile`` on a dense
Qwen3, memplan/inventory/compiled_qwen3.py): validation/compiled.py ``trace_compiled_layer(qwen3=True)`` builds the
block with validation/titan.py ``build_block(Shape(qwen3=True, d=...))`` (torchtitan's own ``_build_qwen3_layers``,
bf16, q_norm / k_norm, CosSinRoPE, the sdpa stand-in for FlexAttention), wraps it in torchtitan's AC, compiles it
with inductor (dynamic s, b), reads the forward graph's saved tensors and measures the bytes alive after the
forward at S, B (torch.profiler's allocation events).  Its backward moments: validation/compiled_backward.py
``qwen3`` (QWEN3_SHAPES).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m validation.compiled_qwen3 [none|selective-op|full] [S B] [inductor|aot]

Nothing here computes a byte count from a formula: the trace reads the graph, the measurement reads allocations.
"""

from __future__ import annotations

import sys

from validation.compiled import trace_compiled_layer


def main(argv: list[str]) -> None:
    shape = dict(s=int(argv[1]), b=int(argv[2])) if argv[2:] else {}
    r = trace_compiled_layer(argv[3] if argv[3:] else "inductor", "torchtitan", ac=argv[0] if argv else "none",
                             qwen3=True, **shape)
    for t in r.saved:
        print(f"{t.node:24} {t.kind:10} {t.dtype:9} {t.elements}")
    print(f"s={r.s} b={r.b}: after forward {r.after_forward} B (output {r.output_bytes} B), eager "
          f"{r.eager_after_forward} B")


if __name__ == "__main__":
    main(sys.argv[1:])
