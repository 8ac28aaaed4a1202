"""torchtitan 0.3.0's DeepSeek-V3 multi-token-prediction layers with tensor and expert parallelism: what one MTP layer
keeps per rank, and the parameters per rank, under torchtitan's own ``parallelize_deepseekv3`` over gloo.

``mtp_rank`` builds the 2-layer DeepSeek-V3 of validation/titan_dsv3.py (``dsv3_model_config``: a dense layer, an MoE
layer) twice, with 0 and with 1 MTP layer (torchtitan's ``_build_mtp_layers``), sets
``set_deepseek_v3_sharding_config`` (sequence parallelism on; its ``_set_deepseek_v3_mtp_sharding`` lays out the MTP
layer: the block as a decoder layer's, enorm / hnorm / eh_proj on the sequence shard, eh_proj's weight replicated, the
valid mask redistributed to the sequence shard, mtp_norm's output all-gathered for the LM head), runs
``parallelize_deepseekv3`` with ``tensor_parallel_degree`` tp and ``expert_parallel_degree`` ep (FSDP2 over the rest of
the world; torchtitan's ``apply_fsdp_to_mtp_decoder`` shards the MTP layer as a decoder layer), then one training step
as torchtitan's Trainer runs it: the dataloader's positions passed to the model, MTPLoss (``cross_entropy_loss``
without MTP layers; loss parallel under TP: ``global_vocab_size``), AdamW.

Measured per rank: every tensor autograd saves from the forward through the loss (``saved_tensors_hooks``), each
storage once by its local tensor (a DTensor's shard), the parameters apart (the sharded ones and FSDP2's unsharded
ones alike); the bytes of those storages as a multiset, so that the MTP layer's own storages are the difference of the
two runs (the main model's storages the same in both).  And the fp32 ``params`` / ``grads`` / ``adam`` bytes after the
step.  The substitutions are validation/titan_dsv3_tp.py's: the FlexAttention stand-in, the balanced routing made to
run on DTensors, the mesh's device type "cpu"."""

from __future__ import annotations

import gc
import warnings

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from validation.ranks import sum_reductions
from validation.titan import loader_positions, local_tensor, storage_bytes
from validation.titan_dsv3 import DsvShape, dsv3_model_config
from validation.titan_moe import balanced_on_dtensors, tp_ep_dims


class _Saved:
    """saved_tensors_hooks noting each saved storage once (its local tensor's: dtype, bytes, local shape), parameters
    apart (``params()``: the storages of every parameter now, FSDP2's unsharded ones included while they exist);
    ``rows()`` those still alive (a node on a branch the loss does not reach, e.g. the router's group top-k under the
    debug routing, is freed with its saved tensors)."""

    def __init__(self, params) -> None:
        self.params = params
        self.made: dict = {}

    def pack(self, t):
        st = local_tensor(t).untyped_storage()
        key = StorageWeakRef(st)
        if key not in self.made and key not in self.params():
            self.made[key] = (str(t.dtype).replace("torch.", ""), st.nbytes(), tuple(local_tensor(t).shape))
        return t

    @staticmethod
    def unpack(t):
        return t

    def rows(self) -> list[tuple[str, int, tuple]]:
        gc.collect()
        return sorted(v for k, v in self.made.items() if not k.expired())


def _param_storages(model):
    fsdp = [p for m in model.modules() if hasattr(m, "_get_fsdp_state")
            for g in m._get_fsdp_state()._fsdp_param_groups for p in g.fsdp_params]

    def now():
        ts = [*model.parameters(), *model.buffers()]
        ts += [p._unsharded_param for p in fsdp if getattr(p, "_unsharded_param", None) is not None]
        ts += [t for p in fsdp for t in getattr(p, "all_gather_outputs", [])]
        return {StorageWeakRef(local_tensor(t).untyped_storage()) for t in ts}
    return now


def _mtp_step(world: int, shape: DsvShape, vocab: int, s: int, b: int, tp: int, ep: int, mtp: int, ac: str) -> dict:
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.deepseek_v3 import MTPLoss, parallelize_deepseekv3
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    from validation.titan_dsv3_tp import _DsvAc

    torch.manual_seed(0)
    parallelism, dims = tp_ep_dims(tp, ep, world)
    config = dsv3_model_config(shape, vocab, mtp=mtp)
    set_deepseek_v3_sharding_config(config, enable_sp=True, enable_ep=ep > 1)
    model = config.build()
    for block in [*model.layers.values(), *(model.mtp_layers or [])]:
        if block.moe_enabled:
            block.moe.router._debug_force_load_balance_routing = balanced_on_dtensors(block.moe.router)
    parallelize_deepseekv3(model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                           compile_config=CompileConfig(), ac_config=None if ac == "none" else _DsvAc(ac),
                           dump_folder="")
    sum_reductions(model)
    saved = _Saved(_param_storages(model))
    tokens = torch.randint(0, vocab, (b, s))
    with warnings.catch_warnings(), dist_utils.get_spmd_context(parallel_dims=dims)():
        warnings.simplefilter("ignore")  # CPU autocast refuses fp32 (validation/titan_moe.py)
        labels, positions = tokens.clone(), loader_positions(b, s)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            pred = model(tokens, positions=positions)
            if mtp:
                loss = MTPLoss(MTPLoss.Config(global_vocab_size=vocab))(pred, labels, positions=positions)[0]
            else:
                loss = cross_entropy_loss(pred, labels, global_vocab_size=vocab)
        del pred
        kept = saved.rows()
        loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    return {"saved": kept, "params": storage_bytes([local_tensor(p) for p in model.parameters()]),
            "grads": storage_bytes([local_tensor(p.grad) for p in model.parameters()]),
            "adam": storage_bytes([local_tensor(st[k]) for st in opt.state.values()
                                   for k in ("exp_avg", "exp_avg_sq")])}


def mtp_rank(rank: int, world: int, shape: DsvShape, vocab: int, s: int, b: int, tp: int, ep: int,
             ac: str = "none") -> dict:
    """One rank (module docstring): ``saved`` the MTP layer's saved storages (dtype, bytes; the run with one MTP layer
    less the run without), ``params`` / ``grads`` / ``adam`` the run with one MTP layer's, ``*_without`` the other's;
    ``ac`` torchtitan's AC mode of the decoder layers (its AC wraps model.layers only, not the MTP layers)."""
    from collections import Counter

    without, with_ = (_mtp_step(world, shape, vocab, s, b, tp, ep, n, ac) for n in (0, 1))
    extra, missing = (Counter(a["saved"]) - Counter(b["saved"]) for a, b in ((with_, without), (without, with_)))
    return {"saved": sorted(extra.elements()), "missing": sorted(missing.elements()),
            **{k: with_[k] for k in ("params", "grads", "adam")},
            **{f"{k}_without": without[k] for k in ("params", "grads", "adam")}}


def measure_mtp(shape: DsvShape, tp: int, ep: int, world: int = 2, vocab: int = 256, s: int = 16,
                b: int = 2, ac: str = "none") -> list[dict]:
    """``mtp_rank`` on ``world`` spawned ranks over gloo."""
    from .ranks import run_ranks
    return run_ranks(mtp_rank, world, (shape, vocab, s, b, tp, ep, ac))


if __name__ == "__main__":
    import json
    import sys

    from validation.titan_dsv3_tp import SHAPE

    # python -m validation.titan_mtp TP EP [AC]      one MTP layer under parallelize_deepseekv3 on 2 gloo ranks
    print(json.dumps(measure_mtp(SHAPE, int(sys.argv[1]), int(sys.argv[2]), ac=(sys.argv[3:] or ["none"])[0])))
