"""Context parallelism (cp) and expert parallelism (ep, etp): what they split, the buffers they add, the groups
their states are sharded over and the communication they cost. Derived from reading Megatron-LM (core 0.20.0,
github.com/NVIDIA/Megatron-LM at d98e8a6) and Transformer Engine (github.com/NVIDIA/TransformerEngine at d0067d0);
not measured (`memplan impls` says so).

Context parallelism (Megatron-LM --context-parallel-size, --cp-comm-type p2p | a2a)
- Every rank holds s/cp tokens of each sequence: get_batch_on_this_cp_rank (megatron/core/utils.py) cuts the
  sequence into 2 cp chunks and gives rank r chunks r and 2cp - 1 - r (the causal load balance; hence
  2 cp | s, megatron/training/arguments.py). Every saved tensor is the rank's s/cp tokens' (Term.bytes divides by
  cp), the logits included; eager attention is refused (Transformer Engine's unfused attention has no context
  parallelism: dot_product_attention/utils.py get_attention_backend).
- p2p (ring attention, transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py
  AttnFuncWithCPAndKVP2P): the forward saves q, one K/V chunk of the rank's size (the last one received), out and
  softmax_lse: the local shards' sizes, as without cp. Its forward keeps every K/V chunk it receives in
  `p2p_comm_buffers` (a list of cp entries, the first a torch.cat copy of the rank's own K and V) and every step's
  partial output and log-sum-exp (`out_per_step`, `softmax_lse_per_step`) until the correction loop ends: on the
  last rank, whose causal steps are all full-size, cp K/V chunks + cp partial outputs + cp + 1 fp32 log-sum-exps
  (the running one). Its backward double-buffers K/V with their gradients (`p2p_comm_buffers = [torch.empty((2,
  *kv.shape)), ...]`: 4 K/V-chunk sizes) and accumulates dQ in `dq_buffer` (empty_like(q)).
- a2a (Ulysses, AttnFuncWithCPAndQKVOA2A with flash_attn_a2a_communicate): Q, K, V are exchanged so that each
  rank holds the whole sequence for a/cp heads (so cp must divide a/t and g/t); the saved q, k, v, out and
  softmax_lse have the same sizes as the local shards. Transients: the all-to-all's output of Q, K and V beside
  its input in the forward (and of dQ, dK, dV in the backward), plus the exchanged output / its gradient.
- Parameters are replicated over cp; gradients are reduced, and the distributed optimizer shards, over the d x cp
  ranks (megatron/core/distributed/distributed_data_parallel.py: non-expert buffers use intra_dp_cp_group).

Expert parallelism (Megatron-LM --expert-model-parallel-size, --expert-tensor-parallel-size)
- A stage's t x cp x d ranks are folded into etp x ep x edp for the experts: edp = t cp d / (etp ep)
  (megatron/core/parallel_state.py initialize_model_parallel: expert_data_parallel_size = world_size //
  (etp * ep * pp)); etp defaults to t (megatron/training/arguments.py). A GPU holds E/ep routed experts, each
  f_e/etp wide (ParamGroup.expert); the router and shared experts stay as the dense layers split them. Expert
  gradients are reduced and sharded over the edp ranks (intra_expt_dp_group), the others over d x cp.
- Activations (the alltoall dispatcher, megatron/core/transformer/moe/token_dispatcher.py
  MoEAlltoAllTokenDispatcher): a GPU routes its own s b / (t cp) tokens (SP: MoE with t > 1 requires it, MoELayer)
  k times, sends them by all-to-all over ep and, with etp > 1, all-gathers the received ones over etp
  (dispatch_postprocess). With balanced routing each of the ep ranks receives, for its E/ep experts, k s b / (t cp)
  token copies from the ep ranks together (ep x k s b / (t cp ep)): the expert activations per GPU do not shrink
  with ep. After the etp all-gather the h-wide routed tokens are etp times that (Term.etp_gathered); the f_e-wide
  ones are f_e/etp wide for etp times the tokens, k s b f_e / (t cp): tp_split terms. Load imbalance (some ranks'
  experts receiving more) is the inventory's factor, not ep's.
- Step time: dispatch and combine are two all-to-alls of k s b h / (t cp) activations per MoE layer in the
  forward and two in the backward, (ep - 1)/ep of each leaving the GPU; counted as exposed.
"""

from __future__ import annotations

from typing import Any

from memplan.inventory.types import Moment, Term, transient
from memplan.memory.states import StateBytes, state_bytes

TE_CP = "derived from Transformer Engine context_parallel.py {}, not measured"


