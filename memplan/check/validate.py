"""`memplan validate`: memplan's predictions against memory measured on real torch code.

The measurements come from `validation/` (the only torch code; it never imports memplan and
computes no size from a formula). This module builds the grid of cases, asks memplan's inventory
for its prediction of each saved tensor (by label: the inventory's term ids are the labels the
reference layer tags), and compares, term by term and in total.

torch is imported only when a validation actually runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from memplan.core.harness import harness
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import OPTIMIZER_IMPLS_OF, TrainingSpec
from memplan.inventory import assemble
from memplan.inventory.mcore import QKV_TERMS
from memplan.inventory.mst import pieces
from memplan.inventory.traced import TracedFile, bucket_bytes, file_name
from memplan.inventory.types import CUDA_BLOCK_BYTES
from memplan.memory.stage import stage_memory
from memplan.memory.states import total_params
from memplan.memory.term_bytes import PlanValues
from memplan.plan.estimate import step_peaks
from memplan.presets import gpu_names, load_gpu, read_hf_config

TOLERANCE = 1e-3  # 0.1 % of a case's activation bytes (issue: CPU tolerance)
HF_TOLERANCE = 1e-2  # 1 % per layer against transformers' own code
# megatron-core's local spec is measured exactly; 0.01 % leaves room only for the 4-byte int32 attn_mask_type
# tensor of selective recompute, which the live tracker does not see created (a factory, no op output)
MCORE_TOLERANCE = 1e-4

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
    impl: str = "torch"  # torch (validation/layers.py) | hf-eager | hf-sdpa (transformers) | megatron-local
    arch: str = "gpt2"  # hf-*: gpt2 | llama; megatron-local: gpt | llama
    g: Optional[int] = None  # llama: key/value heads
    head_dim: Optional[int] = None  # llama: width of one head (None = h/a)
    dropout: float = 0.1
    # megatron-local mixture of experts (experts > 0): megatron-core's MoELayer in every layer, balanced routing,
    # aux loss on (memplan/terms_moe.py)
    experts: int = 0
    topk: int = 2
    fe: Optional[int] = None
    fs: int = 0
    ep: int = 1
    etp: Optional[int] = None
    dispatcher: str = "alltoall"
    capacity: Optional[float] = None
    pad: bool = False
    # megatron-local multi-head latent attention (kv_lora > 0: megatron-core's MLASelfAttention, memplan/terms_mla.py)
    kv_lora: int = 0
    q_lora: Optional[int] = None
    dn: int = 32
    dr: int = 16
    dv: int = 24

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
                     moe_pad_to_capacity=case.pad, moe_token_dispatcher=case.dispatcher)
    if case.kv_lora:
        shape.update(kv_lora_rank=case.kv_lora, q_lora_rank=case.q_lora, qk_nope_head_dim=case.dn,
                     qk_rope_head_dim=case.dr, v_head_dim=case.dv)
    return ModelSpec(**shape, num_kv_heads=case.g, head_dim=case.head_dim, norm="rmsnorm", mlp="swiglu",
                     position_embedding="rope", tied_embeddings=False, bias=False, dropout=case.dropout > 0,
                     attention="eager" if case.impl == "hf-eager" else "flash")


def predict(case: ValidationCase, device: str = "cpu", paper_only: bool = False, allocated: bool = False
            ) -> dict[str, int]:
    """memplan's bytes per label for one rank of the case, from the case's implementation inventory;
    `allocated`: each storage rounded up as the device's allocator does (what it reports)."""
    model = case_model(case)
    config = Config(model=model, parallel=ParallelSpec(tp=case.t, sp=case.sp, ep=case.ep, etp=case.etp, dp=case.ep),
                    training=TrainingSpec(micro_batch=case.b, recompute=case.recompute))
    inv = assemble.inventory_for(model, case.impl, device)
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
        # heads wider in total than h, as Mistral-Nemo (32 x 128 > 5120) and Gemma: q = 4 x 24 = 96, h = 64
        for scope in ("layer", "model"):
            cases.append(ValidationCase("llama s32 b2 h64 a4 g2 head_dim24", scope, 32, 2, 64, 4, 160, 1, False,
                                        "none", "ledger", impl=impl, arch="llama", g=2, head_dim=24, dropout=0.0))
        if fake:
            cases.append(ValidationCase("llama3-8b layer s4096", "layer", 4096, 1, 4096, 32, 14336, 1, False, "none",
                                        "fake", v=128256, impl=impl, arch="llama", g=8, dropout=0.0))
    return cases


