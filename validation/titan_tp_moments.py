"""torchtitan 0.3.0's Llama 3 decoder layer's backward moments on one rank of a TP group and of a CP group, measured
over gloo (validation/titan_moments.py's harness: every storage the block made that is alive after each op of its
backward, its bf16 weight gradients included, per rank).

* ``tp_moments_rank``: a 1-layer torchtitan Llama3Model with torchtitan's sharding configs (validation/titan.py
  ``build_model``, sequence parallelism on), its parameters cast to bf16 (FSDP2's MixedPrecisionPolicy's param dtype),
  then ``parallelize_llama``'s TP and AC steps (``model.parallelize(parallel_dims)``: the ``partial_dtensor`` backend,
  DTensor TP; ``ActivationCheckpointing.apply`` through validation/titan.py's ``_AcShim``).  Its FSDP2 call is left
  out (a size-1 mesh at tp = world: nothing reduce-scattered; FSDP2's moments are measured in a whole step,
  validation/titan_step.py).  The block is given the rank's sequence shard as a Shard(1) DTensor (as the embedding
  hands it on under SP) with the batch's global positions, and its output's gradient sequence-sharded (the layer
  above's input gradient).
* ``cp_moments_rank``: torchtitan's block with FlexAttention (validation/titan.py ``build_block(flex=True)``) and its
  own ``apply_cp_to_forward`` on a cp mesh of the world (K and V all-gathered over cp, their gradients
  reduce-scattered), FlexAttention's kernel replaced by the CPU sdpa kernel (validation/titan_cp.py
  ``_flex_as_cpu_sdpa``: FlexAttention has no CPU backward), the rank's s / cp tokens and their positions, the
  causal block mask of the rank's queries against the whole sequence.

``measure_tp_moments`` / ``measure_cp_moments`` run them on ``world`` spawned ranks (validation/ranks.py), each rank
measuring every (shape, AC mode) case in one process group.  ``python -m validation.titan_tp_moments`` prints the
figures recorded in tests/data/titan_tp_moments.json (~1 min of CPU on 2 cores).
"""

from __future__ import annotations

import json
import sys
import warnings

import torch

from .titan import AC_MODES, Shape, _AcShim, build_block, build_model
from .titan_moments import measure_block_moments

# what is recorded per case: the largest moment, the op after which, and (node, op, bytes) after every op
KEYS = ("bytes", "at", "grad_bytes", "samples")


def _tp_block(dims, shape: Shape, ac: str):
    """One torchtitan Llama 3 block, TP-parallelized and AC-wrapped as parallelize_llama does (module docstring)."""
    model = build_model(shape, 1, 256, tp_sharding=True)
    for p in list(model.parameters()):  # bf16, the buffers (RoPE's complex cache) as they are
        p.data = p.data.to(torch.bfloat16)
    model.parallelize(dims)
    if ac != "none":
        _AcShim(ac).build().apply(model)
    return model.layers["0"]


