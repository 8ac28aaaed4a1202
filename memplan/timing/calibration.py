"""The calibrated efficiencies a step time uses (memory_bound_efficiency,
attention_matmul_efficiency; the GPU presets hold the numbers), whether a step time is calibrated (Calibration,
calibration), and the derivations of the calibrated constants, here and in comm.py (NCCL_BUS_EFFICIENCY,
TP_ASYNC_EXPOSED_FRACTION).

Calibration: A100 80GB, K22 Table 4 (22B layer: a=64, h=6144, s=2048, b=4, t=8, A = 2)
-------------------------------------------------------------------------------------
Per GPU: weight matmuls 24bsh^2/t = 9.277e11 FLOP, attention matmuls 4bs^2h/t = 5.154e10 FLOP,
sbh = 5.033e7, score elements as^2b/t = 1.342e8; one ag = (7/8) x 2sbh / (300 GB/s x 0.8) =
0.367 ms (data sheet NVLink rate x NCCL_BUS_EFFICIENCY). Peak 312 TFLOP/s, HBM 2039 GB/s.
Four unknowns, each solved from one published figure, in this order:

1. memory-bound efficiency, from SP's forward gain 7.7 - 7.2 = 0.5 ms, which is the 22sbh
   replicated bytes shrinking by 1 - 1/t: 22 x 5.033e7 x 7/8 / (2039e9 x 0.5e-3) = 0.950 -> 0.95
   (the 0.1 ms print rounding allows 0.79..1.19).
2. attention matmul efficiency, from selective recompute's backward cost 13.2 - 11.9 = 1.3 ms,
   minus its softmax + dropout bytes 9 x 1.342e8 / (2039e9 x 0.95) = 0.624 ms:
   5.154e10 / (0.676e-3 x 312e12) = 0.244 -> 0.24 (head-dim-96 batched matmuls; the efficiency
   also absorbs the transposes of Megatron-LM's unfused attention).
3. the forward GEMM time, from the baseline forward 7.7 ms = GEMMs + 0.688 (attention matmuls at
   0.24) + 1.247 (2.416e9 memory-bound bytes: 22sbh + 9as^2b/t + 4sbf/t) + 1.468 (4 ag):
   4.30 ms for the layer's 4 GEMMs (77-309 GFLOP each), 0.69 of peak.
4. TP_ASYNC_EXPOSED_FRACTION, from the baseline backward 11.9 ms = 2 x 4.309 (GEMMs)
   + 2 x 0.688 + 1.724 (3.339e9 bytes: 34sbh + 11as^2b/t + 6sbf/t) + x 4 ag:
   x = 0.181 / 1.468 = 0.12.

With these constants the model gives, forward / backward ms (K22 Table 4 in brackets):
baseline 7.71 / 11.90 (7.7 / 11.9), SP 7.21 / 11.86 (7.2 / 11.8), full recompute 7.71 / 19.61
(7.7 / 19.5), selective 7.71 / 13.21 (7.7 / 13.2), selective + SP 7.21 / 13.17 (7.2 / 13.1);
overheads SP -2.75% (-3%), full +39.3% (39%), selective +6.7% (7%), selective + SP +3.9% (4%).
Full recompute costs exactly one more forward here, 7.7 / 19.6 = 39.3%; Table 4's own
recompute is 19.5 - 11.9 = 7.6 ms, 0.1 ms (print rounding) under its 7.7 ms forward.

Calibration: A100 80GB, GEMM size, K22 Table 5 (GPT 22B, 175B, 530B, 1T end to end)
-----------------------------------------------------------------------------------
One GEMM efficiency cannot fit Table 5: 0.69 (step 3) leaves 530B 4% and 1T 10% too slow, the
larger models' GEMMs (215-1342 GFLOP) running faster than the 22B's. A GEMM is therefore charged
FLOPs / (peak x matmul_efficiency) + matmul_overhead_s. Step 3 ties the pair (4 x overhead +
9.277e11 / (312e12 x efficiency) = 4.30 ms); the overhead 0.12 ms, efficiency 0.776, is the
least-squares fit to Table 5's four "present work" (SP + selective) rows. The four full-recompute
rows are then predictions: 22B -2.6%, 175B -0.1%, 530B +0.5%, 1T +1.5% (tests/test_paper_golden.py,
docs/step_time.md). The same law, fitted independently to the H100 measurements below, gives
0.72 and 87 us: on both GPUs the overhead is worth 40-60 GFLOP, about one wave of GEMM tiles.

Calibration: H100 80GB, a K22 layer in eager PyTorch (h=6144, a=64, s=2048, t=1)
---------------------------------------------------------------------------------
Measured forward + backward ms, no / selective / full recompute: b = 1: 15.2, 17.6, 20.7;
b = 4: 58.0, 66.6, 78.9. With the eager op-by-op bytes (layer_traffic_bytes(fused=False)) the
model is linear in 1/matmul_efficiency, matmul_overhead_s, 1/attention_matmul_efficiency and
1/memory_bound_efficiency; least squares over the six numbers: 0.718, 87 us, 0.144, 0.882, all
six within 0.5% (tests/test_perf.py). Megatron-LM's fused kernels on an H100 and the H200 are not
measured: their step times carry calibrated = False (calibration())."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.core.model import ModelSpec
from memplan.core.specs import GpuSpec


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
    GEMMs were measured on no GPU: memplan/inventory/fp8.py)."""
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
