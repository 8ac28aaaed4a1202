"""megatron-core's whole training step against memplan's step timeline: the cases (`McoreStep`), the plan each
runs, memplan's prediction (`estimate --impl megatron-local --device cpu`'s step peak), running the measurement
(validation/mcore_step.py: GPTModel from the local spec, DDP with the fp32 gradient buffer, the distributed optimizer
over torch AdamW, on CPU over gloo) and the comparison (`peak.PeakResult`).

Run it: `python -m memplan.check.mcore_step [--dp 1|2]` (prints measured vs predicted per case). torch is imported
only when a measurement runs.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any, Optional

from memplan.check.cases import mcore_case
from memplan.check.peak import PEAK_TOLERANCE, PeakResult
from memplan.check.validate import case_model
from memplan.core.harness import harness
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec
from memplan.inventory.assemble import training_inventory
from memplan.memory.states import total_params
from memplan.plan.estimate import step_peaks

IMPL = "megatron-local"


@dataclass(frozen=True)
class McoreStep:
    """A 2-layer GPTModel (mcore_case's shapes: s = 32, b = 2, h = 64, a = 4, v = 256; GPT: LayerNorm, GeLU, learned
    positions, tied embeddings, dropout 0.1; Llama-like: RMSNorm, SwiGLU, RoPE, GQA 4 heads / 2 groups, f = 160, no
    dropout) trained one step on d data-parallel ranks with the distributed optimizer; full recompute is Megatron-LM's
    uniform method, one layer per checkpoint; selective recompute's module is core_attn (the default)."""

    arch: str  # gpt | llama
    recompute: str = "none"  # none | selective | full
    dp: int = 1

    @property
    def name(self) -> str:
        return f"mcore step {self.arch} recompute {self.recompute} d={self.dp}"


def mcore_step_cases(dps: tuple[int, ...] = (1, 2)) -> list[McoreStep]:
    return [McoreStep(arch, r, d) for d in dps for arch in ("gpt", "llama") for r in ("none", "selective", "full")]


def mcore_step_config(case: McoreStep) -> Config:
    """The plan a case runs, as memplan's Config (bf16-mixed, ZeRO-1 = the distributed optimizer, CPU kernels,
    for-loop AdamW)."""
    model = case_model(mcore_case(case.arch, recompute=case.recompute, scope="model"))
    full = case.recompute == "full"
    return Config(model=model, parallel=ParallelSpec(dp=case.dp, zero=1), training=TrainingSpec(
        micro_batch=2, global_batch=2 * case.dp, recompute=case.recompute, precision="bf16-mixed", device="cpu",
        optimizer_impl="for-loop",  # megatron-core's fallback, torch AdamW, defaults to it on CPU tensors
        recompute_method="uniform" if full else None, recompute_num_layers=1 if full else None))


def predict_mcore_step(case: McoreStep) -> Any:
    """memplan's step timeline of the case, through the function `estimate` uses."""
    config = mcore_step_config(case)
    return step_peaks(config, training_inventory(config.model, IMPL, "cpu", config.training), walk=0)[0]


def _measured_case(step: Any, case: McoreStep) -> Any:
    c = mcore_case(case.arch, recompute=case.recompute, scope="model")
    mcore = importlib.import_module(harness().__name__ + ".mcore")
    model = mcore.McoreCase(case.arch, s=c.s, b=c.b, h=c.h, a=c.a, f=c.f, g=c.g, v=c.v, L=c.L,
                            recompute=case.recompute, scope="model", p_drop=c.dropout, backend="live")
    return step.McoreStepCase(model, case.dp)


@dataclass(frozen=True)
class McoreStepResult:
    """A case's step peak (`peak`) and, beside it, its optimizer step's own peak (states, gradients and the for-loop
    AdamW's temporaries), measured and predicted."""

    peak: PeakResult
    measured_optimizer: int
    predicted_optimizer: int

    @property
    def optimizer_error(self) -> float:
        return (self.predicted_optimizer - self.measured_optimizer) / self.measured_optimizer


def run_mcore_step(cases: list[McoreStep], tolerance: float = PEAK_TOLERANCE) -> list[McoreStepResult]:
    """Measure each case's second training step and compare its peak (and its optimizer step's) with memplan's."""
    step = importlib.import_module(harness().__name__ + ".mcore_step")  # torch is imported here, and only here
    measured = step.measure_mcore_step([_measured_case(step, c) for c in cases])
    results = []
    for c, m in zip(cases, measured):
        predicted = predict_mcore_step(c)
        e = predicted.peak_event
        at = e.phase + (f" {e.layer}" if e.layer is not None else "")
        peak = PeakResult(c, int(predicted.peak_bytes), int(m.peak_bytes), at, m.peak_phase, e.moment, tolerance,
                          total_params(mcore_step_config(c).model), m.parameters)
        optimizer = max(int(ev.bytes) for ev in predicted.events if ev.phase == "optimizer")
        results.append(McoreStepResult(peak, int(m.phase_peaks["optimizer"]), optimizer))
    return results


def format_results(results: list[McoreStepResult]) -> str:
    lines = [f"{'case':40} {'measured B':>11} {'predicted B':>11} {'error':>7} {'optimizer step B':>17} {'error':>7}"
             "  measured at / predicted at"]
    for x in results:
        r = x.peak
        lines.append(f"{r.case.name:40} {r.measured:>11,} {r.predicted:>11,} {r.error:>+7.2%} "
                     f"{x.measured_optimizer:>8,}/{x.predicted_optimizer:<8,} {x.optimizer_error:>+7.2%}  "
                     f"{r.measured_at} / {r.predicted_at}: {r.predicted_moment}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m memplan.check.mcore_step", description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, choices=(1, 2), action="append", help="data-parallel sizes (default 1 and 2)")
    a = p.parse_args(argv)
    print(format_results(run_mcore_step(mcore_step_cases(tuple(a.dp or (1, 2))))))


if __name__ == "__main__":
    main()