MCORE_SHAPE = dict(s=32, b=2, h=64, a=4)  # every megatron-core case; llama: g = 2, f = 160, no dropout


def mcore_case(arch: str, t: int = 1, sp: bool = False, recompute: str = "none", scope: str = "layer",
               backend: str = "ledger") -> ValidationCase:
    """One megatron-core local-spec case (validation/mcore.py): GPT (LayerNorm, GeLU, learned positions,
    dropout 0.1) or Llama-like (RMSNorm, SwiGLU, RoPE, GQA 4 heads / 2 groups, f = 160, no dropout);
    scope "model" is a 2-layer GPTModel with its loss."""
    llama = arch == "llama"
    return ValidationCase(f"mcore {arch}", scope, MCORE_SHAPE["s"], MCORE_SHAPE["b"], MCORE_SHAPE["h"],
                          MCORE_SHAPE["a"], 160 if llama else None, t, sp, recompute, backend, v=256, L=2,
                          impl="megatron-local", arch=arch, g=2 if llama else None, dropout=0.0 if llama else 0.1)


def mcore_grid(tps: Iterable[int] = (1, 2), recomputes: Iterable[str] = ("none", "selective", "full"),
               archs: Iterable[str] = ("gpt", "llama"), scopes: Iterable[str] = ("layer", "model")
               ) -> list[ValidationCase]:
    """megatron-core's local spec on CPU: GPT and Llama-like, one layer and a GPTModel, t = 1 and 2 (gloo
    processes), SP on and off, recompute none / selective / full; the GPT cases at t = 1 also through the
    live-storage tracker (retained after forward = the saved bytes)."""
    cases = []
    for arch in archs:
        for t in tps:
            for sp in ([False, True] if t > 1 else [False]):
                for rec in recomputes:
                    for scope in scopes:
                        cases.append(mcore_case(arch, t, sp, rec, scope))
                        if arch == "gpt" and t == 1:
                            cases.append(mcore_case(arch, t, sp, rec, scope, "live"))
    if "llama" in archs and "layer" in scopes:  # megatron-core's MoELayer (memplan/terms_moe.py)
        cases += [mcore_moe_case(), mcore_moe_case("allgather"), mcore_moe_case(capacity=1.0, pad=True),
                  mcore_moe_case(capacity=0.5), mcore_moe_case(fs=64)]
        if 2 in tps:
            cases += [mcore_moe_case(ep=2), mcore_moe_case("allgather", ep=2), mcore_moe_case(t=2, fs=64),
                      mcore_moe_case("allgather", t=2), mcore_moe_case(t=2, etp=1), mcore_moe_case("allgather", t=2, etp=1)]
        # megatron-core's MLASelfAttention (memplan/terms_mla.py)
        cases += [mcore_mla_case(None)] + [mcore_mla_case(recompute=r) for r in recomputes] + [mcore_mla_case(experts=4)]
        if 2 in tps:
            cases += [mcore_mla_case(t=2), mcore_mla_case(t=2, sp=True)]
    return cases


def mcore_moe_case(dispatcher: str = "alltoall", ep: int = 1, capacity: Optional[float] = None, pad: bool = False,
                   fs: int = 0, scope: str = "layer", t: int = 1, etp: Optional[int] = None) -> ValidationCase:
    """One megatron-core MoE case: the Llama-like layer of mcore_case with megatron-core's MoELayer as its MLP
    (4 SequentialMLP experts of f_e = 96, top-2, aux loss on, routing forced to be balanced); t > 1 with SP (MoE
    needs it), etp = t unless given."""
    base = mcore_case("llama", t, t > 1, scope=scope)
    name = f"mcore moe {dispatcher} ep{ep}" + (f" t{t} etp{etp or t}" if t > 1 else "")
    return dataclasses.replace(base, name=name, experts=4, topk=2, fe=96, fs=fs, ep=ep, etp=etp,
                               dispatcher=dispatcher, capacity=capacity, pad=pad)


