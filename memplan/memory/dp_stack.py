"""The data-parallel stack of an HF Trainer / accelerate run: FSDP2 (accelerate `fsdp_version: 2`) or DeepSpeed ZeRO
1 / 2 / 3; and torchtitan's FSDP2 (--impl torchtitan: fp32 shards, no bf16 sharded copy, its units unsharded in bf16
by phase of the step, `TITAN_HELD`; memplan/inventory/titan.py fsdp2_states). The sharding itself is memplan's ZeRO (memplan/memory/states.py: stage 1 the master weights and moments,
2 also the gradients, 3 also the weights, over the d data-parallel ranks); what a stack adds on top is here.

All of it is derived from the stacks' code, not measured (CPU runs of these stacks cannot measure a CUDA allocator):

- FSDP2 (accelerate 1.15 utils/fsdp_utils.py fsdp2_prepare_model, torch 2.13 fully_shard): each decoder layer is
  a unit (TRANSFORMER_BASED_WRAP), the untied input embedding a unit, the final norm and output layer a "tail" unit
  that is not resharded after the forward, the root last. Measured on CPU (validation/fsdp2.py,
  tests/test_launch_trainer.py): one layer's unsharded parameters while it computes, and the tail's (v h + h) from
  its forward until its backward, nothing else; with tied embeddings the tail unit holds the embedding too, and
  is gathered from the embedding's forward to its backward: the whole step. Derived (a GPU runs ahead of the host, a CPU does not): while a
  layer computes, the next layer's all-gather is already issued (FSDP2's implicit prefetch; in the backward the
  previous layer's), and in the backward each layer's unsharded gradients (the reduce-scatter's input, in the
  parameters' dtype) are alive: three layers during the layers' backward, the tail and the last layer's prefetch
  at the loss; memplan keeps the larger all step.
- torchtune's distributed recipes (--impl torchtune --fsdp2; torchtune 0.6.1 training/_distributed.py shard_model,
  torch 2.13 fully_shard): each decoder layer a unit (reshard_after_forward: fsdp_reshard_after_forward, default
  true), the model itself the root unit last; the 70B / 405B configs leave custom_sharded_layers commented out, so
  the root holds the input embedding, the final norm and the output layer (v h + h + v h untied); torchtune passes
  reshard_after_forward=True explicitly, so torch reshards the root after its forward too (torch _fsdp_state.py
  _lazy_init keeps the root unsharded only for the default None): the root is gathered through the forward and
  again through the backward, under every layer. Measured on CPU over gloo, 2 ranks (validation/fsdp2.py
  tune_unsharded_moments): one layer plus the root while a layer computes, nothing after the forward or the
  backward. Derived as for
  accelerate: the prefetched layer and one layer's unsharded gradients, so 3 layers + the root. LoRA / QLoRA: the
  frozen base sits in the same units as the adapters and is gathered with them (counted in the weights' dtype).
- DeepSpeed ZeRO (deepspeed 0.19.8 runtime/zero/config.py, stage_1_and_2.py setup_buckets, stage3.py): with
  contiguous_gradients (default true) every stage keeps an IPG bucket of reduce_bucket_size elements in the model's
  dtype (gradient_accumulation_dtype defaults to it), and a second one when overlap_comm is on (its default: true
  for stage 3 only). Stage 3 gathers parameters one submodule at a time: alive are the submodule's own (the largest
  is one MLP projection, h x f) and the prefetch bucket (stage3_prefetch_bucket_size), at most
  stage3_max_live_parameters in all. The HF Trainer fills the "auto" values from the model
  (transformers/integrations/deepspeed.py: reduce_bucket_size h^2, stage3_prefetch_bucket_size 0.9 h^2,
  stage3_param_persistence_threshold 10 h); those are what memplan plans and --emit deepspeed writes.
- torchtitan with pipeline parallelism (--impl torchtitan --pp P; `titan_pipelined`): torchtitan's
  fsdp_reshard_after_forward "default" is ``not pp_enabled`` (distributed/fsdp.py
  get_fsdp_reshard_after_forward_policy), and torch's pipeline stage turns off resharding after the backward and
  the gradient reduction for every micro-batch but the last (torch 2.13 distributed/pipelining/stage.py
  backward_maybe_with_nosync: set_reshard_after_backward(False), set_requires_gradient_sync(False); the reduction
  in perform_reduce_grad at the step's end): the stage's parameters stay unsharded in bf16 for the whole step, and
  FSDP2 accumulates their gradients unsharded in the fp32 reduce dtype (fully_shard/_fsdp_param.py
  to_accumulated_grad_if_needed): 2 + 4 bytes per parameter of the stage, derived, not measured.
"""

