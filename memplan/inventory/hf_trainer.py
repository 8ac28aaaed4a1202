"""What the HF Trainer's data and checkpointing settings change in transformers' inventory (memplan/inventory/hf.py):
padded and packed batches (`--batch-layout padded|packed`, --impl hf-sdpa) and reentrant gradient checkpointing
(`--checkpoint-reentrant`).

With every row of the micro-batch s real tokens (`full`, the default) transformers 5.23 gives sdpa no mask
(masking_utils.sdpa_mask skips it: `is_causal=True`) and keeps K and V at g heads (`enable_gqa`). A batch that
needs a mask changes both, measured on CPU with the HF Trainer's own loop (validation/trainer_loop.py):

- `padded`: rows padded to s with an attention_mask that has zeros (DataCollatorWithPadding / ForSeq2Seq); any
  padding in the batch makes `create_causal_mask` build a bool [b, 1, s, s] causal-and-padding mask.
- `packed`: sequences packed into each row, told apart by position_ids (DataCollatorWithFlattening: one row of
  all the micro-batch's tokens, so --micro-batch 1 and --seq-len the packed row's length);
  `find_packed_sequence_indices` sees the restarts and the mask is block-diagonal, bool [b, 1, s, s].

Then, in every layer: torch's scaled_dot_product_attention turns the bool mask into an additive one in the
activation dtype (aten's convert_boolean_attn_mask: `where`, b s^2 elements), which the kernel saves for the backward
(CPU flash with a mask; on CUDA the memory-efficient kernel's attn_bias: derived, not measured); and
`use_gqa_in_sdpa` is False with a mask (CUDA and CPU), so repeat_kv expands K and V to all a heads before sdpa (saved
at full width, and dK / dV of the backward too). Under gradient checkpointing the bool mask is an input of every
checkpointed layer and lives through the backward (one storage, 1 byte an element). Eager attention builds its
[b, 1, s, s] mask anyway (memplan/inventory/hf.py checkpoint_mask): the layout changes nothing there.

Gradient checkpointing: transformers 5.23 (`activation_checkpointing_enable`, which the Trainer's
`gradient_checkpointing=True` calls) defaults to `use_reentrant=False`, what memplan/inventory/hf.py models: the
recompute stops once the last saved tensor is remade. With `gradient_checkpointing_kwargs={"use_reentrant": True}`
torch's CheckpointFunction.backward re-runs the whole layer and holds its output (s b h) while it back-propagates
through it: measured +s b h at every checkpointed layer's backward peak (validation/trainer_loop.py --reentrant).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly
from memplan.core.training import Recompute
from memplan.inventory.types import Inventory, saved, transient

LAYOUTS = ("full", "padded", "packed")
SRC = "measured: transformers 5.23.0 Trainer, padded / packed batches (validation/trainer_loop.py)"
REENTRANT = "measured: transformers 5.23.0 Trainer, use_reentrant=True (validation/trainer_loop.py --reentrant)"


def check_reentrant(impl: str, training: Any) -> None:
    """Reentrant checkpointing is transformers' gradient checkpointing of whole layers."""
    if training.checkpoint_reentrant and (impl not in ("hf-sdpa", "hf-eager") or training.recompute != Recompute.FULL):
        raise MemplanError("--checkpoint-reentrant is transformers' gradient checkpointing: --impl hf-sdpa / "
                           "hf-eager with --recompute full")


def reentrant(inventory: Inventory) -> Inventory:
    """`inventory` with the recomputed layer's output alive through every backward moment of the layer."""
    out = transient("reentrant_layer_output", "the recomputed layer's output, held by reentrant checkpointing",
                    "s b h", src=REENTRANT)
    moments = tuple(dataclasses.replace(m, transients=m.transients + (out,))
                    if m.scope == "layer" and m.phase == "backward" else m for m in inventory.moments)
    return dataclasses.replace(inventory, moments=moments)


def check_layout(model: ModelSpec, impl: str, layout: str) -> None:
    """A padded or packed batch is modelled for transformers' own Llama code."""
    if layout == "full":
        return
    if impl not in ("hf-sdpa", "hf-eager") or model.inventory is not None or model.is_moe or model.is_mla \
            or not (model.norm == "rmsnorm" and model.mlp == "swiglu"):
        raise MemplanError(f"--batch-layout {layout} is modelled for --impl hf-sdpa / hf-eager with the Llama "
                           "layout (transformers' own code, not a traced inventory)")


def apply(inventory: Inventory, model: ModelSpec, impl: str, layout: str) -> Inventory:
    """`inventory` (memplan/inventory/hf.py, hf-sdpa) with the attention mask of a padded or packed batch."""
    if layout == "full" or impl != "hf-sdpa":
        return inventory
    expanded = "K after rotary, repeated to a heads (no enable_gqa with a mask; saved by sdpa)", \
        "V repeated to a heads (no enable_gqa with a mask; saved by sdpa)"
    terms = []
    for t in inventory.terms:
        if t.id in ("k", "v"):
            t = dataclasses.replace(t, name=expanded[t.id == "v"], elements=Poly.parse_sum("s b q"), source=SRC)
        terms.append(t)
    terms += [
        saved("sdpa_attention_mask", f"additive attention mask of a {layout} batch (where of the bool mask; saved by "
              "sdpa)", "attention", "b s^2", k22=False, src=SRC),
        saved("checkpoint_bool_mask", f"bool attention mask of a {layout} batch, an input of every checkpointed "
              "layer", "attention", "b s^2", "mask", scope="chunk", k22=False, only_full=True, src=SRC),
    ]
    moments = []
    for m in inventory.moments:
        tr = tuple(dataclasses.replace(x, elements=Poly.parse_sum("3 s b q"), source=SRC) if x.id == "grad_qkv"
                   else x for x in m.transients)
        moments.append(dataclasses.replace(m, transients=tr))
    return dataclasses.replace(inventory, terms=tuple(terms), moments=tuple(moments))
