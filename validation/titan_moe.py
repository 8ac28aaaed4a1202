"""torchtitan 0.3.0's Qwen3 MoE decoder layer (models/common/moe.py MoE: TokenChoiceTopKRouter, the token
dispatcher, GroupedExperts on ``torch._grouped_mm``): what its real code keeps for the backward, measured on CPU.

``build_moe_block(shape)`` builds one ``Qwen3TransformerBlock`` from torchtitan's own
``_build_qwen3_moe_layers`` (softmax router with route_norm, no shared experts, the load-balancing bias buffer) in
bf16, ``wrap_ac`` wraps it as torchtitan's AC modes do (validation/titan.py ``build_block``: the same sdpa stand-in for
FlexAttention, in SelectiveAC's save list).  ``balanced``: torchtitan's own ``_debug_force_load_balance`` router
option (round-robin experts: every expert gets s b k / E tokens), so the routing-dependent sizes are exact; without
it the routing follows the random weights (``measure_moe(..., balanced=False)``).

``measure_moe`` runs it on one process (ep = 1: torchtitan's AllToAllTokenDispatcher falls back to its local
reorder); ``measure_moe_ep`` on ``ep`` processes over gloo, each holding its E / ep experts' rows of the expert
weights (as EP's Shard(0) leaves them) with the dispatcher wired to the ep mesh (``wire_meshes``), the all-to-alls
through torch's functional ``all_to_all_single`` (torchtitan's ``partial_dtensor`` SPMD backend; its default
``spmd_types`` backend runs the same exchanges through spmd_types' all_to_all, which needs the SPMD mesh set up by
its trainer).  What a layer keeps is read off live storages (validation/titan.py ``kept_storages``).

``measure_moe_tp`` runs torchtitan's own ``parallelize_qwen3`` with ``tensor_parallel_degree`` (and
``expert_parallel_degree``) on gloo ranks, measured as validation/titan.py ``tp_rank`` measures Llama 3 (one
substitution: torchtitan's debug balanced routing made to run on DTensors, ``balanced_on_dtensors``);
``measure_moe_cp`` runs the block with FlexAttention under torchtitan's ``apply_cp_to_forward`` on one rank of a fake
cp group (validation/titan_cp.py).

CPU differs from CUDA in one place: the router's ``torch.autocast(dtype=float32)`` is disabled on CPU (CPU autocast
supports bf16 / fp16 only), so the gate runs in bf16 there; on CUDA it runs in fp32 (memplan/inventory/titan_moe.py:
derived).
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import dataclass

import torch

from validation.ranks import sum_reductions
from validation.titan import AC_MODES, kept_storages, local_tensor, selective_ac, storage_bytes, trace_kept


@dataclass(frozen=True)
class MoeShape:
    """A Qwen3 MoE layer's sizes: h, heads a, KV heads g, head dim d, expert FFN fe, experts E, top-k k."""
    h: int = 64
    a: int = 4
    g: int = 2
    d: int = 16
    fe: int = 32
    E: int = 8
    k: int = 2


def build_moe_block(shape: MoeShape, balanced: bool = True, flex: bool = False) -> torch.nn.Module:
    """One torchtitan Qwen3 MoE decoder layer (bf16); ``wrap_ac`` wraps it as torchtitan's AC modes do; ``flex``:
    its FlexAttention kept (validation/titan_cp.py swaps its kernel), else the sdpa stand-in."""
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers

    cfg = _build_qwen3_moe_layers(n_layers=1, dim=shape.h, n_heads=shape.a, n_kv_heads=shape.g, head_dim=shape.d,
                                  moe_hidden_dim=shape.fe, num_experts=shape.E, top_k=shape.k, attn_backend="flex",
                                  moe_comm_backend="standard",
                                  rope=CosSinRoPE.Config(dim=shape.d, max_seq_len=1024, theta=1000000.0))[0]
    if not flex:
        cfg.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.moe.router._debug_force_load_balance = balanced
    block = cfg.build()
    for p in list(block.parameters()):
        p.data = p.data.to(torch.bfloat16)
    return block