def cp_transients(model: Any, comm: str) -> tuple[tuple[Term, ...], tuple[Term, ...]]:
    """The buffers context-parallel attention adds inside a layer's forward and backward, on the most loaded rank,
    beside what attention without cp holds there (module docstring). Elements are per sequence before the cp
    split (Term.bytes divides by cp): a term of `cp s b ...` is cp chunks of the rank's size. Each exists only with
    cp > 1 (needs_cp); heads split over t (tp)."""
    kv, q = "2 s b q g /a", "s b q"
    if comm == "p2p":
        src = TE_CP.format("AttnFuncWithCPAndKVP2P")
        forward = (
            transient("cp_kv_chunks", "K/V chunks received by the ring (p2p_comm_buffers: cp of them)", "2 cp s b q g /a", tp=True, src=src, needs_cp=True),
            transient("cp_out_per_step", "partial attention outputs of the cp ring steps (out_per_step)", "cp s b q", tp=True,
               src=src, needs_cp=True),
            transient("cp_lse_per_step", "log-sum-exp of the cp ring steps and the running one (fp32)", "cp a s b + a s b",
               "fp32", tp=True, src=src, needs_cp=True),
        )
        backward = (
            transient("cp_kv_dkv_buffers", "double-buffered K/V and their gradients (p2p_comm_buffers)", "4 s b q g /a", tp=True, src=src, needs_cp=True),
            transient("cp_dq_buffer", "dQ accumulator of the ring (dq_buffer)", q, tp=True, src=src, needs_cp=True),
        )
        return forward, backward
    src = TE_CP.format("AttnFuncWithCPAndQKVOA2A / flash_attn_a2a_communicate")
    forward = (transient("cp_a2a_qkv", "Q, K, V after the all-to-all (beside the rank's own)", f"{q} + {kv}", tp=True,
                  src=src, needs_cp=True),
               transient("cp_a2a_out", "attention output before its all-to-all back", q, tp=True, src=src, needs_cp=True))
    backward = (transient("cp_a2a_dout", "output gradient after its all-to-all", q, tp=True, src=src, needs_cp=True),
                transient("cp_a2a_dqkv", "dQ, dK, dV before their all-to-all back", f"{q} + {kv}", tp=True, src=src,
                   needs_cp=True))
    return forward, backward


def state_shard(plan: Any) -> Any:
    """Ranks the non-expert ZeRO / distributed-optimizer states are split over: the shard group of d (d, or fewer
    with HSDP) times cp (Megatron-LM's dp x cp group)."""
    return plan.shard * plan.cp


def expert_shard(plan: Any) -> Any:
    """Ranks the routed experts' sharded states are split over: the expert-data-parallel group edp = t cp d /
    (etp ep), over the d / shard distributed-optimizer instances (parallel_state.py: intra_partial_expert_data_
    parallel_size = edp // num_distributed_optimizer_instances)."""
    return plan.t * plan.cp * plan.shard // (plan.expert_tp * plan.ep)


def expert_states(states: Any, expert_params: Any, training: Any, plan: Any) -> Any:
    """`states` (every parameter's, sharded over the d x cp group) with the routed experts' `expert_params` sharded
    over their expert-data-parallel group instead (the same when ep = 1 and etp = t)."""
    as_dense = state_bytes(expert_params, training, state_shard(plan), plan.zero)
    as_expert = state_bytes(expert_params, training, expert_shard(plan), plan.zero)
    return StateBytes(states.weights - as_dense.weights + as_expert.weights,
                      states.gradients - as_dense.gradients + as_expert.gradients,
                      states.optimizer - as_dense.optimizer + as_expert.optimizer)


def cp_moments(model: Any, inventory: Any, plan: Any) -> tuple[tuple[Any, ...], tuple[Term, ...]]:
    """Context parallelism's moments for the step timeline: a forward moment inside the attention (the layer's
    saves up to its attention output alive, its MLP's not yet: `freed`) with the forward buffers, and the backward
    buffers the attention backward adds. None for a plan without cp > 1 (no event is added) or an inventory without
    Megatron-LM's flash attention (cp is refused there: specs.py, terms_hf.check_hf_plan)."""
    cps = getattr(plan.cp, "max", lambda: plan.cp)()
    if int(cps) <= 1 or inventory.runtime != "megatron" or not any(t.id == "softmax_lse" for t in inventory.terms):
        return (), ()
    forward, backward = cp_transients(model, plan.cp_comm)
    layer = [t for t in inventory.terms if t.scope == "layer"]
    first_mlp = next((i for i, t in enumerate(layer) if t.block == "MLP"), len(layer))
    last_attention = max((i for i, t in enumerate(layer[:first_mlp]) if t.block == "attention"), default=first_mlp - 1)
    later = tuple(t.id for t in layer[last_attention + 1:])
    src = forward[0].source
    return (Moment("cp_attention_forward", f"attention forward: context-parallel {plan.cp_comm} buffers", "forward",
                   "layer", forward, later, recomputed=False, source=src),), backward


