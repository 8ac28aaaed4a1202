"""The checks of a mixture-of-experts model's routing loads (ModelSpec.moe_expert_loads), called by ModelSpec's
validator."""

from __future__ import annotations

from typing import Optional


def check_expert_loads(loads: Optional[tuple[float, ...]], imbalance: float, E: int, k: int) -> None:
    """moe_expert_loads: the loads of E/ep experts (a count dividing E), none negative or above E / k times the
    average (an expert receives each token at most once), in place of moe_imbalance."""
    if not loads or E % len(loads) or min(loads) < 0:
        raise ValueError(f"moe_expert_loads takes the loads of E/ep experts (a count dividing num_experts={E}), "
                         f"none negative (got {len(loads or ())})")
    if imbalance != 1.0:
        raise ValueError("moe_expert_loads and moe_imbalance both give the routing's imbalance: give one")
    if max(loads) > E / k:
        raise ValueError(f"moe_expert_loads: an expert's load {max(loads):g} x the average exceeds E / k = "
                         f"{E / k:g} (each token goes to an expert at most once)")
