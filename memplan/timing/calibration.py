"""CAL"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.core.specs import GpuSpec, ModelSpec


def memory_bound_efficiency(gpu: GpuSpec) -> float:
    return gpu.memory_bound_efficiency


def attention_matmul_efficiency(gpu: GpuSpec, model: ModelSpec) -> float:
    """Unfused attention matmuls run at the calibrated (low) efficiency; a flash kernel fuses them
    and is assumed (not measured: `calibration` says so) to reach the GEMM efficiency
    (FlashAttention-2 reports 50-73% of A100 peak forward, Dao 2023)."""
    return gpu.matmul_efficiency if model.attention == "flash" else gpu.attention_matmul_efficiency


@dataclass(frozen=True)
class Calibration:
    """Whether the efficiencies a step time uses were measured for this GPU, implementation and
    attention kernel; `uncertainty` is the relative spread of calibrated step times against
    published measurements (None when uncalibrated: no measurement bounds the error)."""

    calibrated: bool
    uncertainty: Any  # float or None
    note: str  # empty when calibrated, else what was not measured


def calibration(model: ModelSpec, gpu: GpuSpec, impl: str = "megatron", fp8: Any = None) -> Calibration:
    """The calibration status of a step time (the GPU preset's `calibration` and `calibrated_impls`; FP8
    GEMMs were measured on no GPU: memplan/fp8.py)."""
    if fp8 is not None:
        return Calibration(False, None, "uncalibrated: FP8 GEMMs assumed at the bf16 GEMM efficiency of the FP8 peak")
    if not gpu.calibration:
        return Calibration(False, None, f"uncalibrated: no measurement on {gpu.name}, its efficiencies are assumed")
    if impl not in gpu.calibrated_impls:
        measured = ", ".join(gpu.calibrated_impls)
        return Calibration(False, None, f"uncalibrated: {impl} kernels not measured on {gpu.name} (measured: {measured})")
    if model.attention == "flash":
        return Calibration(False, None, "uncalibrated: flash attention kernel assumed at the GEMM efficiency")
    return Calibration(True, gpu.step_time_uncertainty, "")
