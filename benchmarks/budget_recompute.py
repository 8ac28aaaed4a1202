"""What torchtitan's memory-budget AC re-runs in a compiled block's backward at budgets F (validation/budget_recompute.py
``budget_recompute``: the backward graph's forward nodes, the real-size block under FakeTensorMode), per token.

    PYTHONPATH=. python benchmarks/budget_recompute.py H A G F S BUDGET...   (llama3-8b: 4096 32 8 14336 2048 0 0.5 1)
"""

from __future__ import annotations

import sys

from validation.budget_recompute import budget_recompute


def main(argv: list[str]) -> None:
    h, a, g, f, s = (int(x) for x in argv[:5])
    for budget, r in budget_recompute(h, a, g, f, s, tuple(float(x) for x in argv[5:])).items():
        print(f"{budget}: linears {' '.join(r['linears']) or '-'}, {r['matmul_flops']:,} matmul FLOPs per token, "
              f"attention re-run {r['attention']}x, {r['memory_bytes']:,} B per token memory-bound")


if __name__ == "__main__":
    main(sys.argv[1:])
