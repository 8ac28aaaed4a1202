"""torchtitan's float8 linears (``--float8 tensorwise|rowwise`` with ``--impl torchtitan``): which of the Llama 3
linears torchao's Float8Linear runs, what that changes in the tensors a layer keeps for the backward, and what
FSDP2's float8 all-gather changes in the unsharded parameters.

Which linears (torchtitan 0.3.0): ``Float8LinearConverter.convert`` (components/quantization/float8.py:151-170)
swaps every ``Linear.Config`` that ``module_filter_fn`` (components/quantization/utils.py:16-30) lets through: both
dims divisible by 16 and the fqn matching none of ``filter_fqns``.  The shipped float8 config filters the output
layer (models/llama3/config_registry.py:304, ``filter_fqns=["lm_head"]``), which memplan plans too: a decoder
layer's wqkv, wo, w1, w2 and w3 run in float8, the LM head in bf16.

Recipes (torchao 0.18 float8/config.py:331-351): ``tensorwise`` is ``Float8LinearConfig()`` (one dynamic scale per
tensor), ``rowwise`` casts the input, weight and output gradient with per-row (axiswise) e4m3 scales, powers of 2.
torchtitan 0.3.0's converter names ``rowwise`` and ``rowwise_with_gw_hp`` only (float8.py:58) and has no float8
all-gather: ``--float8 tensorwise`` is the recipe as torchtitan <= 0.2 ran it (``recipe_name = "tensorwise"``,
``enable_fsdp_float8_all_gather`` and ``precompute_float8_dynamic_scale_for_fsdp`` on, the 2024-12 benchmark
runs), which ``--emit torchtitan`` cannot write for 0.3.0.

What a layer keeps: torchao's eager autograd function saves the bf16 input and the weight, not their float8 copies
(float8/float8_linear.py:40, ``ctx.save_for_backward(input_hp, weight_hp_t)``): both are cast again in the backward
(float8_linear.py:95-176), so under ``--ac none`` and ``full`` a layer keeps exactly what its bf16 version keeps.
Under ``selective-op`` torchtitan's save list holds ``aten.max.default`` "for low precision training"
(distributed/activation_checkpoint.py:47): the tensorwise casts' amax, ``torch.max(torch.abs(x))``
(float8/float8_utils.py:65), one bf16 scalar per cast, is kept: the input's and the weight's of each float8 linear
(2 per linear, 10 per layer); rowwise's per-row amax is ``torch.amax`` (float8_utils.py:69), not in the list, and
is recomputed (with ``--compile`` the partitioner decides instead: memplan/inventory/compiled.py).  All of this is
measured on CPU against torchtitan's block converted by its own ``convert``
(validation/titan.py ``build_block(float8=...)``, tests/test_titan_float8.py): the kept bytes equal the bf16
block's, plus the 10 scalars under selective-op with tensorwise.  The float8 GEMMs (``torch._scaled_mm``) run on
CPU with torch 2.13.

The casts' transients (derived, not in the peak: the layer backward moments are the bf16 block's):
per cast ``torch.abs`` (2 B per element), the fp32 scaled copy and its clamp (float8_training_tensor.py
``_ToFloat8ConstrFunc``), the 1-byte float8 result; the input and weight in the forward, the weight again and the
output gradient twice in the backward.

With TP (``--tp T``): torchtitan 0.3.0 runs the converter before its sharding configs, so its DTensor TP shards the
Float8Linear modules as it shards the bf16 ones (no Float8ColwiseParallel there); measured over gloo on 2 ranks
(validation/titan.py ``measure_tp(float8=...)``, tests/test_titan_float8.py): each rank keeps what the bf16 TP rank
keeps (tests/test_titan_tp.py's split), plus under selective-op with tensorwise the same 10 amax scalars, the states
unchanged.  Tensorwise's FSDP2 float8 all-gather with TP is derived (the rank's TP shard gathered at 1 byte per
element), not measured.  Compiled with TP the partitioner saves float8 casts of the weights and the norm outputs
(measured, validation/titan_tp_compile.py): not modelled, refused outside --ac full (memplan/api/options.py).

FSDP2's float8 all-gather (tensorwise only; torchao float8/fsdp_utils.py:228-253
``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` casts the local shard to float8 and all-gathers it,
``fsdp_post_all_gather`` wraps the gathered bytes as the unsharded float8 weight, which the forward uses as
already cast, float8_linear.py:63): a layer's unsharded float8 weights take 1 byte per element instead of bf16's 2,
its norms stay bf16; the LM head (not converted) stays bf16.  Measured over gloo on 2 ranks with torchao's own
conversion (``convert_to_float8_training`` with ``enable_fsdp_float8_all_gather``, as torchtitan <= 0.2 called it;
validation/titan.py ``fsdp_rank(float8="tensorwise")``, opt-in ``MEMPLAN_TITAN_SLOW=1 pytest tests/test_titan.py -k
float8_all_gather``): a tiny layer's unsharded bytes 43,264 against bf16's 86,272, the fp32 states unchanged.  The
per-weight fp32 scales (4 bytes each, metadata of the all-gather) are left out.  ``force_recompute_fp8_weight_in_bwd`` (deprecated in
torchao 0.18, config.py:311) changes nothing here in eager: the weight a linear saves is FSDP2's unsharded
parameter, freed by ``reshard_after_forward`` and gathered again for the backward either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.types import Inventory, saved

RECIPES = ("tensorwise", "rowwise")
FILTER_FQNS = ("lm_head",)  # torchtitan's shipped float8 config (models/llama3/config_registry.py:304)
AMAX_CASTS = 2  # tensorwise casts per float8 linear in the forward whose amax selective-op saves: input, weight
SRC = ("measured: torchtitan 0.3.0 Llama 3 block with torchao 0.18's Float8Linear on CPU (validation/titan.py, "
       "tests/test_titan_float8.py); torchao float8_linear.py:40 saves the bf16 input")


def check_float8(recipe: Optional[str], impl: str) -> None:
    """Refuse what memplan does not model: float8 outside torchtitan; a recipe torchao's from_recipe_name does not
    name here (with --compile: memplan/inventory/compiled.py; with --compile and --tp: memplan/api/options.py)."""
    if recipe is None:
        return
    if recipe == "any":
        raise MemplanError("--float8 any is search's (bf16 and each recipe searched): estimate one recipe, "
                           + " or ".join(RECIPES))
    if recipe not in RECIPES:
        raise MemplanError(f"--float8 takes {' or '.join(RECIPES)}, not {str(recipe)[:40]!r}")
    if impl != "torchtitan":
        raise MemplanError("--float8 is torchtitan's torchao float8 (--impl torchtitan); Megatron-LM's Transformer "
                           "Engine FP8 is --fp8 RECIPE")


def converted_linears(model: ModelSpec) -> list[tuple[str, int, int]]:
    """A decoder layer's linears torchtitan's converter makes Float8Linear: (name, in, out) of those whose dims
    both divide by 16 (module_filter_fn); the LM head is filtered (FILTER_FQNS)."""
    h, q, f = model.hidden_size, model.q, model.f
    kv = 2 * model.g * (q // model.num_attention_heads)
    linears = [("wqkv", h, q + kv), ("wo", q, h), ("w1", h, f), ("w2", f, h), ("w3", h, f)]
    return [x for x in linears if x[1] % 16 == 0 and x[2] % 16 == 0]


def apply(inventory: Inventory, model: ModelSpec, recipe: str) -> Inventory:
    """torchtitan's inventory with float8 linears: the same kept tensors (measured), plus under selective-op with
    tensorwise the saved amax scalars (AMAX_CASTS bf16 scalars per float8 linear, one storage each)."""
    terms = inventory.terms
    n = AMAX_CASTS * len(converted_linears(model))
    if recipe == "tensorwise" and n:
        amax = saved("float8.amax", f"tensorwise casts' amax (bf16 scalars, {n} per layer: input and weight of "
                     "each float8 linear), saved by torchtitan's selective-op save list (aten.max)", "float8",
                     str(n), "act", k22=False, src=SRC, only_selective=True, storages=n)
        terms = terms + (amax,)
    return dataclasses.replace(inventory, name=f"{inventory.name}/float8-{recipe}", terms=terms)


def gathered_layer(model: ModelSpec, layer: Any, t: Any = 1) -> Any:
    """One decoder layer's unsharded parameters under tensorwise's float8 all-gather, in bf16 elements (the unit
    memplan/memory/dp_stack.py counts gathered parameters in): its float8 weights at 1 byte, half a bf16 element
    each; ``layer`` the layer's parameters on a rank of TP ``t`` (every linear TP-split: its shard / t; derived)."""
    return layer - sum(i * o for _, i, o in converted_linears(model)) // (2 * t)