def wrap_ac(block, ac: str, save_also: tuple = ()):
    """``block`` as torchtitan's AC mode ``ac`` wraps it (validation/titan.py build_block's way): SelectiveAC with its
    shipped default config (validation/titan.py ``selective_ac``: the router gate ``moe.router.gate`` recomputed and
    not counted in the every-other-matmul rule), ``save_also`` (ops) added to its save list."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if ac not in AC_MODES:
        raise ValueError(f"ac must be one of {AC_MODES}")
    if ac == "full":
        return FullAC(FullAC.Config())._wrap_block(block)
    if ac == "selective-op":
        return selective_ac(SelectiveAC, *save_also)._wrap_block(block)
    return block


def _run(block, ac: str, shape: MoeShape, s: int, b: int, seed: int) -> dict:
    block = wrap_ac(block, ac)
    torch.manual_seed(seed)
    x = torch.randn(b, s, shape.h, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast refuses fp32 (module docstring)
        kept, out, input_kept = kept_storages(block, x)
        out.float().square().mean().backward()
    rows = [(op, str(dtype).replace("torch.", ""), int(n)) for op, dtype, n in kept]
    return {"rows": rows, "input_kept": input_kept, "total": sum(n for _, _, n in rows)}


def measure_moe(shape: MoeShape, ac: str, s: int, b: int, balanced: bool = True, seed: int = 0) -> dict:
    """Real tensors, one process (ep = 1): the storages the layer keeps after its forward (``rows``: op, dtype,
    bytes), whether it keeps its input, their ``total``; the backward is run once."""
    torch.manual_seed(seed)
    return _run(build_moe_block(shape, balanced), ac, shape, s, b, seed)


def trace_moe(shape: MoeShape, ac: str, balanced: bool = False, s_hint: int = 64, b_hint: int = 3) -> dict:
    """The layer under FakeTensorMode with s and b symbolic (validation/titan.py ``trace_kept``): each kept storage a
    polynomial in s, b; at ep = 1 every size is static in s b (the N = k s b routed copies), the routing only the
    values (the grouped GEMMs' offsets)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_kept(lambda: wrap_ac(build_moe_block(shape, balanced), ac), shape.h, s_hint, b_hint)


def _ep_rank(rank: int, ep: int, port: int, shape: MoeShape, ac: str, s: int, b: int, balanced: bool, out: str,
             moments: bool = False):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ep)
    set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    block = build_moe_block(shape, balanced)
    experts = block.moe.routed_experts.inner_experts
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):  # the rank's E / ep experts (EP's Shard(0))
        setattr(experts, name, torch.nn.Parameter(getattr(experts, name).data.chunk(ep)[rank].clone()))
    block.moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    if moments:  # the backward's moments (validation/titan_moments.py), not the kept storages
        from validation.titan_moments import measure_block_moments
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = measure_block_moments(wrap_ac(block, ac), shape.h, s, b, seed=1 + rank)
    else:
        result = _run(block, ac, shape, s, b, seed=1 + rank)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def measure_moe_ep(shape: MoeShape, ac: str, s: int, b: int, ep: int = 2, balanced: bool = True,
                   port: int = 29541, moments: bool = False) -> list[dict]:
    """``measure_moe`` on each of ``ep`` ranks over gloo with expert parallelism (module docstring): one dict a
    rank, each rank's s b tokens its own; ``moments``: validation/titan_moments.py's measurement of the backward
    (its largest moment and every sample) in place of the kept storages."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_ep_rank, args=(ep, port, shape, ac, s, b, balanced, out, moments), nprocs=ep)
        results = []
        for r in range(ep):
            with open(f"{out}.{r}") as f:
                results.append(json.load(f))
    for r in results:
        for key in ("rows", "samples"):
            if key in r:
                r[key] = [tuple(x) for x in r[key]]
    return results


def moe_model_config(shape: MoeShape, layers: int, vocab: int):
    """A torchtitan Qwen3Model.Config of ``layers`` MoE blocks at ``shape`` (the sdpa inner attention, torchtitan's
    balanced routing), built fp32 as torchtitan builds it before FSDP's mixed precision."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    blocks = _build_qwen3_moe_layers(n_layers=layers, dim=shape.h, n_heads=shape.a, n_kv_heads=shape.g,
                                     head_dim=shape.d, moe_hidden_dim=shape.fe, num_experts=shape.E, top_k=shape.k,
                                     attn_backend="flex", moe_comm_backend="standard",
                                     rope=CosSinRoPE.Config(dim=shape.d, max_seq_len=1024, theta=1e6))
    for cfg in blocks:
        cfg.attention.inner_attention = ScaledDotProductAttention.Config()
        cfg.moe.router._debug_force_load_balance = True
    return Qwen3Model.Config(vocab_size=vocab, dim=shape.h, norm=_qwen3_norm(shape.h), layers=blocks,
                             tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=shape.h),
                             lm_head=Linear.Config(in_features=shape.h, out_features=vocab))


