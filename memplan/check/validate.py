"""`memplan validate`: memplan's predictions against memory measured on real torch code.

The measurements come from `validation/` (the only torch code; it never imports memplan and
computes no size from a formula). For each case (memplan/check/cases.py) this module asks memplan's inventory
for its prediction of each saved tensor (by label: the inventory's term ids are the labels the
reference layer tags), and compares, term by term and in total.

torch is imported only when a validation actually runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Optional

from memplan.check.cases import ValidationCase
from memplan.core.harness import harness
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec
from memplan.core.training import FUSIONS
from memplan.inventory import assemble
from memplan.inventory import lora as lora_inventory
from memplan.inventory.fusions import apply_fusions
from memplan.inventory.mcore import QKV_TERMS
from memplan.inventory.recompute import apply_modules
from memplan.inventory.traced_file import TracedFile, bucket_bytes
from memplan.inventory.types import CUDA_BLOCK_BYTES
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues

TOLERANCE = 1e-3  # 0.1 % of a case's activation bytes (issue: CPU tolerance)
HF_TOLERANCE = 1e-2  # 1 % per layer against transformers' own code
# megatron-core's local spec is measured exactly; 0.01 % leaves room only for the 4-byte int32 attn_mask_type
# tensor of selective recompute, which the live tracker does not see created (a factory, no op output)
MCORE_TOLERANCE = 1e-4


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
    predicted_allocated: Optional[int] = None  # cuda: the prediction with the allocator's 512-byte blocks

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
            # the allocator (cuda backend) counts whole blocks, the ledger and the live tracker storage bytes
            predicted = self.predicted_allocated if self.predicted_allocated is not None else self.predicted_total
            errors.append(abs(predicted - self.retained_after_forward) / max(self.retained_after_forward, 1))
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
    if case.impl == "torch" or (case.impl == "megatron-local" and case.arch == "gpt"):
        return ModelSpec(**shape)
    if case.arch == "gpt2":
        return ModelSpec(**shape, dropout=case.dropout > 0, attention="eager" if case.impl == "hf-eager" else "flash")
    if case.experts:
        shape.update(num_experts=case.experts, moe_top_k=case.topk, moe_ffn_hidden_size=case.fe,
                     moe_shared_ffn_hidden_size=case.fs, moe_capacity_factor=case.capacity,
                     moe_pad_to_capacity=case.pad, moe_token_dispatcher=case.dispatcher,
                     moe_aux_loss_coeff=case.aux_loss, moe_z_loss_coeff=case.z_loss,
                     moe_router_dtype=case.router_dtype, moe_router_pre_softmax=case.pre_softmax,
                     moe_expert_loads=tuple(x * case.experts / sum(case.loads) for x in case.loads) or None,
                     megatron_core_version=case.mcore_version)
    if case.kv_lora:
        shape.update(kv_lora_rank=case.kv_lora, q_lora_rank=case.q_lora, qk_nope_head_dim=case.dn,
                     qk_rope_head_dim=case.dr, v_head_dim=case.dv)
    return ModelSpec(**shape, num_kv_heads=case.g, head_dim=case.head_dim, norm="rmsnorm",
                     mlp="gelu" if case.gelu else "swiglu",
                     position_embedding="rope", tied_embeddings=False, bias=False, dropout=case.dropout > 0,
                     attention="eager" if case.impl == "hf-eager" else "flash")


def predict(case: ValidationCase, device: str = "cpu", paper_only: bool = False, allocated: bool = False
            ) -> dict[str, int]:
    """memplan's bytes per label for one rank of the case, from the case's implementation inventory;
    `allocated`: each storage rounded up as the device's allocator does (what it reports)."""
    model = case_model(case)
    config = Config(model=model, parallel=ParallelSpec(tp=case.t, sp=case.sp, ep=case.ep, etp=case.etp, dp=case.ep),
                    training=TrainingSpec(micro_batch=case.b, recompute=case.recompute, recompute_modules=case.modules))
    inv = apply_modules(assemble.inventory_for(model, case.impl, device), model, case.impl, case.modules)
    if case.impl == "megatron-local":  # validation/mcore.py runs megatron-core with every fusion off
        inv = apply_fusions(inv, model, case.impl, device, FUSIONS)
    if case.lora:  # peft LoRA (memplan/inventory/lora.py)
        lora = TrainingSpec(lora_rank=case.lora, lora_targets=case.lora_targets or None, lora_dropout=case.lora_dropout)
        inv = lora_inventory.apply(inv, model, case.impl, device, lora)
    scopes = ("layer", "chunk") if case.scope == "layer" else ("layer", "chunk", "first", "last")
    terms = tuple(t for t in inv.terms if t.scope in scopes and (t.in_k22 or not paper_only))
    stage = stage_memory(model, terms, config.training, PlanValues.from_config(config), 0, working_set=False,
                         granularity=inv.granularity if allocated else 1)
    out: dict[str, int] = {}
    for k, v in stage.term_bytes.items():
        if int(v):
            # megatron-core's Q, K, V are views of shared storages: measured (and compared) as one
            key = "qkv" if case.impl == "megatron-local" and k in QKV_TERMS else k
            out[key] = out.get(key, 0) + int(v)
    return out