def gathered_bytes_saved(model: ModelSpec, recipe: Optional[str], weight_bytes: int) -> int:
    """Bytes per layer (before the TP split) FSDP2's all-gather moves less with ``recipe``: tensorwise's float8
    all-gather sends the converted linears' weights at 1 byte per element instead of ``weight_bytes`` (the memory
    side: `gathered_layer`); rowwise and bf16 gather bf16."""
    if recipe != "tensorwise":
        return 0
    return sum(i * o for _, i, o in converted_linears(model)) * (weight_bytes - 1)


# Bytes one torchao cast moves per element of its bf16 tensor (torchao 0.18 float8_scaling_utils.py
# hp_tensor_to_float8_dynamic: float8_utils.tensor_to_amax's abs and max, then float8_training_tensor.py's fp32 upcast,
# scale multiply, to_fp8_saturated's clamp and the fp8 cast). Eager, one pass per op: abs 2 + 2, max 2, to(float32)
# 2 + 4, x scale 4 + 4, clamp 4 + 4, to(float8) 4 + 1 = 33 B; compiled (inductor fuses the abs into the max's reduction
# and the cast's pointwise chain into one kernel): the amax's read 2, the cast's read 2 and 1-byte write = 5 B. Derived.
CAST_BYTES = {False: 33, True: 5}


