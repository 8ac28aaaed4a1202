"""FP8 training with NVIDIA Transformer Engine (TE) as Megatron-LM launches it (`--fp8 RECIPE`): what changes
in the inventory, the states and the step time. DERIVED FROM CODE, NOT MEASURED (no GPU with TE here).

Read from TransformerEngine main at d0067d0 (2026-08-22, 2.20.0.dev0) and Megatron-LM main at d98e8a6
(2026-08-22). Megatron-LM's transformer-engine layer spec (megatron/core/models/gpt/gpt_layer_specs.py) runs
a layer's four weight GEMMs as TE modules: linear_qkv and linear_fc1 as TELayerNormColumnParallelLinear
(te.pytorch.LayerNormLinear), linear_proj and linear_fc2 as TERowParallelLinear (te.pytorch.Linear); the
attention core (TEDotProductAttention) stays in bf16 unless --fp8-dot-product-attention, and the embedding and
the output layer (a Megatron ColumnParallelLinear, not a TE module) stay in bf16 too.

Saved tensors (the inventory): TE quantizes each of the four GEMMs' inputs and saves the FP8 copy, 1 byte per
element, instead of the bf16 input (transformer_engine/pytorch/module/linear.py `_linear_forward_impl`: "Discard
row-wise data since it is not needed in backward pass", `inputmat.update_usage(rowwise_usage=False,
columnwise_usage=True)`, kept as `saved_inputmat`; module/layernorm_linear.py: `ln_out.update_usage(rowwise_usage=
False)` and `ctx.save_for_backward(inputmat, ..., ln_out_to_save, mu, rsigma)`: the norm's bf16 input and fp32
statistics stay). One usage is kept either way (the column-wise one for the weight-gradient GEMM, the row-wise
one when sequence parallelism must all-gather it again), so the sequence-parallel split of each term is
unchanged. So the terms qkv_input, fc1_input and fc2_input become FP8; proj_input (the attention output) does
when the attention is unfused (eager: only the projection saves it); a flash / fused kernel saves its bf16
output itself, so the FP8 copy is one more term. Per FP8 tensor the recipe adds its scales:
- delayed (te DelayedScaling) and tensorwise (Float8CurrentScaling): one fp32 scale_inv per tensor (a 4-byte
  allocation, 512 bytes on CUDA);
- blockwise (Float8BlockScaling, DeepSeek-V3 style): fp32 scales of 1 x 128 blocks, elements / 128
  (tensor/float8_blockwise_tensor.py `get_scale_shape`: (ceil(M/128), K) for M x K data);
- mxfp8 (MXFP8BlockScaling) runs on Blackwell only (compute capability 10.0); memplan has no Blackwell preset,
  so it is refused.

Transients: TE quantizes each GEMM's output gradient to FP8 in both usages (row-wise for the input-gradient GEMM,
column-wise for the weight-gradient one: linear.py, `grad_output_quantizer.set_usage(rowwise=True,
columnwise=True)` in `_linear_backward`), alive for that linear's backward. Of the four, only fc2's is alive at a moment where the layer
peaks (memplan/inventory/k22.py layer_backward_moments "mlp_backward": fc2's input gradient is being made): it is added
there, 2 x sbh bytes (gathered to the whole sequence under SP). The others are dominated: at fc1's backward the
activation's saved input and the second linear's input gradient are freed (-sbf x 2 bytes or more) while the
FP8 copies add as much as the activation's gradient in bf16, less than the "mlp_activation_backward" moment;
at QKV's the attention core's saved tensors and gradients are freed, more than its FP8 copies (2 s b (q + 2qg/a))
add; at the projection's the FP8 copies (2sbh) against the attention moment's dQ, dK, dV (2 s b (q + 2qg/a),
plus flash attention's fp32 accumulator on CUDA) leave the attention moment higher for every preset with
g/a >= 1/4; for fewer KV heads the projection's moment may pass it by up to 0.5 sbh (not modelled).

States: each TE linear caches its FP8 weight for the step's later micro-batches (Megatron-LM passes
`is_first_microbatch`: megatron/core/extensions/transformer_engine.py TELinear.forward; TE keeps
`self._fp8_workspaces["weight"]`, linear.py), in both usages (`weight_quantizer.set_usage(rowwise=True,
columnwise=...)`: the transpose for the input-gradient GEMM on Hopper): 2 bytes per linear weight, on top of
the bf16 weight. With --fp8-param-gather the weights themselves are FP8 (TE fp8_model_init; Megatron-LM
arguments.py: only with the distributed optimizer, torch FSDP2 or Megatron-FSDP), with their transpose: 2 bytes
per linear weight instead of 2 + 2; the fp32 master weights stay. Delayed scaling keeps, per TE module and
GEMM, a forward scale (3 fp32: input, weight, output) and amax history (history length x 3) and a backward scale
(2: output and input gradients) and history (length x 2) (quantization.py DelayedScalingRecipeState,
module/base.py `num_fp8_tensors`): 4 allocations per module. Megatron-LM's --fp8-amax-history-len defaults to 1
(TE's own DelayedScaling to 1024). Tensorwise and blockwise scaling keep no state between steps.
Blockwise weights' 128 x 128 block scales (4 bytes per 16,384 weights, < 0.03 %) are left out.

Step time: the four weight GEMMs of a layer (forward, input and weight gradients) run on FP8 tensor cores at
the GPU preset's `peak_fp8_flops` x matmul_efficiency (the bf16 fraction, assumed: FP8 GEMMs were not
measured), plus the casts: every GEMM input quantized in the forward (read A, write 1 + 1 bytes per element,
both usages), every output gradient in the backward (the same); the attention core and the LM head stay bf16.
MFU is then taken against the FP8 peak (against the bf16 one it could pass 100 %).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, Optional

from memplan.core.errors import MemplanError
from memplan.core.symbolic import Poly
from memplan.inventory.types import FC1_W, FC2_W, FP8_BYTES, PROJ_W, QKV_W, Moment, Term, transient

RECIPES = ("delayed", "tensorwise", "blockwise")
INFO = ("--fp8 delayed|tensorwise|blockwise (--impl megatron): Transformer Engine's FP8 linear layers as Megatron-LM "
        "runs them: saved GEMM inputs in FP8 (1 byte), cached FP8 weights (2 bytes per linear weight; with "
        "--fp8-param-gather FP8 weights instead of bf16), delayed scaling's amax history, FP8 GEMMs at the GPU's FP8 "
        "peak. DERIVED from TE's code (transformer_engine/pytorch/module/linear.py _linear_forward_impl, "
        "module/layernorm_linear.py, quantization.py DelayedScalingRecipeState), NOT MEASURED: no GPU with TE here "
        "(memplan/inventory/fp8.py)")
MAX_ZERO = 1  # the distributed optimizer; Megatron-FSDP (ZeRO 2 / 3) keeps other FP8 caches (check_fp8)
REFUSED = {"mxfp8": "--fp8 mxfp8 (MXFP8BlockScaling) runs on Blackwell GPUs only (compute capability 10.0) and "
                    "memplan has no Blackwell preset: use delayed, tensorwise or blockwise (Hopper)",
           "custom": "--fp8 custom (a user's quantizer factory) has no defined memory: use delayed, tensorwise or "
                     "blockwise"}
TE = "Transformer Engine d0067d0"
SRC = f"derived: {TE} module/linear.py, module/layernorm_linear.py (the FP8 input saved for backward), not measured"
BLOCK = 128  # Float8BlockScaling: 1 x 128 blocks for activations and gradients, 128 x 128 for weights
CAST_WRITE_BYTES = 2 * FP8_BYTES  # a cast writes both usages (row-wise and column-wise), 1 byte each
WORKSPACE_BYTES = 2 * FP8_BYTES  # a cached FP8 weight: row-wise and column-wise (transposed) data
DELAYED_TENSORS = (3, 2)  # FP8 tensors per GEMM with delayed-scaling state: forward (input, weight, output), backward
LINEAR_GROUPS = (QKV_W, PROJ_W, FC1_W, FC2_W)  # memplan/memory/states.py groups run by TE modules
TE_MODULES = 4  # linear_qkv, linear_proj, linear_fc1, linear_fc2 (one GEMM each)
# The saved inputs of the four GEMMs (megatron_layer ids): TE keeps their FP8 copy instead.
FP8_INPUTS = ("qkv_input", "proj_input", "fc1_input", "fc2_input")


def check_fp8(recipe: Optional[str], impl: str, zero: int = 0, gpu: Any = None) -> None:
    """Refuse what memplan does not model: FP8 outside Megatron-LM, mxfp8 / custom, Megatron-FSDP (ZeRO 2 / 3),
    a GPU without FP8."""
    if recipe is None:
        return
    if recipe in REFUSED:
        raise MemplanError(REFUSED[recipe])
    if recipe not in RECIPES:
        raise MemplanError(f"unknown FP8 recipe '{recipe}'; known: {', '.join(RECIPES)}")
    if impl != "megatron":
        raise MemplanError(f"--fp8 is modelled for --impl megatron (Transformer Engine as Megatron-LM runs it), not "
                           f"--impl {impl}: transformers and the reference torch layer have no FP8 path")
    if zero >= 2:
        raise MemplanError("--fp8 with ZeRO-2/3 (Megatron-FSDP) is not modelled: Megatron-FSDP drops TE's FP8 "
                           "transpose caches unless --keep-fp8-transpose-cache; use --zero 0 or 1")
    if gpu is not None and gpu.peak_fp8_flops is None:
        raise MemplanError(f"--fp8: {gpu.name} has no FP8 tensor cores (its preset gives no peak_fp8_flops); "
                           "Transformer Engine's FP8 needs compute capability 8.9 or newer (H100, H200)")


def fp8_terms(terms: list[Term], recipe: str, attention: str) -> list[Term]:
    """A Megatron-LM layer inventory (terms.megatron_layer and the rest) with TE's FP8 saved inputs: the
    four GEMM inputs in FP8 (a flash kernel's own bf16 output stays, its FP8 copy added), plus the
    recipe's scales."""
    out: list[Term] = []
    for t in terms:
        if t.id not in FP8_INPUTS:
            out.append(t)
            continue
        name = f"{t.name}, FP8 copy saved by the TE linear"
        fp8 = dataclasses.replace(t, dtype="fp8", name=name, source=SRC, in_k22=False)
        if t.id == "proj_input" and attention != "eager":  # the attention kernel saves its bf16 output itself
            out.append(t)
            fp8 = dataclasses.replace(fp8, id="proj_input_fp8", name=f"FP8 copy of the {t.name} (TE linear_proj)")
        out += [fp8, _scales(fp8, recipe)]
    return out


def _scales(t: Term, recipe: str) -> Term:
    """The scales saved with FP8 term `t`: 1 x 128 block scales (blockwise), else one scale_inv per tensor."""
    if recipe == "blockwise":
        return dataclasses.replace(
            t, id=f"{t.id}_scales", name=f"fp32 1x{BLOCK} block scales of the {t.id} FP8 copy", dtype="fp32",
            elements=t.elements * Fraction(1, BLOCK), storages=1,
            source=f"derived: {TE} tensor/float8_blockwise_tensor.py get_scale_shape, not measured")
    return dataclasses.replace(
        t, id=f"{t.id}_scale_inv", name=f"fp32 scale_inv of the {t.id} FP8 copy (one per tensor)",
        dtype="fp32", elements=Poly.parse("1"), tp_split=False, sp_split=False, storages=1,
        source=f"derived: {TE} tensor/float8_tensor.py Float8Tensor._scale_inv, not measured")


def derived_ids(term_id: str) -> tuple[str, ...]:
    """The scale terms that live and die with an FP8 term."""
    return (f"{term_id}_scales", f"{term_id}_scale_inv")


def fp8_moments(moments: list[Moment], attention: str) -> list[Moment]:
    """The layer's backward moments with FP8: fc2's FP8 output gradient (both usages) alive at the MLP
    backward moment; the FP8 copies (and scales) freed wherever their inputs are."""
    grad = transient("fp8_grad_fc2_output", "FP8 copies of the second linear's output gradient (row- and column-wise)",
              "s b h", "fp8", src=f"derived: {TE} module/linear.py _linear_backward (grad_output quantized), not measured")
    grad = dataclasses.replace(grad, storages=2)
    out = []
    for m in moments:
        freed = list(m.freed)
        if m.id == "attention_backward" and attention != "eager":
            freed.append("proj_input_fp8")  # the projection's backward is done
        freed += [d for f in list(freed) for d in derived_ids(f)]
        transients = m.transients + ((grad,) if m.id == "mlp_backward" else ())
        out.append(dataclasses.replace(m, freed=tuple(freed), transients=transients))
    return out


def weight_extra_bytes(groups: dict[str, Any], layers: Any, training: Any, granularity: int = 1) -> Any:
    """Bytes TE adds to one GPU's weights for `layers` layers: the cached FP8 weights (2 bytes per linear
    weight), or with fp8_param_gather the FP8 weights and their transpose (2 bytes) in place of the
    `training.weight_bytes` ones; delayed scaling's scales and amax histories (4 fp32 allocations per TE
    module, each rounded up to `granularity`). `groups`: parameters per GPU of each parameter group."""
    linear = sum((groups[name] for name in LINEAR_GROUPS if name in groups), 0)
    per_weight = WORKSPACE_BYTES - (training.weight_bytes if training.fp8_param_gather else 0)
    return layers * (linear * per_weight + scaling_state_bytes(training, granularity))


def scaling_state_bytes(training: Any, granularity: int = 1) -> int:
    """Delayed scaling's state of one layer (TE_MODULES modules of one GEMM each): per module a forward scale
    of 3 fp32 and history of len x 3, a backward scale of 2 and history of len x 2; none for the other
    recipes."""
    if training.fp8 != "delayed":
        return 0
    n = training.fp8_amax_history_len
    fwd, bwd = DELAYED_TENSORS
    sizes = [fwd * 4, n * fwd * 4, bwd * 4, n * bwd * 4]
    return TE_MODULES * sum(-(-x // granularity) * granularity for x in sizes)


def notes(training: Any) -> list[str]:
    """What an estimate says about its FP8 figures."""
    if training.fp8 is None:
        return []
    weights = ("weights kept in FP8 with their transpose (--fp8-param-gather)" if training.fp8_param_gather
               else "a cached FP8 copy of every linear weight (row- and column-wise, 2 bytes each) beside the bf16 one")
    scale = (f"amax history {training.fp8_amax_history_len}" if training.fp8 == "delayed" else "no scaling state")
    return [f"FP8 ({training.fp8}, {training.fp8_format}): the linear layers' saved inputs in FP8 (1 byte), {weights}, "
            f"{scale}; GEMMs at the GPU's FP8 peak (and MFU against it). DERIVED from Transformer Engine's code (module/linear.py, "
            "module/layernorm_linear.py, quantization.py), not measured (memplan/inventory/fp8.py)"]


def launch_args(training: Any, zero: int, notes_out: list[str]) -> list[str]:
    """Megatron-LM's FP8 flags (TransformerConfig fields made flags by ArgumentGroupFactory, megatron/training/
    arguments.py; --fp8-format is the `fp8` field's arg_names, transformer_config.py)."""
    if training.fp8 is None:
        return []
    args = [f"--fp8-format {training.fp8_format}", f"--fp8-recipe {training.fp8}"]
    if training.fp8 == "delayed":
        args.append(f"--fp8-amax-history-len {training.fp8_amax_history_len}")
    if training.fp8_param_gather:
        if zero >= 1:
            args.append("--fp8-param-gather")
        else:
            notes_out.append("--fp8-param-gather needs the distributed optimizer in Megatron-LM (arguments.py); the "
                             "plan has ZeRO 0: no --fp8-param-gather is given (plan with --zero 1)")
    notes_out.append("the FP8 memory and time of this plan are derived from Transformer Engine's code, not measured")
    return args


def cast_traffic(model: Any, activation_bytes: int, by: Any) -> Any:
    """timing.traffic.LayerBytes of one layer and sequence plus TE's casts: each GEMM input quantized in the forward
    and each GEMM output gradient in the backward, reading A and writing both usages (CAST_WRITE_BYTES) per
    element. QKV's and fc1's inputs (the norms' outputs, cast in the fused norm kernel) and the gradients of
    the projection's and fc2's outputs are sequence-wide under TP (split only by SP: "replicated"); the
    projection's and fc2's inputs and the gradients of QKV's and fc1's outputs are split by t."""
    per = activation_bytes + CAST_WRITE_BYTES
    s, h, q, f = (float(x) for x in (model.seq_length, model.hidden_size, model.q, model.f))
    qkv_out = q * (1 + 2 * model.g / model.num_attention_heads)
    fc1_out = (2 if model.mlp == "swiglu" else 1) * f
    return dataclasses.replace(
        by,
        replicated_fwd=by.replicated_fwd + per * s * 2 * h,  # QKV and fc1 inputs
        tp_fwd=by.tp_fwd + per * s * (q + f),  # projection and fc2 inputs
        replicated_bwd=by.replicated_bwd + per * s * 2 * h,  # projection and fc2 output gradients
        tp_bwd=by.tp_bwd + per * s * (qkv_out + fc1_out),  # QKV and fc1 output gradients
    )