def ep_states_rank(rank: int, world: int, ep: int, shape: MoeShape, layers: int, vocab: int, s: int, b: int,
                   replicate: int = 1) -> dict:
    """One rank of a 1-step run of torchtitan's own ``parallelize_qwen3`` on a ``layers``-layer Qwen3 MoE model
    (its sharding config with ``enable_ep``; ``expert_parallel_degree`` = ``ep``, FSDP2 over the ``world`` ranks,
    the experts' over efsdp = world / ep; the ``partial_dtensor`` backend, mesh device "cpu" as validation/titan.py
    ``tp_model``), balanced routing, torchtitan's loss, AdamW: the per-rank fp32 ``params`` / ``grads`` / ``adam``
    bytes, layer 0's local parameter shapes, and ``running``: the bf16 unsharded parameters (their local tensors:
    with ep > 1 the experts' are DTensors on the ep mesh) alive at the end of a block's MoE in the forward, the most
    over the blocks.  What FSDP2 prefetches is not in it: on CPU a prefetched group's all-gather is copied out only
    when its block runs (torchtitan sets an explicit prefetch with ep > 1; on a GPU it runs ahead: derived)."""
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    return ep_states_run(world, ep, moe_model_config(shape, layers, vocab), set_qwen3_sharding_config,
                         parallelize_qwen3, vocab, s, b, replicate)


def ep_states_run(world: int, ep: int, config, set_sharding, parallelize, vocab: int, s: int, b: int,
                  replicate: int = 1) -> dict:
    """``ep_states_rank``'s run for any torchtitan MoE model ``config`` (built here, after ``set_sharding(config,
    enable_sp=True, enable_ep=ep > 1)``) with its ``parallelize`` function (validation/titan_dsv3.py: DeepSeek-V3's);
    ``running`` sampled at the end of each MoE block's MoE (a dense block has none)."""
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    pd.device_type = "cpu"
    torch.manual_seed(0)
    parallelism = ParallelismConfig(expert_parallel_degree=ep, data_parallel_replicate_degree=replicate,
                                    spmd_backend="partial_dtensor")  # replicate > 1: HSDP, dp_shard world / replicate
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    set_sharding(config, enable_sp=True, enable_ep=ep > 1)
    model = config.build()
    parallelize(model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                compile_config=CompileConfig(), ac_config=None, dump_folder="")
    sum_reductions(model)
    # with ep > 1 a block holds two FSDP2 parameter groups (its experts on the efsdp mesh, the rest on the dp mesh)
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in m._get_fsdp_state()._fsdp_param_groups]
    peak = {"running": 0}

    def sample(*_):
        params = [p._unsharded_param for g in groups for p in g.fsdp_params if hasattr(p, "_unsharded_param")]
        peak["running"] = max(peak["running"], storage_bytes([local_tensor(p) for p in params]))

    for block in model.layers.values():
        if getattr(block, "moe", None) is not None:
            block.moe.register_forward_hook(sample)
    tokens = torch.randint(0, vocab, (b, s))
    with warnings.catch_warnings(), dist_utils.get_spmd_context(parallel_dims=dims)():
        warnings.simplefilter("ignore")
        cross_entropy_loss(model(tokens), tokens.clone(), global_vocab_size=vocab).backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    return {"params": storage_bytes([local_tensor(p) for p in model.parameters()]),
            "grads": storage_bytes([local_tensor(p.grad) for p in model.parameters()]),
            "adam": storage_bytes([local_tensor(st[k]) for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]),
            "layer_shapes": {n: tuple(local_tensor(p).shape) for n, p in model.layers["0"].named_parameters()}, **peak}


def measure_ep_states(shape: MoeShape, ep: int = 2, world: int = 2, layers: int = 2, vocab: int = 256, s: int = 16,
                      b: int = 2, replicate: int = 1) -> list[dict]:
    """``ep_states_rank`` on ``world`` spawned ranks over gloo (``replicate`` > 1: HSDP, that many replicas)."""
    from .ranks import run_ranks
    return run_ranks(ep_states_rank, world, (ep, shape, layers, vocab, s, b, replicate))


def measure_moe_cp(shape: MoeShape, cp: int, s_local: int, b: int, ac: str = "none") -> dict:
    """The Qwen3 MoE block on one rank of a fake cp group of ``cp`` (torchtitan's apply_cp_to_forward on its
    FlexAttention: validation/titan_cp.py ``measure_cp_block``), balanced routing over the rank's s_local b tokens."""
    from validation.titan_cp import measure_cp_block

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast refuses fp32 (module docstring)
        return measure_cp_block(shape, cp, s_local, b, ac,
                                make_block=lambda: wrap_ac(build_moe_block(shape, True, flex=True), ac))


