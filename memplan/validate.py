"""`memplan validate`: memplan's predictions against memory measured on real torch code.

The measurements come from `validation/` (the only torch code; it never imports memplan and
computes no size from a formula). This module builds the grid of cases, asks memplan's inventory
for its prediction of each saved tensor (by label: the inventory's term ids are the labels the
reference layer tags), and compares, term by term and in total.

torch is imported only when a validation actually runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from memplan import terms as inventory
from memplan.memory import PlanValues, stage_memory
from memplan.specs import Config, ModelSpec, ParallelSpec, Recompute, TrainingSpec

TOLERANCE = 1e-3  # 0.1 % of a case's activation bytes (issue: CPU tolerance)
HF_TOLERANCE = 1e-2  # 1 % per layer against transformers' own code

# Small shapes for real runs (s, b, h, a, f) and the paper's layers for fake runs.
SHAPES = [(64, 2, 64, 4, None), (32, 3, 96, 8, 160)]
PAPER_LAYERS = {"gpt3-175b": (2048, 1, 12288, 96), "gpt3-530b": (2048, 1, 20480, 128)}


@dataclass(frozen=True)
class ValidationCase:
    name: str
    scope: str  # "layer" or "model"
    s: int
    b: int
    h: int
    a: int
    f: Optional[int]
    t: int
    sp: bool
    recompute: str
    backend: str  # ledger | live | fake | cuda
    v: int = 512
    L: int = 2
    impl: str = "torch"  # torch (validation/layers.py) | hf-eager | hf-sdpa (transformers)
    arch: str = "gpt2"  # hf-*: gpt2 | llama
    g: Optional[int] = None  # llama: key/value heads
    dropout: float = 0.1

    @property
    def layers(self) -> int:
        return 1 if self.scope == "layer" else self.L


@dataclass
class CaseResult:
    case: ValidationCase
    predicted: dict[str, int]  # label -> bytes (memplan, real-code view)
    measured: dict[str, int]  # label -> bytes (saved-tensor ledger)
    paper_total: int  # memplan's K22-only prediction
    retained_after_forward: Optional[int]  # live / fake / cuda backends (loss scalar removed)
    peak: Optional[int]
    tolerance: float = TOLERANCE
    notes: list[str] = field(default_factory=list)

    @property
    def predicted_total(self) -> int:
        return sum(self.predicted.values())

    @property
    def measured_total(self) -> int:
        return sum(self.measured.values())

    @property
    def error(self) -> float:
        """Relative error of the total (and of the retained bytes, where measured)."""
        errors = [abs(self.predicted_total - self.measured_total) / max(self.measured_total, 1)]
        if self.retained_after_forward is not None:
            errors.append(abs(self.predicted_total - self.retained_after_forward) / max(self.retained_after_forward, 1))
        return max(errors)

    def term_rows(self) -> list[tuple[str, int, int]]:
        labels = sorted(set(self.predicted) | set(self.measured))
        return [(k, self.predicted.get(k, 0), self.measured.get(k, 0)) for k in labels]

    @property
    def mismatched(self) -> list[tuple[str, int, int]]:
        """Terms whose own difference exceeds the tolerance of the case's total."""
        limit = self.tolerance * max(self.measured_total, 1)
        return [row for row in self.term_rows() if abs(row[1] - row[2]) > limit]

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance and not self.mismatched


def case_model(case: ValidationCase) -> ModelSpec:
    """The ModelSpec of the layer or model a case measures."""
    shape = dict(name=case.name, num_layers=case.layers, hidden_size=case.h, num_attention_heads=case.a,
                 seq_length=case.s, vocab_size=case.v, ffn_hidden_size=case.f)
    if case.impl == "torch":
        return ModelSpec(**shape)
    if case.arch == "gpt2":
        return ModelSpec(**shape, dropout=case.dropout > 0, attention="eager" if case.impl == "hf-eager" else "flash")
    return ModelSpec(**shape, num_kv_heads=case.g, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
                     tied_embeddings=False, bias=False, dropout=case.dropout > 0,
                     attention="eager" if case.impl == "hf-eager" else "flash")


def predict(case: ValidationCase, device: str = "cpu", paper_only: bool = False) -> dict[str, int]:
    """memplan's bytes per label for one rank of the case, from the case's implementation inventory."""
    model = case_model(case)
    config = Config(model=model, parallel=ParallelSpec(tp=case.t, sp=case.sp),
                    training=TrainingSpec(micro_batch=case.b, recompute=case.recompute))
    inv = inventory.inventory_for(model, case.impl, device)
    scopes = ("layer", "chunk") if case.scope == "layer" else ("layer", "chunk", "first", "last")
    terms = tuple(t for t in inv.terms if t.scope in scopes and (t.in_k22 or not paper_only))
    stage = stage_memory(model, terms, config.training, PlanValues.from_config(config), 0, working_set=False)
    return {k: int(v) for k, v in stage.term_bytes.items() if int(v)}


