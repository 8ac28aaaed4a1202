"""torchtitan 0.3.0's DeepSeek-V3 with tensor parallelism and context parallelism: what its real code keeps per rank.

``dsv3_tp_rank`` runs torchtitan's own ``parallelize_deepseekv3`` with ``tensor_parallel_degree`` (and
``expert_parallel_degree``) on gloo ranks, on the 2-layer model of validation/titan_dsv3.py (``dsv3_model_config``:
a dense first layer, an MoE layer with a shared expert; the 671B flavour's q latent), its sharding configs from
``set_deepseek_v3_sharding_config`` with sequence parallelism on: the MLA's small latent projections (wq_a, wkv_a)
and their norms (q_norm, kv_norm) replicated and run on the whole sequence all-gathered at the attention's input,
the up projections (wq_b, wkv_b) colwise, wo rowwise with a reduce-scatter; the dense FFN as Llama 3's; the MoE as
``set_moe_sharding_config`` lays it out (validation/titan_moe.py ``moe_tp_rank``: at ep 1 the experts' hidden dim
over tp and the MoE's input all-gathered, at ep > 1 the experts over ep and the tokens sequence-sharded), the shared
experts colwise / rowwise over tp on their input all-gathered over the sequence at either ep.  Measured as
validation/titan.py ``tp_step`` measures Llama 3 (layer 0: the dense layer), with layer 1 (the MoE layer) read off
the same way (``layers``).  The substitutions: the inner attention the FlexAttention stand-in of
validation/titan_dsv3.py (its save set derived, inside torchtitan's own local_map), the debug balanced routing made
to run on DTensors (validation/titan_moe.py ``balanced_on_dtensors``).

``measure_dsv3_cp`` runs the MoE layer (or the dense one) with torchtitan's own FlexAttention module under
``apply_cp_to_forward`` on one rank of a fake cp group (validation/titan_cp.py ``measure_cp_block``), its kernel
the stand-in's op (``flex_saved``) on the rank's queries against the all-gathered whole-sequence K and V.
"""

from __future__ import annotations

import warnings

import torch

from validation.ranks import sum_reductions
from validation.titan import LiveLocal, local_tensor, selective_ac
from validation.titan_dsv3 import DsvShape, dsv3_layer_configs, dsv3_model_config, flex_saved, wrap_dsv3_ac
from validation.titan_moe import balanced_on_dtensors, tp_ep_dims

# tests/test_titan_dsv3.py's shape: 16 experts in torchtitan's 671B router groups (8, 4 chosen: memplan's ROUTER_GROUPS)
SHAPE = DsvShape(E=16, groups=8, limited=4)


class _DsvAc:
    """``ac_config`` for parallelize_deepseekv3 (validation/titan.py ``_AcShim`` with the stand-in's op in
    SelectiveAC's save list, where torchtitan's holds flex_attention)."""

    def __init__(self, ac: str) -> None:
        self.ac = ac

    def build(self, **_):
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        if self.ac == "full":
            return FullAC(FullAC.Config())
        return selective_ac(SelectiveAC, torch.ops.memplan_validation.flex_saved.default)