def mcore_mla_case(q_lora: Optional[int] = 40, t: int = 1, sp: bool = False, recompute: str = "none",
                   experts: int = 0) -> ValidationCase:
    """One megatron-core multi-head latent attention case: the Llama-like layer of mcore_case (no GQA) with
    megatron-core's MLASelfAttention and its latent norms: a = 4 heads of d_n = 32 + d_r = 16 (Q / K) and
    d_v = 24 (V), r_kv = 48, r_q = 40 (None: the direct q projection); `experts` > 0: the MoE layer of
    mcore_moe_case as its MLP (DeepSeek-V3's layer)."""
    base = dataclasses.replace(mcore_case("llama", t, sp, recompute), g=None)
    name = f"mcore mla r_q{q_lora}" + (f" t{t}" + (" sp" if sp else "") if t > 1 else "") + (
        f" {recompute}" if recompute != "none" else "") + (" moe" if experts else "")
    moe = dict(experts=experts, topk=2, fe=96, fs=64) if experts else {}
    return dataclasses.replace(base, name=name, kv_lora=48, q_lora=q_lora, dn=32, dr=16, dv=24, **moe)


def mcore_available() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None




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
            recompute=c.recompute, scope=c.scope, p_drop=c.dropout, backend=c.backend,
            **(dict(experts=c.experts, topk=c.topk, fe=c.fe, fs=c.fs, ep=c.ep, etp=c.etp, dispatcher=c.dispatcher,
                    capacity=c.capacity, pad=c.pad, aux_loss=0.01) if c.experts else {}),
            **(dict(kv_lora=c.kv_lora, q_lora=c.q_lora, qk_nope=c.dn, qk_rope=c.dr, v_head=c.dv) if c.kv_lora else {}))
            for c in (cases[i] for i in mc)])
        for i, m in zip(mc, measured):
            out[i] = m
    for i, c in enumerate(cases):
        if c.impl.startswith("hf-"):
            out[i] = measure_hf(c.arch, c.impl.removeprefix("hf-"), c.s, c.b, c.h, c.a, f=c.f, g=c.g,
                                head_dim=c.head_dim, v=c.v, L=c.layers, dropout=c.dropout, scope=c.scope, backend=c.backend)
    return out


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


def traced_grid() -> list[ValidationCase]:
    """Every family the tracer is checked on (validation/trace.py FAMILIES: Qwen2, Qwen3, Gemma 1-3,
    Phi-3, Mistral's sliding window, Mixtral, DeepSeek-V3), each a small model at two (s, b) on CPU:
    a traced inventory, as memplan reads it, against a real run. Imports torch (the family configs
    live with the tracer)."""
    families = importlib.import_module(harness().__name__ + ".trace").FAMILIES
    cases = []
    for family, (cfg, impl) in families.items():
        for s, b in ((16, 2), (40, 3)):
            cases.append(ValidationCase(f"{family} s{s} b{b} (traced)", "model", s, b, cfg["hidden_size"],
                                        cfg["num_attention_heads"], cfg.get("intermediate_size"), 1, False, "none",
                                        "ledger", v=cfg["vocab_size"], L=cfg["num_hidden_layers"], impl=impl,
                                        arch=family, g=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
                                        dropout=0.0))
    return cases


def compare_traced(case: ValidationCase, inventory_data: dict, measured: dict) -> CaseResult:
    """A traced inventory file's data (as the tracer writes it), read by memplan, against what a real
    run saved (validation/trace.py measure_hf_config): per decoder layer and outside the layers."""
    predicted = bucket_bytes(TracedFile.model_validate(inventory_data), case.s, case.b)
    real = {f"layer {i}": n for i, n in enumerate(measured["layers"])}
    real["outside the layers"] = measured["outside"]
    return CaseResult(case, predicted, real, 0, None, None, HF_TOLERANCE)