def tp_moments_rank(rank: int, world: int, cases: list, s: int, b: int, detail: bool = False) -> list[dict]:
    """On this rank of a TP group of ``world``: ``measure_block_moments`` of each (Shape, ac) case at the global
    (s, b), the rank holding s / world tokens of each sequence."""
    import torchtitan.distributed.parallel_dims as pd
    import torchtitan.models.llama3.parallelize  # noqa: F401  (registers the fake backend ParallelDims uses)
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    pd.device_type = "cpu"  # torchtitan picks CUDA when it finds no accelerator (validation/titan.py tp_model)
    parallelism = ParallelismConfig(tensor_parallel_degree=world, spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    mesh = dims.get_mesh("tp")
    out = []
    for shape, ac in cases:
        torch.manual_seed(0)
        block = _tp_block(dims, shape, ac)
        with dist_utils.get_spmd_context(parallel_dims=dims)():
            m = measure_block_moments(block, shape.h, s // world, b, detail=detail,
                                      place=lambda x: DTensor.from_local(x, mesh, [Shard(1)], run_check=False))
        out.append({k: m[k] for k in KEYS + (("rows",) if detail else ())})
    return out


def cp_moments_rank(rank: int, world: int, cases: list, s: int, b: int, detail: bool = False) -> list[dict]:
    """On this rank of a CP group of ``world``: ``measure_block_moments`` of each (Shape, ac) case, the rank's s /
    world tokens of each of b sequences of s; a MoeShape: torchtitan's Qwen3 MoE block (validation/titan_moe.py,
    balanced routing)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.distributed.context_parallel import apply_cp_to_forward
    from torchtitan.models.common.attention import FlexAttention

    from .titan_cp import _flex_as_cpu_sdpa
    from .titan_moe import MoeShape, build_moe_block, wrap_ac

    mesh = init_device_mesh("cpu", (world,))
    local = s // world
    mask = create_block_mask(lambda b_, h_, q, kv: q >= kv, None, None, local, s, device="cpu")
    out = []
    with _flex_as_cpu_sdpa(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast refuses the MoE router's fp32 (validation/titan_moe.py)
        for shape, ac in cases:
            torch.manual_seed(0)
            block = (wrap_ac(build_moe_block(shape, True, flex=True), ac) if isinstance(shape, MoeShape)
                     else build_block(shape, ac, flex=True))
            apply_cp_to_forward([m for m in block.modules() if isinstance(m, FlexAttention)], mesh)
            m = measure_block_moments(block, shape.h, local, b, mask=mask, detail=detail)
            out.append({k: m[k] for k in KEYS + (("rows",) if detail else ())})
    return out


def measure_tp_moments(cases: list, s: int = 32, b: int = 2, world: int = 2, detail: bool = False) -> list[list[dict]]:
    """``tp_moments_rank`` on ``world`` gloo ranks: per rank, one result per (Shape, ac) case (``detail``: each
    sample's live storages, ``rows``)."""
    from .ranks import run_ranks
    return run_ranks(tp_moments_rank, world, (list(cases), s, b, detail))


def measure_cp_moments(cases: list, s: int = 32, b: int = 2, world: int = 2, detail: bool = False) -> list[list[dict]]:
    """``cp_moments_rank`` on ``world`` gloo ranks: per rank, one result per (Shape, ac) case."""
    from .ranks import run_ranks
    return run_ranks(cp_moments_rank, world, (list(cases), s, b, detail))


# the shapes measured (tests/test_titan_moments.py's Llama 3 ones, the FFN wide, wider, narrow; 2 KV heads: TP 2 splits them)
SHAPES = (Shape(h=64, a=4, g=2, f=160), Shape(h=64, a=4, g=2, f=224), Shape(h=128, a=4, g=2, f=96))


def record(s: int = 32, b: int = 2) -> dict:
    """Every shape and AC mode under TP 2 and CP 2, and the Qwen3 MoE block's AC modes under CP 2 (rank 0's samples;
    each rank's largest moment)."""
    cases = [(shape, ac) for shape in SHAPES for ac in AC_MODES]
    out: dict = {"command": COMMAND, "s": s, "b": b, "world": 2, "shapes": [[x.h, x.a, x.g, x.f] for x in SHAPES]}
    for name, fn in (("tp", measure_tp_moments), ("cp", measure_cp_moments)):
        ranks = fn(cases, s, b)
        out[name] = _rows(ranks, cases)
    from .titan_moe import MoeShape  # torchtitan's Qwen3 MoE block under CP 2 (MoeShape(): h 64, E 8, top-2)
    moe = [(MoeShape(), ac) for ac in AC_MODES]
    out["cp_moe"] = _rows(measure_cp_moments(moe, s, b), moe)
    return out


def _rows(ranks: list, cases: list) -> list[dict]:
    return [{"ac": ac, "shape": k // len(AC_MODES), "bytes": [r[k]["bytes"] for r in ranks], "at": ranks[0][k]["at"],
             "samples": [list(x) for x in ranks[0][k]["samples"]]} for k, (_, ac) in enumerate(cases)]


COMMAND = "PYTHONPATH=. python -m validation.titan_tp_moments > tests/data/titan_tp_moments.json"


if __name__ == "__main__":
    json.dump(record(), sys.stdout, indent=None)