def balanced_on_dtensors(router):
    """torchtitan's ``_debug_force_load_balance_routing`` made to run under TP: its round-robin ids are a plain
    tensor, which ``gather`` refuses beside the DTensor scores (torchtitan 0.3.0 stops there with TP and its
    debug routing); here the ids are made on the rank's local scores (round-robin over its own tokens: balanced
    when k times its tokens is a multiple of E) and wrapped like the scores. The only substitution of the TP run."""
    from torch.distributed.tensor import DTensor

    def routing(scores_BLE):
        if not isinstance(scores_BLE, DTensor):
            return type(router)._debug_force_load_balance_routing(router, scores_BLE)
        local = scores_BLE.to_local()
        bs, slen, _ = local.shape
        ids = (torch.arange(bs * slen * router.top_k, dtype=torch.int64).reshape(bs, slen, router.top_k)
               % router.num_experts)
        ids = DTensor.from_local(ids, scores_BLE.device_mesh, scores_BLE.placements, run_check=False)
        return ids, scores_BLE.gather(dim=-1, index=ids)
    return routing


def tp_ep_dims(tp: int, ep: int, world: int) -> tuple:
    """torchtitan's ParallelismConfig with ``tensor_parallel_degree`` tp and ``expert_parallel_degree`` ep (the
    ``partial_dtensor`` backend) and its ParallelDims for ``world`` CPU ranks, the mesh built."""
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    pd.device_type = "cpu"
    parallelism = ParallelismConfig(tensor_parallel_degree=tp, expert_parallel_degree=ep,
                                    spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    return parallelism, dims


def moe_tp_rank(rank: int, world: int, shape: MoeShape, layers: int, vocab: int, s: int, b: int, ac: str = "none",
                tp: int = 2, ep: int = 1) -> dict:
    """One rank of a 1-step run of torchtitan's own ``parallelize_qwen3`` with ``tensor_parallel_degree`` = ``tp``
    and ``expert_parallel_degree`` = ``ep`` (the ``partial_dtensor`` backend, sequence parallelism on, its MoE
    sharding config: at ep 1 the experts' hidden dim sharded over tp and the MoE's input all-gathered, at ep > 1 the
    experts sharded over ep and the tokens staying sequence-sharded), measured as validation/titan.py ``tp_rank``
    measures Llama 3 (``tp_step``: layer 0's kept storages, the tail, the loss, the states)."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    from validation.titan import _AcShim, tp_step

    torch.manual_seed(0)
    parallelism, dims = tp_ep_dims(tp, ep, world)
    config = moe_model_config(shape, layers, vocab)
    set_qwen3_sharding_config(config, enable_sp=True, enable_ep=ep > 1)
    model = config.build()
    for block in model.layers.values():
        block.moe.router._debug_force_load_balance_routing = balanced_on_dtensors(block.moe.router)
    parallelize_qwen3(model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                      compile_config=CompileConfig(), ac_config=None if ac == "none" else _AcShim(ac), dump_folder="")
    sum_reductions(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast refuses fp32 (module docstring)
        return tp_step(model, dims, vocab, s, b)


def measure_moe_tp(shape: MoeShape, ac: str, tp: int = 2, ep: int = 1, world: int = 2, layers: int = 2,
                   vocab: int = 256, s: int = 16, b: int = 2) -> list[dict]:
    """``moe_tp_rank`` on ``world`` spawned ranks over gloo."""
    from .ranks import run_ranks
    return run_ranks(moe_tp_rank, world, (shape, layers, vocab, s, b, ac, tp, ep))


if __name__ == "__main__":
    import sys

    # python -m validation.titan_moe AC            the block at ep 1 and over 2 gloo ranks at ep 2
    # python -m validation.titan_moe tp AC EP      parallelize_qwen3 with tp 2 (and ep EP) on 2 gloo ranks
    # python -m validation.titan_moe cp AC         the block on one rank of a fake cp group of 2
    args = sys.argv[1:]
    if args[:1] == ["tp"]:
        print(json.dumps(measure_moe_tp(MoeShape(), args[1], tp=2, ep=int(args[2]))))
    elif args[:1] == ["cp"]:
        print(json.dumps(measure_moe_cp(MoeShape(), 2, 16, 2, args[1])))
    else:
        mode = args[0] if args else "none"
        print(json.dumps({"ep1": measure_moe(MoeShape(), mode, 32, 2),
                          "ep2": measure_moe_ep(MoeShape(), mode, 32, 2)}))