def run_traced(cases: list[ValidationCase]) -> list[CaseResult]:
    """Trace each case's family config and run the real model (torch is imported here)."""
    trace = importlib.import_module(harness().__name__ + ".trace")
    results, traces = [], {}
    for c in cases:
        cfg, impl = trace.FAMILIES[c.arch]
        if c.arch not in traces:
            traces[c.arch] = trace.trace_hf_config(cfg, impl=impl, kernels="cpu", moments=False)  # saves only
        results.append(compare_traced(c, traces[c.arch], trace.measure_hf_config(cfg, c.s, c.b, impl=impl)))
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


# ---------------------------------------------------------------------------------------------
# the peak of a whole training step (validation/step.py)

PEAK_TOLERANCE = 1e-2  # 1 % of the measured allocated peak
# optimizers validation/step.py runs besides AdamW (torch 2.13 on CPU); adam8bit (bitsandbytes, CUDA only)
# and lion (not in torch) are derived from their code, not measured
MEASURED_OPTIMIZERS = ("sgd", "sgd-nomomentum", "adafactor", "muon")


# The transformers families of validation/trace.py FAMILIES that a peak case can run (model "family"), by
# the architecture their config.json names: memplan reads the config as `estimate --hf-config` does
FAMILY_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM",
                        "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                        "mistral-window": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                        "deepseek-v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class PeakCase:
    """One whole training step to measure: a model (the K22 reference model in a Megatron-like
    loop, bf16-mixed; transformers GPT-2 / Llama, or a traced family's small config, with torch AdamW
    on bf16 weights, bf16-true), its recompute, optimizer implementation, micro-batches and measurement
    backend."""

    name: str
    model: str  # k22 | gpt2 | llama | family (a traced transformers family: `family`)
    s: int
    b: int
    h: int
    a: int
    L: int = 2
    v: int = 256
    f: Optional[int] = None
    g: Optional[int] = None
    head_dim: Optional[int] = None
    loss_chunks: int = 1  # LM head + loss in checkpointed chunks (validation/losses.py)
    in_backward: bool = False  # transformers Llama: a for-loop AdamW per parameter stepped in the backward
    mst: int = 1  # transformers Llama: MsT mini-sequences for the MLP and the LM head (validation/mst.py); 1: off
    attn: str = "eager"  # transformers: eager | sdpa
    p_drop: float = 0.0
    recompute: str = "none"
    optimizer: str = "fused"  # the optimizer's implementation: foreach | fused | for-loop
    microbatches: int = 1
    backend: str = "live"  # live | fake | cuda
    algorithm: str = "adamw"  # the optimizer (TrainingSpec.optimizer): adamw | sgd | sgd-nomomentum | adafactor | muon
    family: Optional[str] = None  # model "family": FAMILY_ARCHITECTURES' name (its config: validation/trace.py)

    @property
    def loop(self) -> str:
        return "megatron" if self.model == "k22" else ("in-backward" if self.in_backward else "torch")

    @property
    def impl(self) -> str:
        return "torch" if self.model == "k22" else f"hf-{self.attn}"


def peak_config(case: PeakCase) -> Config:
    """The plan a peak case runs, as memplan's Config."""
    shape = dict(name=case.name, num_layers=case.L, hidden_size=case.h, num_attention_heads=case.a,
                 seq_length=case.s, vocab_size=case.v, ffn_hidden_size=case.f, dropout=case.p_drop > 0)
    if case.model == "family":
        model = family_model(case)
    elif case.model == "llama":
        model = ModelSpec(**shape, num_kv_heads=case.g, head_dim=case.head_dim, norm="rmsnorm", mlp="swiglu",
                          position_embedding="rope",
                          tied_embeddings=False, bias=False, attention="flash" if case.attn == "sdpa" else "eager")
    elif case.model == "gpt2":
        model = ModelSpec(**shape, attention="flash" if case.attn == "sdpa" else "eager")
    else:
        model = ModelSpec(**shape)
    precision = "bf16-mixed" if case.loop == "megatron" else "bf16-true"
    return Config(model=model, training=TrainingSpec(
        micro_batch=case.b, global_batch=case.b * case.microbatches, recompute=case.recompute, precision=precision,
        optimizer=case.algorithm, optimizer_impl=None if case.in_backward else case.optimizer, loss_chunks=case.loss_chunks,
        mst=case.mst, optimizer_in_backward=case.in_backward))