def _measure(cases: list[ValidationCase]) -> list[Any]:
    """Measurements in the cases' order: the reference layer through one batch (one process
    spawn per t), transformers models one by one."""
    pkg = harness()  # torch is imported here, and only here
    Case, measure_hf, measure_many = pkg.Case, pkg.measure_hf, pkg.measure_many

    ref = [i for i, c in enumerate(cases) if c.impl == "torch"]
    jobs = [(Case(s=c.s, b=c.b, h=c.h, a=c.a, f=c.f, v=c.v, L=c.layers, t=c.t, sp=c.sp, recompute=c.recompute,
                  backend=c.backend), c.scope) for c in (cases[i] for i in ref)]
    out: list[Any] = [None] * len(cases)
    for i, m in zip(ref, measure_many(jobs) if jobs else []):
        out[i] = m
    mc = [i for i, c in enumerate(cases) if c.impl == "megatron-local"]
    if mc:
        mcore = importlib.import_module(pkg.__name__ + ".mcore")
        measured = mcore.measure_mcore([mcore.McoreCase(
            arch=c.arch, s=c.s, b=c.b, h=c.h, a=c.a, f=c.f, g=c.g, v=c.v, L=c.layers, t=c.t, sp=c.sp,
            recompute=c.recompute, scope=c.scope, p_drop=c.dropout, backend=c.backend, modules=c.modules,
            **(dict(experts=c.experts, topk=c.topk, fe=c.fe, fs=c.fs, ep=c.ep, etp=c.etp, dispatcher=c.dispatcher,
                    capacity=c.capacity, pad=c.pad, aux_loss=c.aux_loss, z_loss=c.z_loss, router_dtype=c.router_dtype,
                    pre_softmax=c.pre_softmax, gelu=c.gelu, loads=c.loads) if c.experts else {}),
            **(dict(kv_lora=c.kv_lora, q_lora=c.q_lora, qk_nope=c.dn, qk_rope=c.dr, v_head=c.dv) if c.kv_lora else {}))
            for c in (cases[i] for i in mc)])
        for i, m in zip(mc, measured):
            out[i] = m
    for i, c in enumerate(cases):
        if c.impl.startswith("hf-"):
            out[i] = measure_hf(c.arch, c.impl.removeprefix("hf-"), c.s, c.b, c.h, c.a, f=c.f, g=c.g,
                                head_dim=c.head_dim, v=c.v, L=c.layers, dropout=c.dropout, scope=c.scope, backend=c.backend,
                                lora=(c.lora, c.lora_dropout, c.lora_targets))
    return out


def measured_saved_bytes(cases: list[ValidationCase]) -> list[tuple[str, dict[str, int]]]:
    """Each case's measured saved bytes per label, with the first note of its measurement (megatron-core's:
    its version)."""
    return [(m.notes[0] if getattr(m, "notes", None) else "", {k: v for k, v in m.saved_bytes_by_label.items() if v})
            for m in _measure(cases)]


def mcore_version(note: str) -> str:
    """The megatron-core version memplan models for the one a measurement names ("megatron-core 0.19.2")."""
    major, minor = (int(x) for x in note.split()[-1].split(".")[:2])
    return "0.19" if (major, minor) >= (0, 19) else "0.16"


def run(cases: list[ValidationCase], device: str = "cpu", tolerance: Optional[float] = None) -> list[CaseResult]:
    """Measure every case with the torch harness and compare with memplan's inventory."""
    results = []
    for c, m in zip(cases, _measure(cases)):
        measured = {k: v for k, v in m.saved_bytes_by_label.items() if v}
        retained = None
        cuda = c.backend == "cuda"
        if m.retained_after_forward_bytes is not None:
            # the loss scalar is alive but not saved; on CUDA it occupies one whole allocator block
            loss = -(-m.loss_bytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if cuda else m.loss_bytes
            retained = m.retained_after_forward_bytes - loss
        notes = list(m.notes)
        if c.impl == "megatron-local":
            c = dataclasses.replace(c, mcore_version=mcore_version(notes[0]))
        if m.ranks_agree is False:
            notes.append("ranks disagree")
        tol = tolerance if tolerance is not None else (
            HF_TOLERANCE if c.impl.startswith("hf-") else MCORE_TOLERANCE if c.impl == "megatron-local" else TOLERANCE)
        if c.impl.startswith("hf-") and c.scope == "layer" and retained is not None:
            retained = None  # a standalone HF layer's input is a live leaf that is not saved (validation/hf.py)
        allocated = sum(predict(c, device, allocated=True).values()) if cuda else None
        results.append(CaseResult(c, predict(c, device), measured, sum(predict(c, device, paper_only=True).values()),
                                  retained, m.peak_bytes, tol, notes, allocated))
    return results


def compare_traced(case: ValidationCase, inventory_data: dict, measured: dict) -> CaseResult:
    """A traced inventory file's data (as the tracer writes it), read by memplan, against what a real
    run saved (validation/trace_measure.py measure_hf_config): per decoder layer and outside the layers."""
    predicted = bucket_bytes(TracedFile.model_validate(inventory_data), case.s, case.b)
    return CaseResult(case, predicted, measured_buckets(measured), 0, None, None, HF_TOLERANCE)


def measured_buckets(measured: dict) -> dict[str, int]:
    """A real run's saved bytes (validation/trace_measure.py measure_hf_config) in bucket_bytes's buckets: each decoder
    layer, and outside the layers."""
    real = {f"layer {i}": n for i, n in enumerate(measured["layers"])}
    real["outside the layers"] = measured["outside"]
    return real


def run_traced(cases: list[ValidationCase]) -> list[CaseResult]:
    """Trace each case's family config and run the real model (torch is imported here)."""
    trace = importlib.import_module(harness().__name__ + ".trace")
    configs = importlib.import_module(harness().__name__ + ".trace_config")
    measure = importlib.import_module(harness().__name__ + ".trace_measure")
    results, traces = [], {}
    for c in cases:
        cfg, impl = configs.FAMILIES[c.arch]
        if c.arch not in traces:
            traces[c.arch] = trace.trace_hf_config(cfg, impl=impl, kernels="cpu", moments=False)  # saves only
        results.append(compare_traced(c, traces[c.arch], measure.measure_hf_config(cfg, c.s, c.b, impl=impl)))
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

