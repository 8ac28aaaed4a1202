"""torchtitan 0.3.0's context parallelism on one Llama 3 layer: what the layer keeps on one cp rank, measured.

torchtitan's Llama 3 attends with FlexAttention (``attn_backend="flex"``, the shipped default); with
``context_parallel_degree`` C > 1, ``parallelize_llama`` calls ``apply_cp_to_forward``, which wraps the inner
attention's forward: K and V are made contiguous and all-gathered over the cp group (``cplib::flex_cp_allgather``,
torch's _context_parallel/_cp_custom_ops.py) and FlexAttention runs the rank's s/C queries against the whole
sequence's keys.  ``measure_cp_block`` runs torchtitan's own block and its own ``apply_cp_to_forward`` on one
process: rank 0 of a process group of C ranks on torch's fake backend (``FakeStore``: collectives return tensors of
the right shape, no peers; what is kept depends on shapes only), the storages read off as validation/titan.py does
(``kept_storages``).

One substitution, as in validation/titan.py: FlexAttention has no backward on CPU, so its kernel
(``FlexAttention._compiled_flex_attn``, patched for the call only) is replaced by the CPU sdpa kernel on the same
q, k, v (non-causal: the query and key lengths differ; the mask changes no size), which keeps q, k, v, out and the
fp32 log-sum-exp as FlexAttention's autograd op does.  The wrapper, the all-gather and the block are torchtitan's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .titan import Shape, build_block, kept_storages


@contextlib.contextmanager
def _flex_as_cpu_sdpa(kernel=None):
    """FlexAttention's kernel replaced by the CPU sdpa kernel on the same q, k, v (module docstring), or by
    ``kernel`` (its signature and (out, aux) result: validation/titan_dsv3_tp.py's stand-in)."""
    from torchtitan.models.common.attention import FlexAttention

    def sdpa(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None,
               kernel_options=None):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa), None

    old = FlexAttention.__dict__["_compiled_flex_attn"]
    FlexAttention._compiled_flex_attn = staticmethod(kernel or sdpa)
    try:
        yield
    finally:
        FlexAttention._compiled_flex_attn = old


@contextlib.contextmanager
def _fake_group(world: int):
    """Rank 0 of a ``world``-rank process group on torch's fake backend (no peers, collectives shaped right)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group exists already in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure_cp_block(shape: Shape, cp: int, s_local: int, b: int, ac: str = "none", seed: int = 0,
                     make_block=None, kernel=None) -> dict:
    """torchtitan's Llama 3 block (bf16, FlexAttention, wrapped for AC mode ``ac`` as validation/titan.py's
    build_block wraps it) on one rank of a cp group of ``cp`` holding ``s_local`` tokens of each of ``b`` sequences
    (the whole sequence cp s_local); cp = 1: the block alone.  ``rows``: (op, dtype, bytes) of the storages the
    layer keeps after its forward (its input and output apart), ``total`` their bytes, ``input_kept`` whether it
    keeps its input; the backward is run once (the block works).  ``make_block``: another torchtitan block with
    FlexAttention, built and AC-wrapped by it (validation/titan_moe.py ``measure_moe_cp``: Qwen3 MoE's); ``kernel``:
    another stand-in for FlexAttention's (``_flex_as_cpu_sdpa``).  The block gets the rank's own (b, s_local)
    positions (``kept_storages``), as torchtitan's ``prepare_context_parallel_input`` shards them with the tokens."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.distributed.context_parallel import apply_cp_to_forward
    from torchtitan.models.common.attention import FlexAttention

    torch.manual_seed(seed)
    with _fake_group(cp), _flex_as_cpu_sdpa(kernel):
        block = make_block() if make_block else build_block(shape, ac, flex=True)
        if cp > 1:  # as parallelize_llama does, on the cp mesh (it patches the module's forward: order-free)
            inner = [m for m in block.modules() if isinstance(m, FlexAttention)]
            apply_cp_to_forward(inner, init_device_mesh("cpu", (cp,)))
        mask = create_block_mask(lambda b_, h_, q, kv: q >= kv, None, None, s_local, s_local * cp, device="cpu")
        x0 = torch.randn(b, s_local, shape.h, dtype=torch.bfloat16, requires_grad=True)
        kept, out, input_kept = kept_storages(block, x0, mask)
        rows = [(op, str(dtype).replace("torch.", ""), int(n)) for op, dtype, n in kept]
        out.float().square().mean().backward()
    return {"rows": rows, "total": sum(n for _, _, n in rows), "input_kept": input_kept}