def family_model(case: PeakCase) -> ModelSpec:
    """The ModelSpec of a family case as `memplan estimate --hf-config` builds it: the family's small
    config (validation/step.py family_config, the config the measurement runs) with its architecture,
    read by presets.read_hf_config, its `inventory` a directory holding that config's trace (the CPU
    kernels'; the CUDA kernels' for the cuda backend: validation/trace.py), s the case's. Imports torch
    (the trace)."""
    kernels = "cuda" if case.backend == "cuda" else "cpu"
    directory = _family_trace(case.family, case.impl, kernels, case.h, case.a, case.L, case.v, case.f, case.g,
                              case.head_dim)
    model = read_hf_config(str(Path(directory) / "config.json")).model
    return ModelSpec.model_validate({**model.model_dump(), "name": case.name, "seq_length": case.s,
                                     "inventory": directory})


_TRACES: list = []  # the temporary directories of the family traces, removed at exit


@functools.lru_cache(maxsize=None)
def _family_trace(family: str, impl: str, kernels: str, *shape: Optional[int]) -> str:
    """A directory with a family config.json and its trace for `impl` and `kernels` (traced once per config)."""
    step = importlib.import_module(harness().__name__ + ".step")
    trace = importlib.import_module(harness().__name__ + ".trace")
    config = {**step.family_config(family, *shape), "architectures": [FAMILY_ARCHITECTURES[family]]}
    _TRACES.append(tempfile.TemporaryDirectory(prefix=f"memplan-peak-{family}-"))
    directory = Path(_TRACES[-1].name)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    data = trace.trace_hf_config(config, impl=impl, kernels=kernels)
    (directory / file_name(impl, kernels)).write_text(trace.to_yaml(data), encoding="utf-8")
    return str(directory)


def predict_peak(case: PeakCase) -> Any:
    """memplan's step timeline of the case (CPU kernels), through the same function as estimate."""
    config = peak_config(case)
    device = "cuda" if case.backend == "cuda" else "cpu"  # CPU kernels for the live and fake backends
    inv = assemble.training_inventory(config.model, case.impl, device, config.training)
    return step_peaks(config, inv, walk=0)[0]


