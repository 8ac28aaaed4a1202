"""torch.compile on torchtitan 0.3.0's dense Qwen3 block (``--impl torchtitan --compile`` on a dense Qwen3, tp 1, cp 1):
what AOTAutograd's partitioner saves for the backward of one compiled block (memplan/inventory/compiled.py
``compiled_terms(qwen3=True)``), the block as torchtitan's Trainer calls it, with the dataloader's positions.

Qwen3's block is Llama 3's (memplan/inventory/compiled.py TITAN_LAYER, TITAN_SAC) with q_norm / k_norm (RMSNorm per
head over q and k before RoPE) and CosSinRoPE (the cos and sin rows gathered at the positions, fp32 2d, in place of
Llama 3's complex64 d/2 rows).  TRACED, not guessed: validation/compiled.py ``trace_compiled_layer(qwen3=True)``
builds torchtitan's own block (``_build_qwen3_layers``, bf16, the sdpa stand-in for FlexAttention; h 40, a 6, g 2,
head width 8 so that q = a d = 48 differs from h, f 154), wraps it in torchtitan's AC (none, full, selective-op with
its shipped save list), compiles it with torch 2.13's inductor on CPU with dynamic s, b and reads the forward graph's
saved tensors (each a polynomial in s, b and the widths); the same compiled block's bytes alive after its forward
are measured on real tensors (torch.profiler's allocation events) at two shapes (tests/test_compiled_qwen3.py).

What the partitioner keeps (per token, bf16 = 2 B):
* none: TITAN_LAYER's set without Llama's complex64 rows, plus QWEN3_ROWS: q_norm's and k_norm's bf16 input (q and
  g d) and fp32 rstd (a and g), and the cos and sin rows gathered at the positions (fp32 2d).  At the traced widths:
  832 B attention and norms + 3 x 308 B FFN = 1,756 B per token (eager: 2,928 B);
* selective-op: TITAN_SAC's set, the same as Llama 3's: the block input, the fused QKV's output, the attention's
  output and log-sum-exp, w1's output (668 B per token at the traced widths): q_norm, k_norm and RoPE are
  recomputed (the block keeps the positions, which the training loop holds);
* full: the block input (FullAC's CPU generator state left out, as for Llama 3's block).

The backward's moments: memplan/inventory/compiled_qwen3_moments.py (measured).

Not traced, refused in one line: --tp (the dense block's TP trace is Llama 3's), --float8, --ac budget:F (traced at
Llama 3's widths), --cp (as for Llama 3).  With --pp each stage's compiled blocks save the same set (derived).
"""

from __future__ import annotations

from memplan.core.errors import MemplanError
from memplan.inventory.compiled_moe import TABLE as MOE_TABLE

SRC = ("traced from torch.compile's partitioner on torchtitan 0.3.0's dense Qwen3 block (torch 2.13, inductor on CPU, "
       "dynamic s, b; validation/compiled.py trace_compiled_layer(qwen3=True)) and measured after its forward at two "
       "shapes (tests/test_compiled_qwen3.py)")
# q_norm / k_norm's saves and CosSinRoPE's gathered rows: the same rows as the Qwen3 MoE block's attention (its table,
# compiled_moe.TABLE, one place), traced again on the dense block (tests/test_compiled_qwen3.py); kept under AC none only
QK_IDS = ("q_norm_input", "k_norm_input", "q_norm_rstd", "k_norm_rstd", "rope_rows")
QWEN3_ROWS = tuple(row[:5] for row in MOE_TABLE if row[0] in QK_IDS)
TP_REFUSAL = ("--compile with --tp on a dense Qwen3 is not traced (the compiled block is traced per TP rank for "
              "Llama 3 only; memplan/inventory/compiled_qwen3.py): --tp 1, or drop --compile")


def check(training) -> None:
    """What of a compiled dense Qwen3 is not traced: float8 linears (refused in one line; the memory-budget AC is
    refused by compiled.check_budget: traced at Llama 3's widths)."""
    if training.float8:
        raise MemplanError("--compile --float8 on a dense Qwen3 is not traced (the float8 block is traced for Llama 3): "
                           "drop --float8")


def left(tp: int) -> str:
    """Why a compiled dense Qwen3 layout is not modelled ("" when it is)."""
    return TP_REFUSAL if tp > 1 else ""


def notes(pp: int = 1) -> list[str]:
    """What estimate says of a compiled dense Qwen3."""
    return [f"--compile on torchtitan's dense Qwen3 blocks: their saved tensors {SRC}; their backward moments "
            "measured: Inductor's generated backward replayed with s, b symbolic and run under torch.profiler "
            "(memplan/inventory/compiled_qwen3_moments.py; the CPU kernels' own scratch left out; FSDP2 and CUDA "
            "derived); the loss is not compiled"
            + ("; with --pp each stage's compiled blocks save the same set (derived)" if pp > 1 else "")]
