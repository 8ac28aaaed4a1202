"""peft LoRA adapters (and QLoRA's 4-bit base) on transformers' Llama layout: what the adapters save for the
backward, what the frozen base layers no longer save, and the adapters' shapes (memplan/memory/adapters.py
turns them into weights, gradients and optimizer states).

Read from peft 0.21.2 (tuners/lora/layer.py Linear.forward) and measured on CPU per layer
(validation/hf.py with a peft-wrapped model; tests/test_lora.py):

- get_peft_model freezes every base parameter and, with autocast_adapter_dtype=True (its default), keeps
  the adapters of a bf16 model in fp32; the forward casts x to the adapters' dtype, so each target linear
  makes its own fp32 copy of its input: lora_A saves it (or, with --lora-dropout > 0, the dropout output;
  the dropout keeps its mask: in fp32 on CPU, torch's bernoulli_ path, a 1-byte bool on CUDA,
  native_dropout), lora_B saves A's output (r wide, fp32); the scaling multiply saves nothing;
- a frozen linear needs no saved input (its weight gets no gradient): the inputs of q/k/v_proj, gate/up_proj,
  down_proj, o_proj (eager; sdpa keeps its output anyway) and lm_head are no longer saved, nor the bf16
  normalised tensors the RMSNorm weights' gradients need (weight * normed); what the input gradients need
  (the fp32 norm input and rstd, K, Q, V, the softmax, the SwiGLU factors) stays;
- one difference is left, on the safe side: with the embedding frozen, the first layer's input needs no gradient,
  so its input_layernorm saves nothing (4 s b h + 4 s b bytes once, measured: tests/test_lora.py), unless gradient
  checkpointing's enable_input_require_grads (peft, transformers) makes the embedding output require grad.

QLoRA (bitsandbytes 0.50.2 Linear4bit, autograd/_functions.py MatMul4Bit): the forward runs the gemm_4bit op on
the packed weight; the backward dequantises the weight (dequantize_4bit, in the compute dtype) for the input
gradient, so the transient copy of the layer's largest linear weight is added to the layer's backward moments.
Derived from bitsandbytes' code, not measured (the NF4 storage itself is measured: memplan/memory/adapters.py).

torchtune's own LoRA (`--impl torchtune`, training.lora_impl "torchtune": torchtune 0.6.1 modules/peft/lora.py
LoRALinear, its lora_llama3_2 builders, set_trainable_params on the adapters), measured on CPU the same way
(validation/torchtune.py, tests/test_torchtune_lora.py): the adapters are in the model's dtype (bf16) and take the
linear's own input (`self.lora_a(self.dropout(x))`, no copy), so q/k/v_proj's shared input, w1/w3's and w2's stay
saved once each when one of their linears is a target (nothing is saved per target but B's input, s b r in bf16);
with dropout each target keeps its mask and dropout output instead. What the frozen model no longer saves is the
list above (torchtune's ids are transformers' ones). Its QLoRA (torchao's NF4Tensor, LinearNF4) dequantises the
weight with `weight.to(input.dtype)` in the forward and again in the backward: the backward's copy is the one
counted, as bitsandbytes' (derived from torchao's code). Its default targets are its recipes' (lora_attn_modules
q_proj, v_proj, output_proj and apply_lora_to_mlp: w1, w2, w3; memplan's names o_proj, gate_proj, down_proj,
up_proj)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.types import FC1_W, FC2_W, PROJ_W, QKV_W, Dtype, Inventory, Moment, Term, saved, transient

LORA_INFO = ("--lora R [--lora-targets, --lora-dropout, --qlora] (--impl hf-*, Llama layout): peft LoRA, the base "
             "frozen, fp32 adapters with their gradients and AdamW states; what peft's LoRA layers save and what the "
             "frozen layers no longer save measured per layer on CPU with peft 0.21.2 (validation/hf.py, "
             "tests/test_lora.py); --qlora's NF4 weights (bitsandbytes, double quantisation) measured with "
             "bitsandbytes 0.50.2 on CPU, its dequantised weights in the backward derived from its code, not measured")


PEFT = "peft 0.21.2 lora.Linear.forward, measured (validation/hf.py, tests/test_lora.py)"


# name: (input width, output width, parameter group), transformers' Llama-layout linears
LINEARS: dict[str, tuple[str, str, str]] = {
    "q_proj": ("h", "q", QKV_W), "k_proj": ("h", "q g /a", QKV_W), "v_proj": ("h", "q g /a", QKV_W),
    "o_proj": ("q", "h", PROJ_W), "gate_proj": ("h", "f", FC1_W), "up_proj": ("h", "f", FC1_W),
    "down_proj": ("f", "h", FC2_W),
}


# peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (utils/constants.py) for the Llama layout
# (llama, mistral, mixtral, qwen2, gemma, ...: all ["q_proj", "v_proj"])
DEFAULT_TARGETS = ("q_proj", "v_proj")
# torchtune's Llama 3.x LoRA / QLoRA recipe configs (recipes/configs/llama3_*/*lora*.yaml): lora_attn_modules
# [q_proj, v_proj, output_proj], apply_lora_to_mlp: True
# a chunked loss's output-projection weight gradients (memplan/inventory/hf.py, tune_loss.py)
HEAD_WEIGHT_GRADS = ("grad_head_weight_chunk", "grad_head_weight_sum", "grad_head_weight_new_sum")
TUNE_DEFAULT_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the saved input each linear shares with its neighbours (torchtune: the adapter takes the same tensor)
SHARED_INPUT = {"q_proj": "qkv_input", "k_proj": "qkv_input", "v_proj": "qkv_input", "o_proj": "attn_out",
                "gate_proj": "mlp_input", "up_proj": "mlp_input", "down_proj": "fc2_input"}


ALL_LINEAR = tuple(LINEARS)


# saved tensors only a frozen weight's gradient needed (transformers' Llama layout; memplan/inventory/hf.py ids)
# (the embedding's token ids too: a frozen embedding has no backward; with --liger the fused loss makes no gradient
# of a frozen head weight: fused_linear_cross_entropy_forward's weight_needs_grad, memplan/inventory/liger.py)
FROZEN_NOT_SAVED = ("qkv_input", "mlp_input", "fc2_input", "ln1_normed", "ln2_normed", "final_norm_normed",
                    "head_input", "token_ids", "liger_grad_head_weight")


def targets_of(names: Optional[tuple[str, ...]], lora_impl: str = "peft") -> tuple[str, ...]:
    """The target linears: peft's default for the family or torchtune's recipes' (None), `all-linear`, or named ones."""
    if not names:
        return TUNE_DEFAULT_TARGETS if lora_impl == "torchtune" else DEFAULT_TARGETS
    if tuple(names) == ("all-linear",):
        return ALL_LINEAR
    unknown = [n for n in names if n not in LINEARS]
    if unknown:
        raise MemplanError(f"unknown --lora-targets {', '.join(unknown)}; known: all-linear, {', '.join(LINEARS)}")
    return tuple(dict.fromkeys(names))