def peak_grid(fake: bool = True, device: str = "cpu") -> list[PeakCase]:
    """The CI grid of whole steps: transformers Llama (GQA) and GPT-2, eager and sdpa, with and
    without gradient checkpointing, foreach and fused AdamW; b = 2 and two micro-batches; the K22
    reference model in the Megatron-like loop with no / selective / full recompute; short
    sequences where the optimizer step is the peak; SGD with and without momentum, Adafactor and Muon
    in every implementation torch has; and, under FakeTensorMode, a Llama 3 8B-shaped
    2-layer model at s = 4096 and a GPT-3 175B-shaped one at s = 2048. With device "cuda" the same
    cases run on the GPU against torch.cuda.max_memory_allocated (the fake ones for real)."""
    if device == "cuda":
        return [dataclasses.replace(c, backend="cuda") for c in peak_grid(fake, "cpu")]
    cases = []
    llama = dict(model="llama", h=64, a=4, g=2, f=192)
    gpt2 = dict(model="gpt2", h=64, a=4)
    for shape in (llama, gpt2):
        for attn in ("sdpa", "eager"):
            for rec in ("none", "full"):
                for opt in ("foreach", "fused"):
                    cases.append(PeakCase(f"{shape['model']} {attn} s128", s=128, b=1, attn=attn, recompute=rec,
                                          optimizer=opt, **shape))
    cases += [
        PeakCase("llama sdpa s128 b2", s=128, b=2, attn="sdpa", **llama),
        PeakCase("llama sdpa s128 M2", s=128, b=1, attn="sdpa", microbatches=2, **llama),
        PeakCase("gpt2 eager s64 b2", s=64, b=2, attn="eager", recompute="full", **gpt2),
        # the LM head and loss in checkpointed chunks (validation/losses.py), v = 8192 so the loss is the peak:
        # chunks of 64 tokens; chunks of 8 tokens where the head's weight gradients (v x h) dominate; with
        # gradient checkpointing; with gradient accumulation (the chunks' gradient sum beside .grad)
        PeakCase("llama sdpa s256 v8192 N4", s=256, b=1, v=8192, attn="sdpa", loss_chunks=4, **llama),
        PeakCase("llama sdpa s256 v8192 N4 M2", s=256, b=1, v=8192, attn="sdpa", loss_chunks=4, microbatches=2,
                 **llama),
        PeakCase("gpt2 eager s256 v8192 N4 full", s=256, b=1, v=8192, attn="eager", loss_chunks=4, recompute="full",
                 optimizer="fused", **gpt2),
        PeakCase("llama sdpa s64 h128 v8192 N8", model="llama", s=64, b=1, h=128, a=4, g=2, f=384, v=8192,
                 attn="sdpa", loss_chunks=8),
        # the reference model (--impl torch) with its tied head and vocab-parallel cross-entropy in checkpointed chunks
        # (validation/losses.py chunked_vocab_parallel_cross_entropy, memplan/chunked_loss.py): chunks of 64 tokens
        # (the recompute of a chunk's fp32 logits is the peak), with full recompute, and chunks of 8 tokens at
        # h = 128 (the head's weight-gradient sum is the peak)
        *(PeakCase("k22 s256 v8192 N4" if rec == "none" else "k22 s256 N4 full", model="k22", s=256, b=1, h=64, a=4,
                   v=8192, p_drop=0.1, loss_chunks=4, recompute=rec) for rec in ("none", "full")),
        PeakCase("k22 s64 h128 N8", model="k22", s=64, b=1, h=128, a=4, v=8192, p_drop=0.1, loss_chunks=8),
        # a small vocabulary (v = 64): the final norm's fp32 backward (terms_hf final_norm_backward) is the peak
        PeakCase("llama sdpa s128 v64", s=128, b=1, v=64, attn="sdpa", **llama),
        # heads wider in total than h (Mistral-Nemo, Gemma): q = 4 x 24 = 96 > h = 64
        *(PeakCase(f"llama {attn} s128 head_dim24", s=128, b=1, attn=attn, head_dim=24, **llama)
          for attn in ("sdpa", "eager")),
    ]
    for opt in ("foreach", "fused"):
        cases += [
            PeakCase("llama sdpa s16 h128", model="llama", s=16, b=1, h=128, a=4, g=2, f=384, attn="sdpa",
                     optimizer=opt),
            PeakCase("llama sdpa s16 h128 M2", model="llama", s=16, b=1, h=128, a=4, g=2, f=384, attn="sdpa",
                     optimizer=opt, microbatches=2),
            PeakCase("gpt2 eager s16 h128", model="gpt2", s=16, b=1, h=128, a=4, attn="eager", optimizer=opt),
            PeakCase("k22 s16 h128", model="k22", s=16, b=1, h=128, a=4, p_drop=0.1, optimizer=opt),
        ]
        for rec in ("none", "selective", "full"):
            cases.append(PeakCase("k22 s128", model="k22", s=128, b=1, h=64, a=4, p_drop=0.1, recompute=rec,
                                  optimizer=opt))
    cases.append(PeakCase("k22 s64 b2", model="k22", s=64, b=2, h=64, a=4, v=512, p_drop=0.1, recompute="full"))
    # the other optimizers torch runs on CPU, each in every implementation it has (specs.OPTIMIZER_IMPLS_OF):
    # short steps where the optimizer is the peak, in transformers' Llama (q/k/v and gate/up apart, bf16
    # states), GPT-2 (fused c_attn / c_fc, biases) and the reference model in the Megatron-like loop (fp32
    # master weights and states); and a longer Llama step where the backward is the peak, beside the states
    for algo in MEASURED_OPTIMIZERS:
        for opt in OPTIMIZER_IMPLS_OF[algo]:
            cases += [
                PeakCase(f"llama sdpa s16 h128 {algo}", model="llama", s=16, b=1, h=128, a=4, g=2, f=384, attn="sdpa",
                         optimizer=opt, algorithm=algo),
                PeakCase(f"gpt2 eager s16 h256 {algo}", model="gpt2", s=16, b=1, h=256, a=4, attn="eager",
                         optimizer=opt, algorithm=algo),
                PeakCase(f"k22 s16 h128 {algo}", model="k22", s=16, b=1, h=128, a=4, p_drop=0.1, optimizer=opt,
                         algorithm=algo),
            ]
        cases.append(PeakCase(f"llama sdpa s128 {algo}", s=128, b=1, attn="sdpa", optimizer=OPTIMIZER_IMPLS_OF[algo][0],
                              algorithm=algo, **llama))
    # Muon beside an AdamW whose share (embedding and LM head, v = 4096) outweighs the hidden matrices:
    # the foreach AdamW's temporary is the step's, the fused one leaves Muon's Newton-Schulz
    cases += [PeakCase("llama sdpa s16 h128 v4096 muon", model="llama", s=16, b=1, h=128, a=4, g=2, f=384, v=4096,
                       attn="sdpa", optimizer=opt, algorithm="muon") for opt in ("foreach", "fused")]
    cases += family_peak_cases()
    cases += mst_peak_cases()
    if fake:
        cases += [
            PeakCase("llama3-8b shape s4096", model="llama", s=4096, b=1, h=4096, a=32, g=8, f=14336, v=128256,
                     attn="sdpa", backend="fake"),
            PeakCase("llama3-8b shape s4096", model="llama", s=4096, b=1, h=4096, a=32, g=8, f=14336, v=128256,
                     attn="sdpa", recompute="full", optimizer="foreach", backend="fake"),
            PeakCase("gpt3-175b shape s2048", model="k22", s=2048, b=1, h=12288, a=96, v=51200, p_drop=0.1,
                     backend="fake"),
        ]
    return cases


