"""What torchtitan's memory-budget AC saves at budgets F (validation/budget.py ``budget_saved``), each saved tensor
named by memplan's table of the plain compiled block (memplan/inventory/compiled.py ``TITAN_LAYER``): this script
joins the two (validation/ never imports memplan).

    PYTHONPATH=. python benchmarks/budget_saved.py H A G F S BUDGET...   (llama3-8b: 4096 32 8 14336 8192 0 0.5 1)
"""

from __future__ import annotations

import sys

from memplan.inventory.compiled import TITAN_LAYER
from validation.budget import budget_saved


def main(argv: list[str]) -> None:
    h, a, g, f, s = (int(x) for x in argv[:5])
    for budget, r in budget_saved(h, a, g, f, s, tuple(float(x) for x in argv[5:]), TITAN_LAYER).items():
        print(f"{budget}: {r['per_token']} B per token: {' '.join(r['saved'])}")


if __name__ == "__main__":
    main(sys.argv[1:])
