"""torchtitan's async TP (``compile.enable_async_tensor_parallel``, `--async-tp`): what it needs and the memory it adds
outside PyTorch's caching allocator. Read from torch 2.13's code, the fused ops' requests traced from it on CPU
(validation/titan_async_tp.py); not measured on a GPU (none here).

torchtitan 0.3.0 (torchtitan/distributed/compile.py `_maybe_enable_async_tp`) enables symmetric memory for the dense TP
group and sets inductor's ``_micro_pipeline_tp``; without a TP mesh it does nothing, and its CompileConfig refuses the
flag without ``compile.enable`` and "model" in ``compile.components``. Inductor's pass
(torch/_inductor/fx_passes/micro_pipeline_tp.py) rewrites, in each compiled block's forward and backward graphs, every
all-gather feeding matmuls into ``symm_mem.fused_all_gather_matmul`` and every matmul feeding a reduce-scatter into
``symm_mem.fused_matmul_reduce_scatter``. Both stage their chunks in ONE workspace per TP group
(torch/distributed/_symmetric_memory/__init__.py `get_symm_mem_workspace`): a uint8 tensor made by
``_SymmetricMemory.empty_strided_p2p``, outside the caching allocator (not in ``memory_allocated``, in the device's
use), kept for the run and re-made at max(size, request) when a request is larger. The requests, with SP's sharded
sequence (b s / t tokens of h per rank) and A-byte activations:

- all-gather + matmul (wqkv; w1 and w3; in the backward the row-parallel wo / w2's output gradient):
  `_pipelined_multi_all_gather_and_consume` asks for the shard's bytes, A s b h / t;
- matmul + reduce-scatter (wo, w2; in the backward the column-parallel inputs' gradients, h wide):
  `_pipelined_produce_and_all2all` asks for two chunks of the stacked partials (the full b s x h output, in the
  output dtype: A bytes, bf16 also under float8's scaled variant), ``out_chunks[0].numel() * element_size() * 2``
  = 2 A s b h / t.

So the workspace settles at 2 A s b h / t bytes per GPU (`WORKSPACE_CHUNKS` chunks of the rank's share of a layer's
output); the LM head is not in a compiled block (torchtitan compiles the decoder blocks), so it asks nothing. Not
counted: the moment the workspace grows (the first reduce-scatter's request while the all-gather's smaller one is
still referenced: 3 A s b h / t for an instant, in the first layer's forward, far from the step's peak)."""

from __future__ import annotations

from typing import Any

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec

# _pipelined_produce_and_all2all's request: two output chunks (p2p_workspace_size_req = chunk bytes x 2)
WORKSPACE_CHUNKS = 2

SOURCE = ("the fused ops' requests traced from torch 2.13's own code on CPU (validation/titan_async_tp.py), the "
          "workspace outside the pool read from torch/distributed/_symmetric_memory (get_symm_mem_workspace), not "
          "measured on a GPU")


def workspace_per_sequence(model: ModelSpec, activation_bytes: int) -> int:
    """The workspace's bytes for one sequence before the TP split: WORKSPACE_CHUNKS x A s h (device_memory divides
    b times it by t)."""
    return WORKSPACE_CHUNKS * activation_bytes * model.seq_length * model.hidden_size


def workspace_bytes(per_sequence: int, b: Any, t: Any) -> Any:
    """The symmetric-memory workspace of a plan (scalars or arrays): per_sequence x b / t where t > 1, else 0
    (torchtitan enables nothing without a TP mesh)."""
    return (per_sequence * b // t) * (t > 1)


def notes(async_tp: bool, workspace: int) -> list[str]:
    """What an estimate says about async TP (``workspace``: the plan's symmetric-memory workspace, bytes)."""
    if not async_tp:
        return []
    return [f"async TP (compile.enable_async_tensor_parallel): its symmetric-memory workspace, {workspace:,} B = 2 A s b "
            f"h / t, counted outside the caching allocator (not in the allocated peak, not replayed), {SOURCE}; "
            "each layer's TP collectives overlapped with the matmuls inductor fuses them with, only what the matmuls "
            "cannot hide charged (memplan/timing/layer.py async_tp_exposed): derived, uncalibrated"]


def check_async_tp(async_tp: bool, impl: str, compiled: bool, tp: int) -> None:
    """--async-tp where torchtitan runs it: --impl torchtitan, --compile (its CompileConfig's refusal), --tp > 1 (with
    no TP mesh `_maybe_enable_async_tp` returns without doing anything); one line otherwise."""
    if not async_tp:
        return
    if impl != "torchtitan":
        raise MemplanError("--async-tp is torchtitan's compile.enable_async_tensor_parallel: give --impl torchtitan")
    if not compiled:
        raise MemplanError("--async-tp needs --compile: torchtitan's CompileConfig refuses it with \"Async TP "
                           "requires 'model' in --compile.components and --compile.enable\"")
    if tp < 2:
        raise MemplanError("--async-tp needs --tp 2 or more: without a TP mesh torchtitan's _maybe_enable_async_tp "
                           "does nothing")