def family_peak_cases() -> list[PeakCase]:
    """The traced families' whole steps (validation/trace.py FAMILIES' small configs: h = 64, a = 4, f = 160,
    2-4 layers), s = 64, b = 2, with v = 128 so that with gradient checkpointing a decoder layer's backward
    is the step's peak (the traced inventory's traced transients) and without it the loss's; hf-sdpa, Gemma 2
    eager (transformers has no sdpa for it)."""
    both = ("none", "full")
    families = [("qwen2", "sdpa", 2, both), ("qwen3", "sdpa", 2, both), ("gemma", "sdpa", 2, both),
                ("gemma2", "eager", 3, both), ("gemma3", "sdpa", 4, both), ("phi3", "sdpa", 2, both),
                ("mistral-window", "sdpa", 2, both), ("mixtral", "sdpa", 2, both), ("deepseek-v3", "sdpa", 3, both)]
    return [PeakCase(f"{family} {attn} s64 v128", model="family", family=family, s=64, b=2, h=64, a=4, f=160, L=L,
                     v=128, attn=attn, recompute=rec)
            for family, attn, L, recomputes in families for rec in recomputes]


@dataclass
class PeakResult:
    case: PeakCase
    predicted: int
    measured: int
    predicted_at: str  # phase and layer of memplan's peak
    measured_at: str  # phase and layer of the measured peak
    predicted_moment: str = ""  # what happens at memplan's peak
    tolerance: float = PEAK_TOLERANCE
    predicted_params: Optional[int] = None  # memplan's parameter count of the model (states.total_params)
    measured_params: Optional[int] = None  # the real model's (its bf16 weights' bytes / 2)

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / max(self.measured, 1)

    @property
    def passed(self) -> bool:
        return abs(self.error) <= self.tolerance


