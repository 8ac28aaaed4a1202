"""What torchtitan's memory-budget AC (``--ac budget:F --compile``: MemoryBudgetAC, activation_memory_budget = F)
RECOMPUTES in each compiled block's backward, per token and layer: TRACED from the same partitioned graphs whose
forward gives the saved set (memplan/inventory/compiled.py BUDGET_SAVED): torchtitan 0.3.0's Llama 3 block compiled
under FakeTensorMode at the Llama 3 8B / 70B / 405B widths with AOTAutograd and inductor's partitioner, its backward
graph's nodes that the joint graph tagged as forward read off (validation/budget_recompute.py; the block called with
the dataloader's positions, as torchtitan's Trainer calls it and BUDGET_SAVED is traced).

- BUDGET_LINEARS: the block's linears whose matmul the backward re-runs at F (tenths), the same at the three widths
  (traced). Their FLOPs per token follow from the widths: wqkv 2h(q + 2gd), wo 2qh, each FFN linear 2hf. By hand at
  F = 0 (only the block input saved): every tensor the backward reads is recomputed from the input, i.e. the whole
  forward but w2 (its output only feeds the residual sum, whose backward needs no tensor), as traced.
- BUDGET_ATTENTION: whether the attention kernel re-runs (its output or log-sum-exp not saved); traced with CPU's
  sdpa kernel (FlexAttention's stand-in, validation/titan.py), timed as the forward's attention.
- BUDGET_BYTES: the recomputed memory-bound ops' traffic per token (B), per width, counted from the graph as
  Inductor's fused kernels would move it (each tensor the recomputed region reads once, each tensor it hands a
  matmul or the attention kernel written once; validation/budget_recompute.py says the assumption): an estimate
  from the traced graph, not measured. At F = 1 (the plain compiled block) the partitioner still recomputes the
  SiLU, the residual sums and the norms' fp32 products: by hand 2h (block input) + 2h (wo's output) + 2f (w1's
  output) + 2 x 4 (the two rstd) B read, nothing a matmul reads (the RoPE rows gathered at the positions are saved).

Nothing here is calibrated: the step time charges the matmuls at the GEMM efficiency, the attention at the
attention efficiency and the bytes at the memory-bound efficiency (memplan/timing/layer.py), as the forward's.
"""

from __future__ import annotations

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.compiled import BUDGET_SAVED

# per F = 0, 0.1, ..., 1: the linears re-run (`ffn` one of w1, w3, w2: the same FLOPs) and the attention kernels
# re-run, traced at the 8B, 70B and 405B widths at s 2,048 (8B also at 8,192): the same at each
BUDGET_LINEARS = ("wqkv wo ffn ffn", "wo ffn ffn", "ffn ffn", "wo ffn", "ffn", "wo", "", "", "", "", "")
BUDGET_ATTENTION = (1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)
# (h, a, g, f) -> the recomputed memory-bound ops' traffic per token at F = 0, 0.1, ..., 1 (B; traced at s 2,048, the
# block called with the dataloader's positions: below F = 1 the RoPE gather at them is re-run, 4d + 8 B read)
BUDGET_BYTES = {
    (4096, 32, 8, 14336): (143880, 119304, 119304, 119304, 119304, 119304, 119312, 119312, 119312, 119312, 45064),
    (8192, 64, 8, 28672): (279048, 238088, 238088, 238088, 238088, 238088, 238096, 238096, 238096, 238096, 90120),
    (16384, 128, 8, 53248): (524808, 451080, 451080, 451080, 451080, 451080, 451088, 451088, 451088, 451088, 172040),
}
SRC = ("traced: what the partitioner re-runs in the backward at the budget (the backward graph's forward nodes, "
       "torch 2.13, the real widths under FakeTensorMode; validation/budget_recompute.py), timed as derived from "
       "it, uncalibrated")


def _tenth(budget: float) -> int:
    tenth = round(budget * 10)
    if abs(budget * 10 - tenth) > 1e-9 or not 0 <= tenth <= 10:
        raise MemplanError(f"--ac budget:F is traced at F = 0, 0.1, ..., 1 (got {budget:g})")
    return tenth


def _widths(model: ModelSpec) -> tuple[int, int, int, int]:
    key = (model.hidden_size, model.num_attention_heads, model.g, model.f)
    if key not in BUDGET_BYTES:
        raise MemplanError("--ac budget:F: its recompute is traced at the Llama 3 8B, 70B and 405B widths only")
    return key


def linear_flops(model: ModelSpec) -> dict[str, int]:
    """Forward FLOPs per token of each of the block's linears (2 per weight)."""
    h, q, kv = model.hidden_size, model.q, model.q * model.g // model.num_attention_heads
    return {"wqkv": 2 * h * (q + 2 * kv), "wo": 2 * q * h, "ffn": 2 * h * model.f}


def recompute(model: ModelSpec, budget: float) -> dict[str, int]:
    """What one compiled block's backward re-runs at budget F beyond the plain compiled block's own (F = 1: the
    compiled time model's, not charged): ``matmul_flops`` per token, ``gemms`` (kernels), ``attention`` (kernels
    re-run) and ``memory_bytes`` per token."""
    tenth, key = _tenth(budget), _widths(model)
    flops = linear_flops(model)
    linears = BUDGET_LINEARS[tenth].split()
    return {"matmul_flops": sum(flops[name] for name in linears), "gemms": len(linears),
            "attention": BUDGET_ATTENTION[tenth] - BUDGET_ATTENTION[10],
            "memory_bytes": BUDGET_BYTES[key][tenth] - BUDGET_BYTES[key][10]}


def distinct_budgets() -> tuple[float, ...]:
    """The budgets F (tenths) below 1 whose saved set (compiled.BUDGET_SAVED) and recompute differ from every smaller
    F's and from F = 1's (the plain compiled block, AC none): one plan each in a search (the same saved set and
    recompute is the same plan), named by the smallest F."""
    seen, out = set(), []
    for tenth in (10, *range(10)):
        key = (BUDGET_SAVED[tenth], BUDGET_LINEARS[tenth], BUDGET_ATTENTION[tenth],
               tuple(v[tenth] for v in BUDGET_BYTES.values()))
        if key not in seen:
            seen.add(key)
            out.append(tenth / 10)
    return tuple(out[1:])