def _watch(block, norm, out: dict) -> list:
    """Hooks reading off what ``block`` keeps after its forward (its output and parameters apart) into
    ``out["moe_layer"]``, and whether it keeps its input (``out["moe_input_kept"]``, read when the final ``norm``
    starts: the decoder's loop holds the input until the block returns)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    live = LiveLocal()

    def pre(_module, args):
        out["x"] = StorageWeakRef(local_tensor(args[0]).untyped_storage())
        live.__enter__()

    def post(module, _args, output):
        live.__exit__(None, None, None)
        params = [local_tensor(t) for t in (*module.parameters(), *module.buffers())]
        out["moe_layer"] = [(op, str(dt).replace("torch.", ""), int(n)) for op, dt, n in live.alive([output, *params])]

    def at_norm(*_):
        out["moe_input_kept"] = not out.pop("x").expired()
    return [block.register_forward_pre_hook(pre), block.register_forward_hook(post),
            norm.register_forward_pre_hook(at_norm)]


def dsv3_tp_rank(rank: int, world: int, shape: DsvShape, vocab: int, s: int, b: int, ac: str = "none", tp: int = 2,
                 ep: int = 1) -> dict:
    """One rank of a 1-step run of torchtitan's own ``parallelize_deepseekv3`` (module docstring): validation/
    titan.py ``tp_step``'s figures (``layer``: the dense layer 0's kept storages, the tail, the loss, the states)
    and ``moe_layer``: the MoE layer 1's."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    from validation.titan import tp_step

    torch.manual_seed(0)
    parallelism, dims = tp_ep_dims(tp, ep, world)
    config = dsv3_model_config(shape, vocab)
    set_deepseek_v3_sharding_config(config, enable_sp=True, enable_ep=ep > 1)
    model = config.build()
    moe_block = model.layers["1"]
    moe_block.moe.router._debug_force_load_balance_routing = balanced_on_dtensors(moe_block.moe.router)
    parallelize_deepseekv3(model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                           compile_config=CompileConfig(), ac_config=None if ac == "none" else _DsvAc(ac),
                           dump_folder="")
    sum_reductions(model)
    moe_out: dict = {}
    handles = _watch(model.layers["1"], model.norm, moe_out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast refuses fp32 (validation/titan_moe.py)
        out = tp_step(model, dims, vocab, s, b)
    for h in handles:
        h.remove()
    return {**out, **moe_out}


def measure_dsv3_tp(shape: DsvShape, ac: str, tp: int = 2, ep: int = 1, world: int = 2, vocab: int = 256, s: int = 16,
                    b: int = 2) -> list[dict]:
    """``dsv3_tp_rank`` on ``world`` spawned ranks over gloo."""
    from .ranks import run_ranks
    return run_ranks(dsv3_tp_rank, world, (shape, vocab, s, b, ac, tp, ep))


def dsv3_tp_local_params(shape: DsvShape, tp: int = 2, ep: int = 1, vocab: int = 256) -> int:
    """The parameters one rank holds after torchtitan's own ``parallelize_deepseekv3`` with ``tensor_parallel_degree``
    ``tp`` (and ``expert_parallel_degree`` ``ep``) on a world of ``tp``: the model built on the meta device, rank 0 of
    a fake process group (validation/titan_cp.py ``_fake_group``: shapes only, no peers), its local shards counted
    (the latent projections Replicate, the rest as its sharding configs place them). Seconds, not a gloo run."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    from validation.titan_cp import _fake_group

    with _fake_group(tp):
        parallelism, dims = tp_ep_dims(tp, ep, tp)
        config = dsv3_model_config(shape, vocab)
        set_deepseek_v3_sharding_config(config, enable_sp=True, enable_ep=ep > 1)
        with torch.device("meta"):
            model = config.build()
        parallelize_deepseekv3(model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                               compile_config=CompileConfig(), ac_config=None, dump_folder="")
        return sum(local_tensor(p).numel() for p in model.parameters())


def _flex_kernel(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None,
                 kernel_options=None):
    """FlexAttention's kernel as the stand-in's op (validation/titan_dsv3.py ``flex_saved``: FlexAttention's save
    set) on the rank's queries and the whole sequence's keys (the causal mask of equal lengths; sizes only)."""
    out, _lse = flex_saved(q, k, v, scale)
    return out, None


def measure_dsv3_cp(shape: DsvShape, cp: int, s_local: int, b: int, ac: str = "none", moe: bool = True) -> dict:
    """torchtitan's DeepSeek-V3 layer (``moe``: the MoE one, else the dense first layer) with its FlexAttention
    under torchtitan's ``apply_cp_to_forward`` on rank 0 of a fake cp group of ``cp`` (validation/titan_cp.py
    ``measure_cp_block``), balanced routing over the rank's s_local b tokens."""
    from validation.titan_cp import measure_cp_block

    def make_block():
        cfg = dsv3_layer_configs(shape)[1 if moe else 0]
        cfg.attention.inner_attention = _flex_config()
        block = cfg.build()
        for p in list(block.parameters()):
            p.data = p.data.to(torch.bfloat16)
        return wrap_dsv3_ac(block, ac)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return measure_cp_block(shape, cp, s_local, b, ac, make_block=make_block, kernel=_flex_kernel)


def _flex_config():
    """torchtitan's FlexAttention config as its DeepSeek-V3 flavours build it (``attn_backend="flex"``)."""
    from torchtitan.models.common.config_utils import get_attention_config
    return get_attention_config("flex")


if __name__ == "__main__":
    import json
    import sys

    # python -m validation.titan_dsv3_tp tp AC EP     parallelize_deepseekv3 with tp 2 (and ep EP) on 2 gloo ranks
    # python -m validation.titan_dsv3_tp cp AC        the MoE layer on one rank of a fake cp group of 2
    args = sys.argv[1:]
    if args[:1] == ["tp"]:
        print(json.dumps(measure_dsv3_tp(SHAPE, args[1], ep=int(args[2]))))
    else:
        print(json.dumps({kind: measure_dsv3_cp(SHAPE, 2, 16, 2, args[1], moe=kind == "moe")
                          for kind in ("dense", "moe")}))
