"""The peak of a whole training step (validation/step.py), as `memplan validate --peak` checks it: the step cases
(`PeakCase`) and their grid, the plan and the traced family model each runs, memplan's predicted step timeline,
running the torch harness on them (`run_peak`) and the comparison (`PeakResult`, `peak_summary`).

torch is imported only when a measurement actually runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memplan.core.harness import harness
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, GpuSpec
from memplan.core.training import OPTIMIZER_IMPLS_OF, TrainingSpec
from memplan.inventory import assemble
from memplan.inventory.mst import pieces
from memplan.inventory.traced_file import file_name
from memplan.memory.states import total_params
from memplan.plan.estimate import step_peaks
from memplan.presets.catalog import gpu_names, load_gpu
from memplan.presets.hf_config import read_hf_config

PEAK_TOLERANCE = 1e-2  # 1 % of the measured allocated peak
# optimizers validation/step.py runs besides AdamW (torch 2.13 on CPU); adam8bit (bitsandbytes, CUDA only)
# and lion (not in torch) are derived from their code, not measured
MEASURED_OPTIMIZERS = ("sgd", "sgd-nomomentum", "adafactor", "muon")


# The transformers families of validation/trace_config.py FAMILIES that a peak case can run (model "family"), by
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
    lora: int = 0  # transformers Llama: peft LoRA of this rank, the base frozen (memplan/inventory/lora.py); 0: none
    lora_targets: tuple[str, ...] = ()  # empty: peft's default
    reentrant: bool = False  # transformers' gradient checkpointing with use_reentrant=True (memplan/inventory/hf_trainer.py)
    batch_layout: str = "full"  # full | padded | packed (memplan/inventory/hf_trainer.py; measured by validation/trainer_loop.py)

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
        mst=case.mst, optimizer_in_backward=case.in_backward, lora_rank=case.lora,
        lora_targets=case.lora_targets or None, batch_layout=case.batch_layout,
        checkpoint_reentrant=case.reentrant))


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
        # (validation/losses.py chunked_vocab_parallel_cross_entropy, memplan/inventory/chunked_loss.py): chunks of 64 tokens
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
    """The traced families' whole steps (validation/trace_config.py FAMILIES' small configs: h = 64, a = 4, f = 160,
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
    # the harness's whole measurement (validation/step.py StepMeasurement: states, phases, timeline), for the
    # checks that read more of the same step than its peak
    measurement: Any = dataclasses.field(default=None, repr=False, compare=False)

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
        m = measure_step(StepCase(**step_fields(c)))
        step = predict_peak(c)
        predicted = int(step.peak_bytes) + (_cuda_workspace() if c.backend == "cuda" else 0)
        e = step.peak_event
        at = e.phase + (f" {e.layer}" if e.layer is not None else "")
        measured_at = m.peak_phase + (f" {m.peak_layer + 1}" if m.peak_layer is not None else "")  # layers from 1
        results.append(PeakResult(c, predicted, int(m.peak_bytes), at, measured_at, e.moment, tolerance,
                                  total_params(peak_config(c).model), m.persistent["weights"] // 2, m))
    return results


def step_fields(case: PeakCase, backend: Optional[str] = None) -> dict[str, Any]:
    """The validation.step.StepCase fields of the run a peak case measures (`backend`: in place of the case's), as
    JSON-ready data."""
    c = case
    return dict(model=c.model, attn=c.attn, s=c.s, b=c.b, h=c.h, a=c.a, L=c.L, v=c.v, f=c.f, g=c.g,
                head_dim=c.head_dim, loss_chunks=c.loss_chunks, p_drop=c.p_drop, recompute=c.recompute, loop=c.loop,
                optimizer="for-loop" if c.in_backward else c.optimizer, algorithm=c.algorithm,
                microbatches=c.microbatches, backend=backend or c.backend, family=c.family, lora=c.lora,
                lora_targets=c.lora_targets, **_mst_pieces(c))


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


def card_preset(device_name: Optional[str] = None) -> GpuSpec:
    """The GPU preset of this machine's GPU (or of the card named `device_name`, as torch.cuda.get_device_name()
    gives it), by its name (the H100's for a GPU without one)."""
    if device_name is None:
        import torch

        device_name = torch.cuda.get_device_name()
    name = device_name.lower()
    match = [g for g in gpu_names() if g.split("-")[0] in name]
    return load_gpu(match[0] if match else "h100-80gb")


def _cuda_workspace() -> int:
    """The cuBLAS workspace in PyTorch's pool on this machine's GPU, from its preset: max_memory_allocated counts it
    beside the tensors."""
    return card_preset().step_workspace_bytes


def peak_summary(results: list[PeakResult]) -> dict[str, Any]:
    worst = max(results, key=lambda r: abs(r.error)) if results else None
    return {
        "cases": len(results),
        "passed": sum(r.passed for r in results),
        "failed": sum(not r.passed for r in results),
        "largest_error": abs(worst.error) if worst else 0.0,
        "tolerance": PEAK_TOLERANCE,
    }
