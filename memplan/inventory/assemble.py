"""The inventory of a model as an implementation runs it: picks the implementation's own inventory (K22 /
Megatron-LM, megatron-core local, transformers hand-written or traced, the reference torch layer) and applies
what the training settings change in it (loss chunks, FP8, MsT, Liger, LoRA). The top of the inventory layer: nothing in it
imports this module."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.spec_base import echo
from memplan.core.training import Recompute
from memplan.inventory import compiled as compiled_layer  # by module: tests take a term out of it
from memplan.inventory import compiled_dsv3, compiled_moe, compiled_moe_moments  # by module: tests patch them
from memplan.inventory import fp8 as fp8_module  # by module: tests take a term out of it
from memplan.inventory import hf_trainer  # by module: tests take a term out of it
from memplan.inventory import liger as liger_kernel  # by module: tests take a term out of it
from memplan.inventory import lora as adapters  # by module: tests take a term out of it
from memplan.inventory import mst as minis
from memplan.inventory import titan_float8  # by module: tests take a term out of it
from memplan.inventory.chunked_loss import loss_moments, loss_terms
from memplan.inventory.fusions import apply_fusions, apply_loss_fusion, apply_norm
from memplan.inventory.hf import hf_inventory
from memplan.inventory.k22 import (
    causal_mask_term,
    k22_outside_layers,
    labels_term,
    layer_backward_moments,
    megatron_layer,
)
from memplan.inventory.mcore import held_decoder_input, mcore_local_inventory
from memplan.inventory.megatron import megatron_inventory
from memplan.inventory.mla import mla_terms
from memplan.inventory.recompute import apply_modules
from memplan.inventory.titan import is_dsv3, titan_inventory
from memplan.inventory.titan_async_tp import workspace_per_sequence
from memplan.inventory.titan_dsv3 import dsv3_inventory
from memplan.inventory.traced import traced_inventory
from memplan.inventory.types import CUDA_BLOCK_BYTES, DEVICES, HF_IMPLS, Dtype, Inventory, transient

IMPLEMENTATIONS: dict[str, str] = {
    "megatron": "Megatron-LM on GPU: fused scaled upper-triangular masked softmax (no mask tensor), "
                "fp32 layer-norm statistics, vocab-parallel embedding and cross-entropy; one fp32 "
                "main-gradient buffer, fused AdamW (default). Step transients derived from its code, not measured. "
                "Beside megatron-local (measured): K / V kept with g heads and rotary fused into the attention "
                "(Transformer Engine), derived from TE / megatron-core code. Mixture of experts (memplan/inventory/moe.py): "
                "megatron-core's MoELayer with Transformer Engine's grouped experts and the fused weighted SwiGLU, "
                "derived from code, not measured. Multi-head latent attention (memplan/inventory/mla.py): latent norms fused "
                "into the up projections, cuDNN fused attention, fused MLA RoPE, derived from megatron-core / TE code, not "
                "measured; multi-token prediction (--mtp-num-layers) on the last stage derived from megatron-core's "
                "multi_token_prediction.py, not measured",
    "megatron-local": "megatron-core 0.16.1's local spec (get_gpt_layer_local_spec, Megatron-LM "
                      "--transformer-impl local): unfused DotProductAttention, torch LayerNorm / RMSNorm, unrotated QKV "
                      "one storage, rotary unfused, K / V repeated for GQA. Measured per term on CPU against megatron-core "
                      "(validation/mcore.py: t = 1, 2, SP, recompute none / selective / full, layer and GPTModel); "
                      "--device cuda applies Megatron-LM's fusion defaults (TE's fused RoPE: no per-layer cos / sin), derived from "
                      "its code, not measured; --no-<name>-fusion switches each off (memplan/inventory/fusions.py). "
                      "`megatron` (the Transformer Engine spec) differs from it by: no mask tensor (fused softmax), "
                      "K / V not repeated, rotary fused, one QKV storage: derived from megatron-core / TE code. "
                      "Mixture of experts: megatron-core's MoELayer (router, alltoall / allgather dispatcher, "
                      "SequentialMLP experts, shared experts, aux loss, capacity factor) measured per term on CPU with "
                      "balanced routing, ep = 1 and 2 (memplan/inventory/moe.py, validation/mcore.py). Multi-head latent "
                      "attention: megatron-core's MLASelfAttention with its latent norms measured per term on CPU (t = 1, "
                      "2, SP, recompute none / selective / full; memplan/inventory/mla.py)",
    "torch": "memplan's reference PyTorch layer (validation/): eager attention with an explicit causal "
             "mask, torch layer norm (fp32 statistics on CUDA, activation dtype on CPU), in a Megatron-like "
             "loop (fp32 main-gradient buffer fed by hooks); torch AdamW foreach (default) or fused",
    "hf-eager": "HF transformers 5.x, attn_implementation='eager' (GPT-2, Llama layout): Python attention "
                "and norms, as measured in validation/hf.py; torch .grad tensors, AdamW fused (the "
                "Trainer's default with torch >= 2.8; a plain torch.optim.AdamW is foreach on CUDA)",
    "hf-sdpa": "HF transformers 5.x, attn_implementation='sdpa': torch's fused attention kernel, "
               "as measured in validation/hf.py; torch .grad tensors, AdamW fused (as hf-eager). "
               "For both hf-*: GPT-2 and the Llama layout use the hand-written inventories; other "
               "architectures (Qwen2/3, Gemma 1-3, Phi-3, the mixture-of-experts Mixtral, Qwen3-MoE and "
               "DeepSeek-V3, ...) a traced one (memplan trace: saved tensors traced from transformers' code, checked "
               "against CPU runs; the backward's transients derived)",
    "torchtune": "torchtune 0.6.1's Llama (llama3 / 3.1 / 3.2 builders, sdpa) in its recipes' loop: K and V expanded "
                 "to all heads before attention, RMSNorm keeping fp32 tensors, RoPE from a cache buffer; saved "
                 "tensors traced from its code on CPU (tests/test_torchtune.py), its loss (whole or "
                 "CEWithChunkedOutputLoss, --loss-chunks N) measured on CPU, the layers' transients derived "
                 "from transformers' measured ones; torch .grad tensors, AdamW fused; --optimizer-in-backward as "
                 "its recipes' optimizer_in_bwd",
    "torchtitan": "torchtitan 0.3.0's Llama 3 (fused QKV, complex RoPE, RMSNorm, SwiGLU) with FSDP2 over --gpus "
                  "(dp_shard, or HSDP with --dp-replicate; fp32 sharded parameters, gradients and AdamW moments, bf16 "
                  "unsharded layers), --tp T (sequence parallel, loss parallel: the per-rank terms measured over gloo "
                  "against parallelize_llama), --cp C (FlexAttention's K and V all-gathered over cp and kept: measured "
                  "on one rank of a fake cp group, validation/titan_cp.py; FSDP2 over dp_shard x cp derived) "
                  "and --ac none / full / selective-op / selective-layer[:N]: the layer's kept tensors measured and traced on CPU against torchtitan's "
                  "real block (validation/titan.py; sdpa in place of FlexAttention); --float8 tensorwise / rowwise (torchao's "
                  "Float8Linear, measured on CPU: memplan/inventory/titan_float8.py); on CUDA the fused RMSNorm derived; "
                  "the next layer's prefetched all-gather derived; the final norm, loss and token ids derived; the "
                  "step's transients not modelled yet",
}


def inventory_for(model: ModelSpec, impl: str = "megatron", device: str = "cuda", loss_chunks: int = 1,
                  fp8: Optional[str] = None, mst: tuple[int, int] = (1, 1)) -> Inventory:
    """The saved tensors of `model` as implementation `impl` runs it on `device`, with the LM head
    and loss computed in `loss_chunks` sequence chunks (1: the implementation's own loss), with
    `fp8` (a recipe), Transformer Engine's FP8 linear layers (memplan/inventory/fp8.py), and MsT's
    mini-sequences `mst` = (MLP pieces, LM-head pieces) (memplan/inventory/mst.py; (1, 1): none)."""
    if impl not in IMPLEMENTATIONS:
        raise MemplanError(f"unknown implementation '{impl}'; known: {', '.join(IMPLEMENTATIONS)}")
    if device not in DEVICES:
        raise MemplanError(f"unknown device '{device}'; known: {', '.join(DEVICES)}")
    if fp8 is not None:
        fp8_module.check_fp8(fp8, impl)
    if model.is_moe and impl == "torch":
        raise MemplanError("no reference torch layer (--impl torch) MoE inventory: use --impl megatron, "
                           "megatron-local, hf-sdpa or hf-eager")
    if model.is_moe and impl in HF_IMPLS and (model.moe_imbalance != 1.0 or model.moe_capacity_factor is not None
                                              or model.moe_aux_loss_coeff or model.moe_z_loss_coeff is not None
                                              or model.moe_router_dtype or model.moe_router_pre_softmax
                                              or model.megatron_core_version != "0.16"):
        raise MemplanError("--moe-imbalance, --moe-capacity-factor and Megatron-LM's router options are modelled for "
                           "--impl megatron / megatron-local (memplan/inventory/moe.py), not for the traced --impl "
                           "hf-* inventories")
    if model.is_moe and impl not in HF_IMPLS and model.bias:
        raise MemplanError("the Megatron-LM MoE inventory models experts without biases (Mixtral, Qwen3-MoE, "
                           "DeepSeek-V3): set bias: false")
    if model.is_mla and impl == "torch":
        raise MemplanError("no reference torch layer (--impl torch) inventory for multi-head latent attention: use "
                           "--impl megatron, megatron-local, hf-sdpa or hf-eager")
    if model.layer_pattern and (impl not in HF_IMPLS or model.inventory is None):
        raise MemplanError("a hybrid's layers (layer_pattern: Mamba-1 / Mamba-2 mixers, short convolutions, gated "
                           "DeltaNets, Kimi Delta Attention, Zamba's shared blocks, RG-LRU, RWKV, lightning attention, "
                           "mLSTM and mixture-of-attention blocks) are modelled from transformers' traced code only: use "
                           "--impl hf-sdpa or hf-eager with its config.json (--hf-config)")
    if model.looped_stacks:
        raise MemplanError("HRM's two stacks run in a loop (H_cycles x (L_cycles + 1) stack passes per step, the first "
                           "L passes of a cycle without gradients): no memplan inventory models it (no Megatron-LM "
                           "layer; transformers' code is not traced: the tracer composes one list of decoder layers)")
    if model.dynamic_mask and impl not in HF_IMPLS:
        raise MemplanError("Doge's dynamic-mask attention (a b x g x s x s mask from dt_proj, its top keep_window_size "
                           "keys kept) is no Megatron-LM layer: use --impl hf-sdpa or hf-eager with its config.json "
                           "(--hf-config)")
    if model.mla_indexer and impl not in ("hf-sdpa", "hf-eager"):  # DeepSeek-V3.2, GLM-5 (presets/hf_families.py)
        raise MemplanError(f"--impl {impl}: the lightning indexer beside the latent attention (mla_indexer) and the top-k "
                           "mask it adds to the attention are modelled from transformers' traced code only: use --impl "
                           "hf-sdpa or hf-eager with its config.json (--hf-config)")
    if model.value_head_dim and impl not in ("hf-sdpa", "hf-eager"):  # MiMo-V2-Flash (presets/hf_latent.py)
        raise MemplanError(f"--impl {impl}: V heads narrower than the Q / K heads (value_head_dim) are modelled from "
                           "transformers' traced code only: use --impl hf-sdpa or hf-eager with its config.json "
                           "(--hf-config)")
    if model.ssm_dt_rank is not None and device == "cpu":  # validation/trace_mamba1.py
        raise MemplanError("Mamba-1 mixers with --device cpu: transformers' torch path loops over s, which a symbolic "
                           "trace cannot follow; memplan models the CUDA kernels' (mamba-ssm) saved tensors only "
                           "(--device cuda)")
    if model.encoder_kind and (impl not in HF_IMPLS or model.inventory is None):  # presets/hf_encoders.py
        raise MemplanError(f"{echo(model.name)} is {model.encoder_description}: --impl {impl} models decoder-only "
                           "layers; use --impl hf-sdpa or hf-eager with its config.json (--hf-config), which traces "
                           "transformers' own code")
    if (model.is_moe or model.is_mla) and model.inventory is None and impl in HF_IMPLS:
        what = "mixture-of-experts" if model.is_moe else "multi-head latent attention"
        raise MemplanError(f"a {what} model's --impl hf-* activations come from a traced inventory: "
                           "give its transformers config.json (--hf-config), or the model's inventory directory")
    inv = _inventory(model, impl, device, loss_chunks)
    if fp8 is not None:
        inv = dataclasses.replace(inv, name=f"{inv.name}/fp8-{fp8}",
                                  terms=tuple(fp8_module.fp8_terms(list(inv.terms), fp8, model.attention)),
                                  moments=tuple(fp8_module.fp8_moments(list(inv.moments), model.attention)))
    if mst != (1, 1):
        if loss_chunks > 1:
            raise MemplanError("--mst computes the LM head and loss in its own pieces: drop --loss-chunks")
        inv = minis.apply(inv, model, *mst)
    layout = "separate" if impl in HF_IMPLS and model.mlp == "swiglu" else "fused"
    return dataclasses.replace(inv, granularity=CUDA_BLOCK_BYTES if device == "cuda" else 1, weight_layout=layout)


def training_inventory(model: ModelSpec, impl: str, device: str, training: Any) -> Inventory:
    """`inventory_for` with what the training settings change in it: the loss chunks, FP8, MsT's pieces
    (memplan/inventory/mst.py, which checks that MsT is modelled for this model, implementation and micro-batch), the
    Megatron-LM fusions switched off (memplan/inventory/fusions.py), selective recompute's modules
    (memplan/inventory/recompute.py), padded / packed batches and reentrant checkpointing (memplan/inventory/hf_trainer.py), Liger-Kernel (memplan/inventory/liger.py) and LoRA / QLoRA (memplan/inventory/lora.py)."""
    if training.liger:  # refused before the implementation's own inventory is built
        liger_kernel.check_liger(model, impl, training.loss_chunks)
    compiled_layer.check_budget(model, impl, training)
    if training.compile:  # an MoE model's: torchtitan's compiled Qwen3 MoE block
        (compiled_moe.check_compile if model.is_moe else compiled_layer.check_compile)(model, impl, training)
        if model.is_moe and model.is_mla:  # torchtitan's DeepSeek-V3 blocks compiled
            compiled_dsv3.check(model)
    titan_float8.check_float8(training.float8, impl)
    hf_trainer.check_layout(model, impl, training.batch_layout)
    hf_trainer.check_reentrant(impl, training)
    pieces = minis.pieces_for(model, training, impl)
    if training.liger and pieces != (1, 1):
        raise MemplanError("--liger computes the LM head and loss in its own chunks: drop --mst")
    inventory = base = inventory_for(model, impl, device, training.loss_chunks, training.fp8, pieces)
    inventory = apply_fusions(inventory, model, impl, device, training.fusions_off)
    inventory = apply_loss_fusion(inventory, impl, device, training.cross_entropy_fusion, training.loss_chunks)
    selective = tuple(training.recompute_modules) if training.recompute == Recompute.SELECTIVE else ()
    inventory = apply_norm(inventory, model, impl, device, training.memory_efficient_layer_norm, selective)
    inventory = apply_modules(inventory, model, impl, training.recompute_modules)
    inventory = held_decoder_input(inventory, model, impl, device, training.recompute,
                                   tuple(training.recompute_modules))
    inventory = hf_trainer.apply(inventory, model, impl, training.batch_layout)  # padded / packed batches
    if training.compile and model.is_moe:  # torch.compile'd MoE blocks (traced from the partitioner)
        inventory = (compiled_dsv3 if model.is_mla else compiled_moe).apply(inventory, model, device)
        if not model.is_mla:  # the compiled Qwen3 MoE block's backward moments (measured on CPU)
            inventory = compiled_moe_moments.apply(inventory, model, device, training.recompute,
                                                   getattr(training, "recompute_num_layers", None) is not None)
    elif training.compile:  # torch.compile'd decoder layers (traced from the partitioner)
        inventory = compiled_layer.apply(inventory, model, impl, training.float8, training.loss_chunks,
                                         training.memory_budget, training.recompute,
                                         getattr(training, "recompute_num_layers", None) is not None)
    if training.float8:  # torchtitan's torchao float8 linears (measured on CPU)
        inventory = titan_float8.apply(inventory, model, training.float8)
    if training.checkpoint_reentrant:
        inventory = hf_trainer.reentrant(inventory)
    if training.liger:  # Liger-Kernel's fused kernels (derived from its code)
        inventory = liger_kernel.apply(inventory, model, impl, training.loss_chunks)
    if training.lora_rank:  # peft LoRA / QLoRA
        inventory = adapters.apply(inventory, model, impl, device, training)
    if training.optimizer_in_backward and inventory.grad_lifetime != "backward":
        raise MemplanError(f"the optimizer step in the backward is modelled for torch .grad training loops "
                           f"(--impl hf-*), not --impl {impl}")
    # a traced step's order is the traced code's: a setting that changed the inventory changes the code run, as do
    # other dtypes than the trace's bf16 weights, gradients and activations without master weights (bf16-true); a
    # MoE or MLA model's traced order is not checked against recordings (memplan/memory/stream_traced.py)
    same = ((inventory.terms, inventory.moments, inventory.held) == (base.terms, base.moments, base.held)
            and (training.weight_bytes, training.grad_bytes, training.activation_bytes,
                 training.master_weight_bytes) == (2, 2, 2, 0) and not model.is_moe and not model.is_mla)
    workspace = workspace_per_sequence(model, training.activation_bytes) if training.async_tp else 0
    return dataclasses.replace(inventory, stream_checked=stream_checked(model, impl, device, training),
                               step_order=inventory.step_order if same else (), symm_workspace_bytes=workspace)


def stream_checked(model: ModelSpec, impl: str, device: str, training: Any) -> bool:
    """Whether memplan's allocation stream of this run is the one checked against recordings of the real code's
    allocations in order (tests/test_alloc_fixtures.py, memplan/check/allocator.py ALLOCATOR_CASES): transformers'
    dense Llama layout with sdpa (memplan's own inventory, not a trace), the loop's plain loss, torch AdamW (foreach or
    fused), with or without gradient checkpointing, no data-parallel stack (FSDP2's, DeepSpeed's gathers), nothing
    else of the training settings changed. Only there does the replay alone decide fit (memplan/memory/timeline.py
    device_memory); elsewhere the flat margin stays."""
    changed = (training.compile, training.lora_rank, training.liger, training.fp8, training.float8, training.dp_stack,
               training.checkpoint_reentrant, training.optimizer_in_backward, training.offload_activations,
               training.offload_optimizer_fraction, training.fusions_off, training.loss_chunks != 1,
               training.mst != 1, training.batch_layout != "full", training.optimizer != "adamw")
    return (impl == "hf-sdpa" and device == "cuda" and model.inventory is None and not model.is_moe
            and not model.is_mla and not any(changed))


def _inventory(model: ModelSpec, impl: str, device: str, loss_chunks: int) -> Inventory:
    stats: Dtype = "fp32" if device == "cuda" else "act"
    if impl == "torchtune" and (model.inventory is not None or model.is_moe or model.is_mla):
        raise MemplanError("--impl torchtune models torchtune's Llama (dense, RMSNorm, SwiGLU); a traced "
                           "inventory is transformers' code: use --impl hf-sdpa for it")
    if impl == "torchtitan":
        if loss_chunks > 1:
            raise MemplanError("--impl torchtitan with --loss-chunks is not modelled")
        return dsv3_inventory(model, device) if is_dsv3(model) else titan_inventory(model, device)
    if impl in HF_IMPLS:
        if model.inventory is not None:
            return traced_inventory(model, impl, device, loss_chunks)
        return hf_inventory(model, impl, device, loss_chunks)
    if impl == "megatron-local":
        return mcore_local_inventory(model, device, loss_chunks)
    if impl == "torch":
        if model.attention != "eager" or model.mlp != "gelu" or model.norm != "layernorm":
            raise MemplanError("the reference torch layer (--impl torch) is the K22 GPT layer: eager attention, "
                               "GeLU MLP, LayerNorm")
        terms = megatron_layer(model, "eager", stats) + k22_outside_layers(model, stats) + [causal_mask_term()]
        src = "measured: reference layer in a Megatron-like loop (validation/step.py)"
        emb = transient("embedding_sum", "word + position embedding sum (a local of the reference forward)", "s b h",
                 scope="last", src=src)
        # torch.utils.checkpoint (non-reentrant) stops re-running the layer after its last saved tensor and
        # keeps none of the re-run's outputs.
        moments = layer_backward_moments(model, "eager", device, src) + loss_moments(impl, loss_chunks, src, (emb,))
        terms = loss_terms(terms, impl, loss_chunks)
        # The reference loop (validation/step.py) accumulates each bf16 .grad into the fp32 buffer
        # with a hook (Megatron-LM without gradient-accumulation fusion); torch AdamW defaults to
        # foreach on CUDA tensors.
        return Inventory(f"{impl}/{model.attention}/{device}", tuple(terms), tuple(moments), "buffer", True,
                         "foreach", "torch", (labels_term(),))
    terms = megatron_layer(model, model.attention, stats) + k22_outside_layers(model, stats)
    if model.is_mla:
        terms = mla_terms(terms, model, impl, device)
    src = "derived from Megatron-LM code (autograd order of the reference layer), not measured"
    # Megatron-LM's CheckpointFunction re-runs a layer's whole forward and back-propagates from its output.
    rerun = ("s b h", "the recomputed layer's output (Megatron-LM CheckpointFunction)", src)
    moments = layer_backward_moments(model, model.attention, device, src, rerun) + loss_moments(impl, loss_chunks, src)
    terms = loss_terms(terms, impl, loss_chunks)
    return megatron_inventory(f"{impl}/{model.attention}/{device}", terms, moments, model, stats, moe_cpu=False)
