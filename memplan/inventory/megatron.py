"""A Megatron-LM inventory (--impl megatron, megatron-local) from its dense layer's terms and moments: the
mixture-of-experts layers, the multi-token-prediction modules and the batch tensors get_batch holds."""

from __future__ import annotations

from memplan.core.model import ModelSpec
from memplan.inventory.k22 import labels_term
from memplan.inventory.mla import mtp_terms
from memplan.inventory.moe import moe_layer_terms, moe_moments
from memplan.inventory.types import Dtype, Inventory, Moment, Term, transient


def megatron_inventory(name: str, terms: list[Term], moments: list[Moment], model: ModelSpec, stats: Dtype,
                       moe_cpu: bool) -> Inventory:
    """A Megatron-LM inventory (--impl megatron, megatron-local) from its dense layer's terms and moments: an MoE
    model's expert layers (memplan/inventory/moe.py; `moe_cpu`: the unfused SwiGLU measured on CPU) and the
    multi-token-prediction modules on the last stage (memplan/inventory/mla.py) added, with the batch tensors
    Megatron-LM's get_batch holds."""
    if model.is_moe:
        terms = moe_layer_terms(terms, model, unfused=moe_cpu, measured=moe_cpu)
        moments = moe_moments(moments, model, terms)
    if model.mtp_layers:
        terms = terms + mtp_terms(terms, model, stats)
    # Megatron-LM: gradient-accumulation fusion writes weight gradients straight into the fp32
    # main-gradient buffer; Transformer Engine / apex FusedAdam (no temporaries).
    held = (labels_term(), transient("loss_mask", "loss mask (fp32) of the batch", "s b", "fp32", scope="last",
                               src="Megatron-LM pretrain_gpt.get_batch: tokens, labels, loss_mask, position_ids"))
    return Inventory(name, tuple(terms), tuple(moments), "buffer", False, "fused", "megatron", held,
                     tied_grad_waits=False)