IMPLS_TEXT = ("context parallelism (--cp, --cp-comm-type p2p | a2a) and expert parallelism (--ep, --etp) for --impl "
              "megatron: derived from Megatron-LM (parallel_state.py, distributed_data_parallel.py, the MoE alltoall "
              "dispatcher) and Transformer Engine (context_parallel.py AttnFuncWithCPAndKVP2P / QKVOA2A), not "
              "measured; memplan/memory/parallel.py cites each rule")


def notes(config: Any) -> list[str]:
    """What estimate says about a plan's context / expert parallelism."""
    par, out = config.parallel, []
    if par.cp > 1 and config.training.dp_stack == "torchtitan":
        out.append(f"context parallelism cp = {par.cp} (torchtitan): each GPU holds s/cp = "
                   f"{config.model.seq_length // par.cp:,} tokens of every sequence (head-tail load balanced); "
                   "FlexAttention's K and V all-gathered over the cp group and kept (the whole sequence's; measured "
                   "on one rank of a fake cp group on CPU, the sdpa kernel in place of FlexAttention's); FSDP2's "
                   "states sharded over dp_shard x cp (derived from torchtitan's ParallelDims, not measured); the "
                   "whole sequence's K, V gradients in the backward not counted (memplan/inventory/titan.py)")
    elif par.cp > 1:
        out.append(f"context parallelism cp = {par.cp} ({par.cp_comm_type}): each GPU holds s/cp = "
                   f"{config.model.seq_length // par.cp:,} tokens of every sequence; the attention's "
                   f"{'ring' if par.cp_comm_type == 'p2p' else 'all-to-all'} buffers and the d x cp state sharding "
                   "are derived from Transformer Engine / Megatron-LM code, not measured (memplan/memory/parallel.py)")
    if par.ep > 1 and config.model.is_moe and config.training.dp_stack == "torchtitan":
        out.append(f"expert parallelism ep = {par.ep} (torchtitan): each GPU holds E/ep = {config.model.num_experts // par.ep} "
                   f"experts, their FSDP2 states sharded over efsdp = dp_shard t cp / ep = {par.tp * par.cp * par.shard // par.ep} ranks"
                   + (f" in each of the {par.dp // par.shard} HSDP replicas (torchtitan's sparse mesh (pp, "
                      "dp_replicate, efsdp, ep); measured on 4 ranks over gloo, 2 replicas, ep 2)" if par.dp > par.shard else "")
                   + ", the layer in flight with the GPU's experts only (measured with torchtitan's parallelize_qwen3 / "
                   "parallelize_deepseekv3 "
                   "on 2 ranks over gloo; the prefetched layer derived); the routed tokens' activations as "
                   "torchtitan's all-to-all dispatcher keeps them with balanced routing (R = k s b "
                   + ("/ t tokens received: with TP the MoE keeps the rank's sequence shard, its experts not "
                      "TP-sharded (etp 1), measured with tp 2 and ep 2 on 2 ranks over gloo; " if par.tp > 1 else
                      "tokens received: ") + "they do not shrink with ep; at worst ep times that, not modelled), "
                   "measured on 2 ranks over gloo (memplan/inventory/titan_moe.py)")
    elif par.tp > 1 and config.model.is_moe and config.training.dp_stack == "torchtitan":
        out.append(f"torchtitan MoE with tp = {par.tp} at ep 1: the experts' hidden dim sharded over tp (etp = tp), "
                   "the MoE's input all-gathered over the sequence: the router's and the dispatcher's tensors over the "
                   "whole s b tokens, the experts' f_e / t wide, the output reduce-scattered; measured with "
                   "torchtitan's parallelize_qwen3 on 2 ranks over gloo (memplan/inventory/titan_moe.py)")
    elif par.ep * par.expert_tp > 1 and config.model.is_moe:
        out.append("expert parallelism: experts split over ep x etp, activations of the routed tokens as the "
                   "alltoall dispatcher keeps them with balanced routing (they do not shrink with ep); derived from "
                   "Megatron-LM code, not measured (memplan/memory/parallel.py)")
    return out
