"""`explain` as a call: every number of `estimate` derived step by step, from the plan options (its own module:
`memplan estimate` does not load the derivations)."""

from __future__ import annotations

from typing import Any, Optional

from memplan.api.options import PlanOptions
from memplan.report.explain import explain as explain_plan


def explain(model: Optional[str] = None, **options: Any) -> list[Any]:
    """`memplan explain`: every number of `estimate` derived step by step (memplan.report.explain's steps; each
    has .as_dict())."""
    opts = PlanOptions(model=model, **options)
    preset, config = opts.config()
    _, steps = explain_plan(config, budget_bytes=opts.mem, gpu=opts.gpu_spec(preset), impl=opts.impl,
                            fragmentation_margin=opts.frag_margin)
    return steps
