"""Scalars and numpy arrays alike, in one float dtype: the helpers every timing module evaluates a plan with.

Every function takes the plan as `PlanValues` whose fields are Python scalars or equally shaped
numpy arrays (one element per candidate plan); nothing loops over candidates. Scalar and array
times are computed in float32 alike (TIME_DTYPE), so that one plan evaluated alone and the
same plan inside an array of millions give the same numbers, bit for bit.

It owns TIME_DTYPE, the conversions (as_time, as_float64, as_python), the plan's fields converted once
(PlanFloats, plan_floats) and the float max / min / where of scalars or arrays (maximum, minimum, select).
maximum and minimum differ from memplan.core.arith's on purpose: those compute max(x, y) by arithmetic,
x + (y - x) * (y > x), which is exact for the integers the memory model counts but rounds in floating point
(and gives nan with an infinity); these return one of their operands exactly (Python's max / min, numpy's
maximum / minimum), which the bit-for-bit equality of a plan alone and inside an array relies on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memplan.core.training import Recompute
from memplan.memory.term_bytes import PlanValues

# Times are computed in float32, for scalars and arrays alike (so that a plan's numbers in the
# vectorised search equal its numbers in `estimate` exactly): at 5 million plans a float64
# temporary is 40 MB and costs about twice a float32 one; the relative error, about 1e-6, is far
# below the model's. FLOP counts (model_flops, hardware_flops) stay in float64. Scalar results
# are returned as Python floats.
TIME_DTYPE = np.float32


# --- scalar / array helpers -----------------------------------------------------------------
def as_time(x: Any) -> Any:
    """A plan value as a TIME_DTYPE scalar or array."""
    return x.astype(TIME_DTYPE) if isinstance(x, np.ndarray) else TIME_DTYPE(x)


def as_float64(x: Any) -> Any:
    """A plan value as a float64 scalar or array (FLOP counts overflow int64 at 1T parameters)."""
    return x.astype(np.float64) if isinstance(x, np.ndarray) else float(x)


def as_python(values: dict[str, Any]) -> dict[str, Any]:
    """Numpy scalars as Python floats (exact), arrays and None unchanged."""
    return {k: float(v) if isinstance(v, np.generic) else v for k, v in values.items()}


def _is_array(*xs: Any) -> bool:
    return any(isinstance(x, np.ndarray) for x in xs)


def maximum(x: Any, y: Any) -> Any:
    return np.maximum(x, y) if _is_array(x, y) else max(x, y)


def minimum(x: Any, y: Any) -> Any:
    return np.minimum(x, y) if _is_array(x, y) else min(x, y)


def select(mask: Any, a: Any, b: Any) -> Any:
    """a where mask, else b, each value exactly as it is (scalars or arrays)."""
    return np.where(mask, a, b) if _is_array(mask, a, b) else (a if mask else b)


@dataclass(frozen=True)
class PlanFloats:
    """The plan's fields as TIME_DTYPE scalars or arrays, converted once."""

    t: Any
    inv_t: Any
    sp: Any  # 1.0 where sequence parallelism is on
    p: Any
    m: Any
    d: Any
    b: Any
    M: Any
    selective: Any  # layers per chunk recomputed selectively (0 unless recompute = selective)
    full: Any  # layers per chunk recomputed fully (0 unless recompute = full)
    first: Any  # 1.0 where p = 1: the last stage is also the first
    sharded: Any  # 1.0 where ZeRO >= 1 (distributed optimizer)
    k: Any  # ranks the sharded states are split over (d, or the HSDP shard group)
    zero3: Any  # 1.0 where ZeRO = 3
    cp: Any = 1.0  # context-parallel size
    ep: Any = 1.0  # expert-parallel size
    etp: Any = 1.0  # expert tensor-parallel size


def plan_floats(plan: PlanValues) -> PlanFloats:
    t = as_time(plan.t)
    layers = as_time(plan.recomputed_layers)
    return PlanFloats(
        t=t, inv_t=1.0 / t, sp=as_time(plan.sp), p=as_time(plan.p), m=as_time(plan.m), d=as_time(plan.d),
        b=as_time(plan.b), M=as_time(plan.microbatches),
        selective=as_time(plan.recompute == Recompute.SELECTIVE) * layers,
        full=as_time(plan.recompute == Recompute.FULL) * layers,
        first=as_time(plan.p == 1), sharded=as_time(plan.zero >= 1), zero3=as_time(plan.zero >= 3),
        k=as_time(plan.shard),
        cp=as_time(plan.cp), ep=as_time(plan.ep), etp=as_time(plan.expert_tp),
    )