from __future__ import annotations

from typing import Any, Optional

from memplan.core.arith import maximum
from memplan.core.model import ModelSpec
from memplan.core.training import TrainingSpec
from memplan.inventory.titan import GPU_PREFETCH
from memplan.inventory.titan_float8 import gathered_layer

STACKS = ("fsdp2", "deepspeed", "torchtitan", "torchtune")

# deepspeed 0.19.8 runtime/zero/config.py: stage3_max_live_parameters' default (elements)
DS_MAX_LIVE_PARAMETERS = 10**9


def shard_bytes(n: Any, d: Any, on: Any) -> Any:
    """n bytes, split over d ranks (rounded up) where `on` is true."""
    return on * (-(-n // d)) + (1 - on) * n


def hf_auto_buckets(model: ModelSpec) -> dict[str, int]:
    """The DeepSpeed bucket sizes (elements) the HF Trainer writes for "auto" (HfTrainerDeepSpeedConfig)."""
    h = model.hidden_size
    return {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h}


def overlap_comm(zero: int) -> bool:
    """DeepSpeed's overlap_comm default (config.py overlap_comm_valid: on for stage 3 only)."""
    return zero == 3


def rope_cache_bytes(model: ModelSpec) -> int:
    """torchtitan 0.3.0's RoPE cache of one decoder layer: each block's attention builds its own RoPE module, whose
    non-persistent buffer ``cache`` holds every position up to its ``max_seq_len`` (models/common/rope.py), which
    ``Decoder.Config.update_from_config`` sets to the Trainer's ``training.seq_len``: ComplexRoPE (Llama 3) s x d/2
    complex64 = 4 s d bytes, CosSinRoPE (Qwen3, q / k norms: cos and sin concatenated, fp32 [s, 2d]) 8 s d bytes
    (d the head dim), DeepSeek-V3's ComplexRoPE (yarn-scaled) over the rotated part only, d = qk_rope_head_dim. A
    buffer: not sharded by FSDP2, whole on every rank (TP; CP too: the whole sequence). Measured for ComplexRoPE
    over gloo (validation/titan_step.py); each module's buffer built by torchtitan's own code (tests/test_titan.py)."""
    if model.is_mla:
        return 4 * model.seq_length * model.qk_rope_head_dim
    return (8 if model.qk_norm else 4) * model.seq_length * (model.q // model.num_attention_heads)


def buffer_bytes(training: TrainingSpec, model: ModelSpec, zero: Any, layers: Any = 0) -> Any:
    """Bytes a stack keeps on every GPU for the whole step beyond the states: DeepSpeed's IPG reduce bucket(s),
    reduce_bucket_size elements of the model's dtype each, two with overlap_comm; torchtitan the RoPE caches of the
    stage's ``layers`` (`rope_cache_bytes`); FSDP2 none (its buffers are per layer: `gathered_params`)."""
    if training.dp_stack == "torchtitan":
        return layers * rope_cache_bytes(model)
    if training.dp_stack != "deepspeed":
        return 0
    buckets = 1 + 1 * (zero == 3)  # overlap_comm's default (a second bucket): stage 3 only
    return buckets * hf_auto_buckets(model)["reduce_bucket_size"] * training.weight_bytes


def gathered_params(training: TrainingSpec, model: ModelSpec, layer: Any, tail: Any, t: Any = 1) -> Optional[Any]:
    """Unsharded parameters alive at once under ZeRO 3 (elements, in the weights' dtype), given one layer's
    parameters `layer` and the tail unit's (final norm, output layer) `tail`; None: memplan's default (one layer,
    memplan/memory/states.py state_bytes). FSDP2: the larger of three layers (the one computing, the prefetched one,
    one layer's unsharded gradients) and the tail with one layer (the loss); tied embeddings: both (the tail is
    unsharded all step). torchtune: 3 layers (2 with LoRA: a frozen base makes no unsharded gradients) and the
    root (the tail and, untied, the input embedding v h), gathered under every layer; `layer` is what a layer
    gathers (QLoRA's in NF4: memplan/memory/adapters.py gathered_base_layer). DeepSpeed stage 3: the largest
    submodule (an MLP projection, h x f) and the prefetch bucket, capped at stage3_max_live_parameters. `t`: the
    TP degree (torchtitan's float8 linears are TP shards)."""
    if training.dp_stack == "torchtitan":  # memplan/inventory/titan.py fsdp2_states: running + prefetched layers, tail
        # tensorwise float8: the layers all-gathered in float8 (memplan/inventory/titan_float8.py); the tail bf16
        return (1 + GPU_PREFETCH) * (gathered_layer(model, layer, t) if training.float8 == "tensorwise" else layer) + tail
    if training.dp_stack == "fsdp2":  # tied: the tail holds the embedding, gathered from the first layer's forward
        return 3 * layer + tail if model.tied_embeddings else maximum(3 * layer, tail + layer)
    if training.dp_stack == "torchtune":  # the root unit: embedding, final norm, output layer (one v h when tied)
        # LoRA: the frozen base has no unsharded gradients (the adapters' are counted with the adapters): 2 layers
        layers = 2 if training.lora_rank else 3
        return layers * layer + tail + (0 if model.tied_embeddings else model.vocab_size * model.hidden_size)
    if training.dp_stack == "deepspeed":
        prefetch = hf_auto_buckets(model)["stage3_prefetch_bucket_size"]
        return min(model.hidden_size * model.f + prefetch, DS_MAX_LIVE_PARAMETERS)
    return None


def titan_pipelined(training: TrainingSpec, p: Any, params: Any, gathered: Any) -> tuple[Any, Any]:
    """(unsharded parameters in flight, in elements; extra gradient bytes) of a torchtitan stage: with p > 1 the
    stage's ``params`` all unsharded and their fp32 unsharded accumulated gradients (module docstring), else
    ``gathered`` and nothing. Scalars or arrays."""
    if training.dp_stack != "torchtitan":
        return gathered, 0
    on = 1 * (p > 1)
    return on * params + (1 - on) * gathered, on * 4 * params


# torchtitan without PP, untied embeddings: FSDP2's units unsharded (in the weights' dtype) at each phase of the step.
# Measured over gloo (validation/titan_step.py, tests/test_titan_step.py): inside a layer's forward the layer and its
# flat all-gather output (two layers' bytes); at the loss the final norm + LM head only (the root's post-forward frees
# the last all-gather output; the head is not resharded after its forward); in the head's backward the head and the
# last layer, prefetched by the head's pre-backward (measured at the final norm's backward; the LM head's own backward
# derived from the same hook order); inside a layer's backward the layer and the one prefetched (at the first layer
# the embedding); at its reduce-scatter only the prefetched one (the layer resharded first); in the embedding's
# backward the embedding; at the optimizer step nothing.
TITAN_HELD = {"forward": ("layer", "layer"), "loss": ("tail",), "head": ("tail", "layer"),
              "layer": ("layer", "layer"), "first layer": ("layer", "embedding"),
              "reduce-scatter": ("layer",), "first reduce-scatter": ("embedding",),
              "embedding": ("embedding",), "optimizer": ()}


def titan_regather(held: list[str], phase: str) -> tuple[list[bool], list[str]]:
    """Of the units `held` (names), which stay in flight at `phase` (`TITAN_HELD`), and the units all-gathered anew."""
    want, stay = list(TITAN_HELD[phase]), []
    for unit in held:
        stay.append(unit in want)
        if stay[-1]:
            want.remove(unit)
    return stay, want


def titan_units(training: TrainingSpec, model: ModelSpec, layer: Any, tail: Any, embedding: Any, p: Any,
                t: Any = 1) -> Optional[dict[str, Any]]:
    """FSDP2's units in bytes (a decoder layer as gathered: float8 tensorwise in float8, `gathered_params`; the tail:
    final norm + LM head; the input embedding) and ``on`` (1 where p = 1), for `TITAN_HELD`; ``tail_rs`` the tail's
    reduce-scatter input, which torch 2.13's post_backward keeps through the last layer's backward (measured, as a
    layer's through the next layer's: memplan/inventory/titan_moments.py rs_held); None outside torchtitan and with
    tied embeddings (the tail then shares the embedding: counted all step, derived)."""
    if training.dp_stack != "torchtitan" or model.tied_embeddings:
        return None
    if training.float8 == "tensorwise":
        layer = gathered_layer(model, layer, t)
    wb = training.weight_bytes  # tail_rs: the tail's fp32 reduce-scatter input (MixedPrecisionPolicy reduce fp32)
    return {"layer": layer * wb, "tail": tail * wb, "embedding": embedding * wb, "tail_rs": 4 * tail, "on": 1 * (p == 1)}


def sharded_weight_bytes(training: TrainingSpec) -> int:
    """Bytes per parameter of the sharded weights beside the optimizer's copy: torchtitan's FSDP2 keeps only the fp32
    sharded parameters (the optimizer steps them: counted as the master weights) and all-gathers bf16 from them."""
    return 0 if training.dp_stack == "torchtitan" else training.weight_bytes


# what the recordings of torchtitan's step show of memplan's allocation stream (tests/test_titan_alloc.py)
TITAN_STREAM_NOTE = ("torchtitan's allocation stream (untied embeddings): its order and sizes checked against CPU "
                     "recordings of a whole FSDP2 step over gloo (dense Llama 3, AC none / full / selective-op: every "
                     "size a recorded one; FSDP2's per-parameter states, unsharded storages, flat all-gather outputs "
                     "and reduce-scatter inputs as recorded); replayed, its reserved peak is "
                     "0.7-6.0 % below the recording's where the blocks are large-pool (the real order of RMSNorm's "
                     "fp32 temporaries is not the stream's); CUDA kernels' workspaces, FlexAttention's buffers and "
                     "FSDP2's all-gathers ahead on their own streams are not recorded: the verdict keeps the flat "
                     "fragmentation margin")


def notes(training: TrainingSpec, zero: int, dp: int = 1, shard: int = 1, pp: int = 1) -> list[str]:
    """What the plan's stack adds, said as derived (``dp`` data-parallel ranks, ``shard`` of them per shard group,
    ``pp`` pipeline stages)."""
    if training.dp_stack == "torchtitan" and pp > 1:
        return ["torchtitan FSDP2 with pipeline parallelism: fp32 sharded parameters, gradients and AdamW moments of "
                "the stage over the data-parallel ranks, the stage's parameters unsharded in bf16 all step "
                "(reshard_after_forward off with PP) and their gradients accumulated unsharded in fp32 until the "
                "last micro-batch's backward (torch's pipeline stage: set_requires_gradient_sync(False)): derived "
                "from torchtitan 0.3.0's and torch 2.13's code, not measured"]
    if training.dp_stack == "torchtitan":
        over = ("the data-parallel ranks (16 B / d per parameter" if shard == dp else
                f"each HSDP shard group of {shard} ranks ({dp // shard} replicas, torchtitan's "
                f"data_parallel_replicate_degree; 16 B / {shard} per parameter")
        return ["torchtitan FSDP2 (fully_shard per decoder layer, bf16 params / fp32 reduce): fp32 sharded parameters, "
                f"gradients and AdamW moments over {over}; dim-0 padding not "
                "counted), measured over gloo on 2 ranks; the unsharded bf16 parameters counted with the weights follow "
                "FSDP2's units by phase (measured in a whole step over gloo): two layers inside a layer (its own and its "
                "all-gather output or the prefetched one; the embedding at the first layer's backward), the final norm + "
                "LM head alone at the loss, none at the optimizer step (tied embeddings: two layers and the head all step, "
                "derived); with them each layer's RoPE "
                "cache (a buffer of training.seq_len positions, 4 s d B a layer for Llama 3, 8 s d B for Qwen3, 4 s "
                "d_r B for DeepSeek-V3: measured, Llama 3's in a whole training step over gloo)", TITAN_STREAM_NOTE]
    if training.dp_stack == "fsdp2":
        return ["FSDP2 (accelerate fsdp_version 2): the unsharded parameters counted with the weights are the larger "
                "of three layers (computing, prefetched, unsharded gradients) and the output layer with final norm "
                "plus one layer (at the loss); the output layer's and one layer's measured with accelerate on CPU, "
                "the prefetch and the gradients derived from torch's fully_shard code"]
    if training.dp_stack == "torchtune":
        return ["torchtune FSDP2 (training.shard_model: a unit per decoder layer, the root last): the unsharded "
                "parameters counted with the weights are three layers (computing, prefetched, unsharded gradients) "
                "and the root's input embedding, final norm and output layer, gathered through the forward and "
                "again through the backward; one layer and the root measured with torchtune's shard_model "
                "on CPU over gloo, the prefetch and the gradients derived; with LoRA / QLoRA the frozen base is "
                "gathered with its unit (in the weights' dtype)"]
    if training.dp_stack == "deepspeed":
        extra = ("; stage 3 gathers the largest submodule plus the prefetch bucket (0.9 h^2)" if zero == 3 else "")
        return [f"DeepSpeed ZeRO {zero}: IPG reduce bucket(s) of h^2 elements (the HF Trainer's 'auto') counted with "
                f"the weights{extra}; derived from deepspeed 0.19.8's code, not measured"]
    return []