def cast_traffic(model: ModelSpec, compiled: bool, by: Any) -> Any:
    """timing.traffic.LayerBytes of one layer and sequence plus torchao's float8 casts (torchao float8_linear.py
    matmul_with_hp_or_float8_args): in the forward each converted linear casts its input; in the backward its output
    gradient twice (dim 0 for the input gradient's GEMM, dim 1 for the weight gradient's) and its bf16 input again
    (dim 1; the forward saved it in bf16), CAST_BYTES per element each. The column-parallel linears' inputs (wqkv, w1,
    w3: the norms' outputs) and the row-parallel ones' output gradients (wo, w2) are split by t only under SP
    ("replicated": torchao's Float8ColwiseParallel casts the sequence shard before its all-gather); the others by t.
    Derived from torchao's code, not measured (no GPU here)."""
    per = CAST_BYTES[bool(compiled)]
    s = float(model.seq_length)
    col_in = row_in = col_out_grad = row_out_grad = 0.0
    for name, i, o in converted_linears(model):
        if name in ("wo", "w2"):
            row_in, row_out_grad = row_in + i, row_out_grad + o
        else:
            col_in, col_out_grad = col_in + i, col_out_grad + o
    return dataclasses.replace(
        by,
        replicated_fwd=by.replicated_fwd + per * s * col_in,
        tp_fwd=by.tp_fwd + per * s * row_in,
        replicated_bwd=by.replicated_bwd + per * s * (2 * row_out_grad + col_in),
        tp_bwd=by.tp_bwd + per * s * (2 * col_out_grad + row_in),
    )


def weight_cast_bytes(model: ModelSpec, recipe: str, compiled: bool) -> tuple[float, float]:
    """Bytes a layer's weight casts move per micro-batch (all of its converted linears' weights, before the TP split),
    in the forward and in the backward: rowwise casts each bf16 weight in the forward and again (dim 0) in the
    backward; tensorwise, with FSDP2's float8 all-gather, receives the weights already in float8 (each rank casts its
    1 / d shard before the all-gather: left out)."""
    if recipe == "tensorwise":
        return 0.0, 0.0
    n = CAST_BYTES[bool(compiled)] * float(sum(i * o for _, i, o in converted_linears(model)))
    return n, n


def notes(recipe: Optional[str], compiled: bool = False, tp: int = 1) -> list[str]:
    """What an estimate says about its float8 figures (``compiled``: with --compile; ``tp``: the TP degree)."""
    if recipe is None:
        return []
    with_tp = [] if tp == 1 else [
        f"--float8 with --tp {tp}: each rank's kept tensors measured over gloo (2 ranks, torchtitan 0.3.0's DTensor TP "
        "of its Float8Linear modules: what the bf16 rank keeps, plus tensorwise's amax under selective-op)"
        + ("; compiled under --ac full: each block keeps its input only (DERIVED: torch 2.13 does not run compile "
           "with full AC and TP on CPU)" if compiled else "")
        + ("; tensorwise's float8 all-gather of the TP shard derived, not measured" if recipe == "tensorwise" else "")]
    kept = ("a layer keeps what its bf16 version keeps (torchao saves the bf16 input and recasts in the backward), plus "
            "under selective-op with tensorwise the casts' amax scalars (measured on CPU)" if not compiled else
            "compiled, a layer keeps what the partitioner saves with float8 linears: the bf16 compiled layer's tensors "
            "without the norms' outputs and SwiGLU's product (traced and measured on CPU, memplan/inventory/compiled.py)")
    gather = ("; FSDP2 all-gathers the float8 weights (tensorwise, enable_fsdp_float8_all_gather as torchtitan <= 0.2 "
              "ran it): the layers in flight at 1 byte per linear weight (measured over gloo on CPU)"
              if recipe == "tensorwise" else "; FSDP2 all-gathers bf16 (torchtitan 0.3.0 has no float8 all-gather)")
    return [f"float8 ({recipe}, torchao Float8Linear on wqkv, wo, w1, w2, w3; the LM head bf16): {kept}{gather}; the "
            "casts' transients are not in the peak (derived, memplan/inventory/titan_float8.py); step time: the float8 "
            "linears' GEMMs at the GPU's FP8 peak (at the bf16 GEMMs' efficiency) and torchao's casts as memory traffic ("
            f"{CAST_BYTES[bool(compiled)]} B per element cast: each linear's input, its output gradient twice and its "
            "input again in the backward, " + ("the weights in each forward and backward" if recipe == "rowwise" else
                                               "the weights arriving in float8 from FSDP2's all-gather")
            + "), derived, uncalibrated"] + with_tp