def check_lora(model: ModelSpec, impl: str, lora_impl: str = "peft") -> None:
    """LoRA is modelled for the hand-written transformers Llama inventory (peft) and torchtune's Llama (its own)."""
    if impl not in ("hf-eager", "hf-sdpa", "torchtune") or model.inventory is not None or model.is_moe or model.is_mla:
        raise MemplanError("--lora / --qlora are modelled for --impl hf-sdpa / hf-eager / torchtune with the Llama "
                           "layout (transformers' or torchtune's own code, not a traced inventory)")
    if (impl == "torchtune") != (lora_impl == "torchtune"):
        raise MemplanError(f"--impl {impl} runs {'torchtune' if impl == 'torchtune' else 'peft'}'s LoRA modules, not "
                           f"{lora_impl}'s")
    if not (model.norm == "rmsnorm" and model.mlp == "swiglu"):
        raise MemplanError("--lora / --qlora are modelled for the Llama layout (RMSNorm, SwiGLU)")


DORA = "peft 0.21.2 tuners/lora/dora.py DoraLinearLayer.forward, measured (validation/dora.py, tests/test_dora.py)"


def dora_terms(name: str, rank: int) -> list[Term]:
    """What peft's DoraLinearLayer saves for one target beyond LoRA (validation/dora.py): B A built as
    lora_B(lora_A(eye(in))) (lora_A saves the fp32 identity, lora_B its output), the weight norm (the magnitude's
    division), both scale vectors and the base and adapter outputs (the two muls). Measured: the first layer's
    frozen-input targets (q, k, v, gate, up) do not save m / |W| - 1; memplan counts it (out x 4 B each)."""
    n_in, n_out, _ = LINEARS[name]
    return [
        saved(f"dora_{name}_eye", f"{name} DoRA identity (lora_A's input)", "LoRA", f"{n_in} {n_in}", "fp32",
              k22=False, src=DORA),
        saved(f"dora_{name}_eye_a", f"{name} DoRA A eye (lora_B's input)", "LoRA", f"{n_in} {rank}", "fp32",
              k22=False, src=DORA),
        saved(f"dora_{name}_vectors", f"{name} DoRA weight norm, m / |W| and m / |W| - 1", "LoRA", f"3 {n_out}",
              "fp32", k22=False, storages=3, src=DORA),
        saved(f"dora_{name}_base_out", f"{name} DoRA: the frozen linear's output", "LoRA", f"s b {n_out}",
              k22=False, src=DORA),
        saved(f"dora_{name}_lora_out", f"{name} DoRA: the adapter's output (fp32)", "LoRA", f"s b {n_out}", "fp32",
              k22=False, src=DORA),
    ]


