"""Activation bytes of one transformer layer, summed from the inventory.

Every function works on Python scalars and on numpy arrays (one element per plan),
so `estimate` and the planner run the very same code. Closed forms (K22 Table 2)
live only in the tests.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from memplan.core.training import Recompute
from memplan.core.symbolic import Poly
from memplan.inventory.types import Term


def layer_bytes(
    terms: Iterable[Term], values: Mapping[str, Any], activation_bytes: int, sp: Any, recompute: Any
) -> Any:
    """Bytes one layer keeps for one micro-batch on one GPU under a recompute mode."""
    total: Any = 0
    for term in terms:
        total = total + term.bytes(values, activation_bytes, sp) * term.kept(recompute)
    return total


def layer_poly(terms: Iterable[Term], activation_bytes: int, sp: bool, recompute: Recompute, cp: int = 1) -> Poly:
    """The same sum as `layer_bytes`, as a polynomial in the K22 symbols and t (and cp)."""
    total = Poly(())
    for term in terms:
        if term.kept(recompute):
            total = total + term.split_size(activation_bytes, sp, cp)
    return total
