"""The symmetric-memory workspace torchtitan's async TP asks for, traced from torch 2.13's own fused ops on CPU.

Async TP (memplan/inventory/titan_async_tp.py) runs inductor's ``symm_mem.fused_all_gather_matmul`` and
``symm_mem.fused_matmul_reduce_scatter``; both ask ``get_symm_mem_workspace(group_name, min_size)`` for the bytes they
stage their chunks in, before any CUDA work. Here the real implementations
(torch/distributed/_symmetric_memory/__init__.py `_fused_all_gather_matmul_impl`, `_fused_matmul_reduce_scatter_impl`)
run on meta tensors with torch's process-group look-ups answered for a TP group of t ranks and
``get_symm_mem_workspace`` replaced by a recorder that stops the op at its request: what each op asks for, in bytes,
at torchtitan's TP shapes (SP's sequence-sharded (b, s / t, h) norm output gathered on dim 1, the row-parallel
(b, s, n / t) input reduce-scattered on dim 1). Allocation outside the caching allocator (``empty_strided_p2p``) needs
CUDA: read from the code, not run here."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed._symmetric_memory as symm


class _Asked(Exception):
    """Raised by the recorder: the op stops at its workspace request."""


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def workspace_requests(s: int, b: int, h: int, n: int, t: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes each fused op asks get_symm_mem_workspace for on a TP group of t: "all_gather_matmul" (the sharded
    (b, s / t, h) input times a column-parallel (h, n / t) weight), "matmul_reduce_scatter" (the (b, s, n / t) input
    times a row-parallel (n / t, h) weight, scattered over the sequence)."""
    asked: dict[str, int] = {}
    op = ""

    def record(group_name: str, min_size: int) -> None:
        asked[op] = min_size
        raise _Asked

    meta = dict(dtype=dtype, device="meta")
    with mock.patch.object(symm, "get_symm_mem_workspace", record), \
            mock.patch.object(symm.c10d, "_resolve_process_group", lambda name: _Group(t)), \
            mock.patch.object(symm.c10d, "_get_group_size_by_name", lambda name: t):
        op = "all_gather_matmul"
        try:
            symm._fused_all_gather_matmul_impl(torch.ops.aten.mm.out, torch.empty(b, s // t, h, **meta),
                                               [torch.empty(h, n // t, **meta)], None, [{}], [None], 1, "tp", False)
        except _Asked:
            pass
        op = "matmul_reduce_scatter"
        try:
            symm._fused_matmul_reduce_scatter_impl(torch.ops.aten.mm.out, torch.empty(b, s, n // t, **meta),
                                                   torch.empty(n // t, h, **meta), {}, None, "sum", 1, "tp")
        except _Asked:
            pass
    return asked