def lora_terms(terms: list[Term], rank: int, targets: tuple[str, ...], dropout: bool, device: str,
               sdpa: bool, lora_impl: str = "peft", dora: bool = False) -> list[Term]:
    """The inventory's terms with the frozen layers' weight-gradient inputs gone and each target's adapter tensors
    (and DoRA's)."""
    gone = FROZEN_NOT_SAVED + (() if sdpa else ("attn_out",))
    if lora_impl == "torchtune":
        return _tune_lora_terms(terms, rank, targets, dropout, device, gone)
    out = [t for t in terms if t.id not in gone]
    mask: Dtype = "mask" if device == "cuda" else "fp32"
    for name in targets:
        n_in = LINEARS[name][0]
        if dropout:
            out.append(saved(f"lora_{name}_mask", f"{name} LoRA dropout mask", "LoRA", f"s b {n_in}", mask,
                             k22=False, src=PEFT))
        what = "dropout output" if dropout else "input cast to fp32"
        out.append(saved(f"lora_{name}_input", f"{name} LoRA A input ({what})", "LoRA", f"s b {n_in}", "fp32",
                         k22=False, src=PEFT))
        out.append(saved(f"lora_{name}_a_out", f"{name} LoRA A output (B's input, fp32)", "LoRA", f"s b {rank}", "fp32",
                         k22=False, src=PEFT))
        out += dora_terms(name, rank) if dora else []
    return out


TUNE = "torchtune 0.6.1 LoRALinear.forward, measured (validation/torchtune.py, tests/test_torchtune_lora.py)"


def _tune_lora_terms(terms: list[Term], rank: int, targets: tuple[str, ...], dropout: bool, device: str,
                     gone: tuple[str, ...]) -> list[Term]:
    """torchtune's LoRALinear (module docstring): the targets' shared inputs stay (without dropout), B's input per
    target in the activation dtype; with dropout its mask (bf16 on CPU, bernoulli_; 1 byte on CUDA) and output."""
    keep = set() if dropout else {SHARED_INPUT[n] for n in targets}
    out = [t for t in terms if t.id not in gone or t.id in keep]
    mask: Dtype = "mask" if device == "cuda" else "act"
    for name in targets:
        n_in = LINEARS[name][0]
        if dropout:
            out.append(saved(f"lora_{name}_mask", f"{name} LoRA dropout mask", "LoRA", f"s b {n_in}", mask,
                             k22=False, src=TUNE))
            out.append(saved(f"lora_{name}_input", f"{name} LoRA A input (dropout output)", "LoRA", f"s b {n_in}",
                             k22=False, src=TUNE))
        out.append(saved(f"lora_{name}_a_out", f"{name} LoRA A output (B's input)", "LoRA", f"s b {rank}", k22=False,
                         src=TUNE))
    return out


QLORA = "derived from bitsandbytes 0.50.2 autograd/_functions.py MatMul4Bit.backward (dequantize_4bit), not measured"
# torchtune's QLoRA layer under --compile (its recipes' compile_model): AOTAutograd's partitioner saves every NF4
# linear's dequantised bf16 weight for the backward instead of dequantising it again (traced: validation/compiled.py
# trace_compiled_layer(..., lora=dict(qlora=True)), tests/test_compile.py)
COMPILED_QLORA = ("traced from torch.compile's partitioner (torch 2.13, torchtune 0.6.1 with torchao 0.18 NF4; "
                  "validation/compiled.py) and measured on CPU")
LAYER_WEIGHTS = "2 q h + 2 g q h /a + 3 h f"  # q, o; k, v; w1, w3, w2


def qlora_moments(moments: list[Moment]) -> list[Moment]:
    """Each layer backward moment with the dequantised weight its GEMM is using (the MLP's in the MLP's moments,
    the attention's in attention's)."""
    out = []
    for m in moments:
        if m.scope == "layer" and m.phase == "backward":
            w = "h f" if m.id in ("fc2_backward", "mlp_backward") else "q h"
            m = dataclasses.replace(m, transients=m.transients + (
                transient("qlora_dequantized_weight", "a 4-bit weight dequantised for the backward GEMM", w, src=QLORA),))
        out.append(m)
    return out


def apply(inv: Inventory, model: ModelSpec, impl: str, device: str, training) -> Inventory:
    """`inv` (transformers' or torchtune's Llama inventory) under peft's or torchtune's LoRA with `training`'s rank,
    targets and dropout."""
    check_lora(model, impl, training.lora_impl)
    targets = targets_of(training.lora_targets, training.lora_impl)
    terms = lora_terms(list(inv.terms), training.lora_rank, targets, training.lora_dropout > 0, device,
                       impl != "hf-eager", training.lora_impl, training.lora_dora)
    # the output projection is frozen: a chunked loss makes no weight gradient of it (measured with torchtune's)
    moments = [dataclasses.replace(m, transients=tuple(t for t in m.transients if t.id not in HEAD_WEIGHT_GRADS))
               for m in inv.moments]
    if training.qlora and training.compile:  # the dequantised weights are saved: no second dequantisation
        terms.append(saved("qlora_dequantized_weights", "every NF4 linear's dequantised weight (bf16, saved by the "
                           "compiled layer)", "LoRA", LAYER_WEIGHTS, k22=False, src=COMPILED_QLORA))
    elif training.qlora:
        moments = qlora_moments(moments)
    tag = f"lora-r{training.lora_rank}" + ("-qlora" if training.qlora else "") + ("-dora" if training.lora_dora else "")
    return dataclasses.replace(inv, name=f"{inv.name}/{tag}", terms=tuple(terms), moments=tuple(moments))
