"""Linear forms: every per-sequence time is a combination of a few plan-dependent factors (Basis: 1/t, the
replicated regions' split, seconds per byte of an all-gather over t, the same under SP, 1/b), so that a model's
coefficients (Form) are computed once as scalars and evaluated on scalars or arrays of plans with few
multiplies (evaluate)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.core.specs import GpuSpec
from memplan.timing.arrays import PlanFloats
from memplan.timing.comm import link_per_byte


# --- linear forms: seconds per sequence as c_t/t + c_r*rep + c_a*ag + c_s*ag*sp + c_u/b + c_w/(bt) ---
@dataclass(frozen=True)
class Basis:
    """The plan-dependent factors every per-sequence time is a linear combination of."""

    inv_t: Any  # 1/t: the tensor-parallel split
    rep: Any  # split of the replicated regions: 1/t with SP, 1 without
    ag: Any  # seconds per byte of an all-gather or reduce-scatter over t: (t-1)/t / bandwidth
    ag_sp: Any  # ag where SP is on, else 0
    inv_b: Any  # 1/b: a fixed cost per micro-batch (per kernel), shared by its b sequences
    inv_bt: Any  # 1/(b t): a cost per micro-batch on each TP rank's share of the weights (float8's weight casts)


def basis(gpu: GpuSpec, pf: PlanFloats) -> Basis:
    rep = 1.0 + pf.sp * (pf.inv_t - 1.0)
    ag = (1.0 - pf.inv_t) * link_per_byte(gpu, pf.t)
    inv_b = 1.0 / pf.b
    return Basis(pf.inv_t, rep, ag, ag * pf.sp, inv_b, inv_b * pf.inv_t)


@dataclass(frozen=True)
class Form:
    """Seconds per sequence: t/t + r*rep + a*ag + s*ag_sp + u/b + w/(b t) (scalar coefficients)."""

    t: float = 0.0
    r: float = 0.0
    a: float = 0.0
    s: float = 0.0
    u: float = 0.0
    w: float = 0.0

    def __add__(self, other: "Form") -> "Form":
        return Form(self.t + other.t, self.r + other.r, self.a + other.a, self.s + other.s, self.u + other.u,
                    self.w + other.w)

    def __mul__(self, k: float) -> "Form":
        return Form(self.t * k, self.r * k, self.a * k, self.s * k, self.u * k, self.w * k)

    __rmul__ = __mul__

    def __call__(self, x: Basis) -> Any:
        return evaluate(x, (1.0, self))


_FORM_BASIS = (("t", "inv_t"), ("r", "rep"), ("a", "ag"), ("s", "ag_sp"), ("u", "inv_b"), ("w", "inv_bt"))


def evaluate(x: Basis, *weighted: tuple[Any, Form]) -> Any:
    """Sum of weight x form (weights scalars or arrays), gathered per basis factor so that an array
    costs one multiply per (array weight, non-zero coefficient) and one per basis factor."""
    total: Any = None
    for coef_name, basis_name in _FORM_BASIS:
        coef: Any = None
        for weight, form in weighted:
            c = getattr(form, coef_name)
            if c:
                term = c if (isinstance(weight, float) and weight == 1.0) else weight * c
                coef = term if coef is None else coef + term
        if coef is not None:
            term = coef * getattr(x, basis_name)
            total = term if total is None else total + term
    return 0.0 if total is None else total