def grid(device: str = "cpu", tps: Iterable[int] = (1, 2, 4), recomputes: Iterable[str] = ("none", "selective", "full"),
         fake: bool = True, scopes: Iterable[str] = ("layer", "model")) -> list[ValidationCase]:
    """The CI grid: small shapes x t x SP x recompute x (layer, model), the t = 1 cases also through
    the live-storage tracker, plus the 175B / 530B layers at t = 8 under FakeTensorMode."""
    base = "cuda" if device == "cuda" else "ledger"
    cases = []
    for s, b, h, a, f in SHAPES:
        for t in tps:
            for sp in ([False, True] if t > 1 else [False]):
                for rec in recomputes:
                    for scope in scopes:
                        name = f"s{s} b{b} h{h} a{a}" + (f" f{f}" if f else "")
                        cases.append(ValidationCase(name, scope, s, b, h, a, f, t, sp, rec, base))
                        if t == 1 and device == "cpu" and (s, b, h, a, f) == SHAPES[0]:
                            cases.append(ValidationCase(name, scope, s, b, h, a, f, t, sp, rec, "live"))
    if fake:
        for name, (s, b, h, a) in PAPER_LAYERS.items():
            for sp in (False, True):
                for rec in recomputes:
                    cases.append(ValidationCase(f"{name} layer", "layer", s, b, h, a, None, 8, sp, rec, "fake"))
    return cases


def hf_grid(fake: bool = True) -> list[ValidationCase]:
    """transformers GPT-2 and Llama, eager and sdpa, built from a config (no weights), CPU, bf16:
    small shapes (GQA and not; GPT-2 with and without dropout) per layer and per 2-layer model, and
    a llama3-8b-shaped layer at s = 4096 under FakeTensorMode (the README's table)."""
    cases = []
    for impl in ("hf-eager", "hf-sdpa"):
        for arch, g, dropouts in (("gpt2", None, (0.1, 0.0)), ("llama", 2, (0.0,)), ("llama", 4, (0.0,))):
            for dropout in dropouts:
                if impl == "hf-sdpa" and dropout > 0:
                    continue  # sdpa with dropout on CPU is torch's fp32 math kernel: not modelled
                for scope in ("layer", "model"):
                    f = 4 * 64 if arch == "gpt2" else 160
                    name = f"{arch} s32 b2 h64 a4" + (f" g{g}" if g else "") + (f" p{dropout}" if dropout else "")
                    cases.append(ValidationCase(name, scope, 32, 2, 64, 4, f, 1, False, "none", "ledger",
                                                impl=impl, arch=arch, g=g, dropout=dropout))
        if fake:
            cases.append(ValidationCase("llama3-8b layer s4096", "layer", 4096, 1, 4096, 32, 14336, 1, False, "none",
                                        "fake", v=128256, impl=impl, arch="llama", g=8, dropout=0.0))
    return cases


def _measure(cases: list[ValidationCase]) -> list[Any]:
    """Measurements in the cases' order: the reference layer through one batch (one process
    spawn per t), transformers models one by one."""
    from validation import Case, measure_hf, measure_many  # torch is imported here, and only here

    ref = [i for i, c in enumerate(cases) if c.impl == "torch"]
    jobs = [(Case(s=c.s, b=c.b, h=c.h, a=c.a, f=c.f, v=c.v, L=c.layers, t=c.t, sp=c.sp, recompute=c.recompute,
                  backend=c.backend), c.scope) for c in (cases[i] for i in ref)]
    out: list[Any] = [None] * len(cases)
    for i, m in zip(ref, measure_many(jobs) if jobs else []):
        out[i] = m
    for i, c in enumerate(cases):
        if c.impl != "torch":
            out[i] = measure_hf(c.arch, c.impl.removeprefix("hf-"), c.s, c.b, c.h, c.a, f=c.f, g=c.g, v=c.v,
                                L=c.layers, dropout=c.dropout, scope=c.scope, backend=c.backend)
    return out


def run(cases: list[ValidationCase], device: str = "cpu", tolerance: Optional[float] = None) -> list[CaseResult]:
    """Measure every case with the torch harness and compare with memplan's inventory."""
    results = []
    for c, m in zip(cases, _measure(cases)):
        measured = {k: v for k, v in m.saved_bytes_by_label.items() if v}
        retained = None
        if m.retained_after_forward_bytes is not None:
            retained = m.retained_after_forward_bytes - m.loss_bytes
        notes = list(m.notes)
        if m.ranks_agree is False:
            notes.append("ranks disagree")
        tol = tolerance if tolerance is not None else (TOLERANCE if c.impl == "torch" else HF_TOLERANCE)
        if c.impl != "torch" and c.scope == "layer" and retained is not None:
            retained = None  # a standalone HF layer's input is a live leaf that is not saved (validation/hf.py)
        results.append(CaseResult(c, predict(c, device), measured, sum(predict(c, device, paper_only=True).values()),
                                  retained, m.peak_bytes, tol, notes))
    return results


def summary(results: list[CaseResult]) -> dict[str, Any]:
    worst = max(results, key=lambda r: r.error) if results else None
    return {
        "cases": len(results),
        "passed": sum(r.passed for r in results),
        "failed": sum(not r.passed for r in results),
        "largest_error": worst.error if worst else 0.0,
        "tolerance": results[0].tolerance if results else TOLERANCE,
    }