def run_peak(cases: list[PeakCase], tolerance: float = PEAK_TOLERANCE) -> list[PeakResult]:
    """Measure each case's second training step (validation/step.py) and compare its allocated
    peak with memplan's."""
    step = importlib.import_module(harness().__name__ + ".step")  # torch is imported here, and only here
    StepCase, measure_step = step.StepCase, step.measure_step

    results = []
    for c in cases:
        m = measure_step(StepCase(model=c.model, attn=c.attn, s=c.s, b=c.b, h=c.h, a=c.a, L=c.L, v=c.v, f=c.f,
                                  g=c.g, head_dim=c.head_dim, loss_chunks=c.loss_chunks, p_drop=c.p_drop, recompute=c.recompute, loop=c.loop,
                                  optimizer="for-loop" if c.in_backward else c.optimizer, algorithm=c.algorithm,
                                  microbatches=c.microbatches,
                                  backend=c.backend, family=c.family, **_mst_pieces(c)))
        step = predict_peak(c)
        predicted = int(step.peak_bytes) + (_cuda_workspace() if c.backend == "cuda" else 0)
        e = step.peak_event
        at = e.phase + (f" {e.layer}" if e.layer is not None else "")
        measured_at = m.peak_phase + (f" {m.peak_layer + 1}" if m.peak_layer is not None else "")  # layers from 1
        results.append(PeakResult(c, predicted, int(m.peak_bytes), at, measured_at, e.moment, tolerance,
                                  total_params(peak_config(c).model), m.persistent["weights"] // 2))
    return results


def _mst_pieces(case: PeakCase) -> dict[str, int]:
    """The harness's MsT pieces (validation/step.py mst_mlp, mst_head) for a case, as memplan derives them."""
    if case.mst == 1:
        return {}
    mlp, head = pieces(case.mst, case.s, case.b)
    return {"mst_mlp": mlp, "mst_head": head}


def mst_peak_cases() -> list[PeakCase]:
    """MsT (validation/mst.py) on transformers' Llama with gradient checkpointing, b = 1: the LM head the peak
    (v = 4096, 4 and 8 pieces), a decoder layer's MLP the peak (v = 256, f = 768: 4 pieces, and 8 pieces where
    the second piece's running weight-gradient sums decide), eager attention and a foreach AdamW."""
    llama = dict(model="llama", b=1, h=64, a=4, g=2, recompute="full")
    return [
        PeakCase("llama s256 mst4", s=256, v=4096, f=192, attn="sdpa", mst=4, **llama),
        PeakCase("llama s256 mst8", s=256, v=4096, f=192, attn="sdpa", mst=8, **llama),
        PeakCase("llama f768 mst4", s=512, v=256, f=768, attn="sdpa", mst=4, **llama),
        PeakCase("llama h256 mst8", model="llama", b=1, h=256, a=4, g=2, s=64, v=256, f=768,
                 attn="sdpa", mst=8, recompute="full"),
        PeakCase("llama eager mst4", s=256, v=256, f=768, attn="eager", mst=4, optimizer="foreach",
                 **llama),
        # the optimizer step in the backward (MsT's benchmark loop): with MsT, with gradient checkpointing alone, and
        # short steps where the embedding's and the LM head's steps at the end are the peak
        PeakCase("llama mst4 ib", s=256, v=4096, f=192, attn="sdpa", mst=4, in_backward=True,
                 **llama),
        PeakCase("llama f768 mst4 ib", s=512, v=256, f=768, attn="sdpa", mst=4,
                 in_backward=True, **llama),
        PeakCase("llama full ib", s=256, v=4096, f=192, attn="sdpa", in_backward=True, **llama),
        PeakCase("llama s16 ib", model="llama", b=1, h=64, a=4, g=2, s=16, v=4096, f=192,
                 attn="sdpa", in_backward=True),
        PeakCase("llama f768 ib", model="llama", b=1, h=64, a=4, g=2, s=128, v=256, f=768,
                 attn="sdpa", in_backward=True),
    ]


def _cuda_workspace() -> int:
    """The cuBLAS workspace in PyTorch's pool on this machine's GPU, from its preset (the H100's
    figure for a GPU without one): max_memory_allocated counts it beside the tensors."""
    import torch

    name = torch.cuda.get_device_name().lower()
    match = [g for g in gpu_names() if g.split("-")[0] in name]
    return load_gpu(match[0] if match else "h100-80gb").workspace_bytes


def peak_summary(results: list[PeakResult]) -> dict[str, Any]:
    worst = max(results, key=lambda r: abs(r.error)) if results else None
    return {
        "cases": len(results),
        "passed": sum(r.passed for r in results),
        "failed": sum(not r.passed for r in results),
        "largest_error": abs(worst.error) if worst else 0.0,
        "tolerance": PEAK_TOLERANCE,
    }
