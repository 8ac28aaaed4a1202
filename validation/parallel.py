"""Megatron-style tensor and sequence parallelism, small enough to read.

Communication goes through a ``Comm``:

* ``DistComm``: real ``torch.distributed`` collectives (gloo on CPU, NCCL on CUDA), one process
  per rank;
* ``SimulatedComm``: one process pretends to be rank ``rank`` of ``world``.  Collectives allocate
  exactly what the real ones allocate but move no data.  Used under FakeTensorMode, where real
  collectives cannot run, to build the per-rank layer at paper scale.

The autograd Functions follow ``megatron/core/tensor_parallel/mappings.py`` and ``layers.py``:
f / f-bar (copy / all-reduce), g / g-bar (all-gather / reduce-scatter along the sequence, dim 0 of
the [s, b, h] layout), and ``LinearWithSequenceParallel``, which like Megatron's
``LinearWithGradAccumulationAndAsyncCommunication`` saves the *sequence-split* input and
re-gathers it in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .tags import tag

# ---------------------------------------------------------------------------------------------
# communicators


class Comm:
    rank: int = 0
    world: int = 1

    def all_reduce_(self, x: torch.Tensor, op: str = "sum") -> None:  # in place
        raise NotImplementedError

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:  # along dim 0
        raise NotImplementedError

    def reduce_scatter_into(self, out: torch.Tensor, x: torch.Tensor) -> None:  # along dim 0
        raise NotImplementedError


class DistComm(Comm):
    """Collectives of the default torch.distributed process group."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # torch 2.13 deprecates the *_tensor spellings in favour of *_single
        self._ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_reduce_(self, x, op="sum"):
        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)

    def all_gather_into(self, out, x):
        self._ag(out, x.contiguous(), group=self.group)

    def reduce_scatter_into(self, out, x):
        self._rs(out, x.contiguous(), group=self.group)


class SimulatedComm(Comm):
    """Rank ``rank`` of ``world`` without any peer: same allocations, no data movement.

    The output buffers are allocated by the callers exactly as for ``DistComm``; here they are
    filled from the local tensor (values are meaningless, shapes and bytes are right).
    """

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def all_reduce_(self, x, op="sum"):
        pass

    def all_gather_into(self, out, x):
        n = x.shape[0]
        for r in range(self.world):
            out.narrow(0, r * n, n).copy_(x)

    def reduce_scatter_into(self, out, x):
        n = out.shape[0]
        out.copy_(x.narrow(0, self.rank * n, n))


def _gather_seq(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * comm.world,) + tuple(x.shape[1:]))
    comm.all_gather_into(out, x)
    return out


def _reduce_scatter_seq(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] % comm.world:
        raise ValueError(f"sequence {x.shape[0]} not divisible by t={comm.world}")
    out = x.new_empty((x.shape[0] // comm.world,) + tuple(x.shape[1:]))
    comm.reduce_scatter_into(out, x)
    return out


def _split_seq(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0] // comm.world
    return x.narrow(0, comm.rank * n, n).contiguous()


# ---------------------------------------------------------------------------------------------
# Megatron mappings (mappings.py).  None of them saves a tensor for backward.


class CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        ctx.comm.all_reduce_(g)
        return g, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """f-bar: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.mark_dirty(x)
        comm.all_reduce_(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Split along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split_seq(comm, x)

    @staticmethod
    def backward(ctx, g):
        return _gather_seq(ctx.comm, g), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """g-bar: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_seq(comm, x)

    @staticmethod
    def backward(ctx, g):
        return _gather_seq(ctx.comm, g), None


class LinearWithSequenceParallel(torch.autograd.Function):
    """g + column-parallel linear: all-gather the sequence-split input, then ``x W^T (+ b)``.

    Saves the *split* input and the weight; backward re-gathers the input for the weight
    gradient and reduce-scatters the input gradient (Megatron's
    LinearWithGradAccumulationAndAsyncCommunication with sequence_parallel=True).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        total = _gather_seq(comm, x)
        out = torch.matmul(total, weight.t())
        if bias is not None:
            out = out + bias
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        comm = ctx.comm
        total = _gather_seq(comm, x)
        grad_total = g.matmul(weight)
        grad_x = _reduce_scatter_seq(comm, grad_total)
        g2 = g.reshape(-1, g.shape[-1])
        grad_w = g2.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


# ---------------------------------------------------------------------------------------------
# layers


def _init_(w: torch.Tensor, std: float = 0.02) -> torch.Tensor:
    with torch.no_grad():
        return w.normal_(0.0, std)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T with A split by rows (output features) over t ranks."""

    def __init__(self, n_in, n_out, comm: Comm, sp: bool, bias=True, dtype=None, device=None):
        super().__init__()
        if n_out % comm.world:
            raise ValueError(f"{n_out} output features not divisible by t={comm.world}")
        self.comm, self.sp = comm, sp
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(_init_(torch.empty(n_out // comm.world, n_in, **kw)))
        self.bias = nn.Parameter(torch.zeros(n_out // comm.world, **kw)) if bias else None

    def forward(self, x):
        if self.comm.world > 1 and self.sp:
            return LinearWithSequenceParallel.apply(x, self.weight, self.bias, self.comm)
        if self.comm.world > 1:
            x = CopyToTensorParallelRegion.apply(x, self.comm)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A^T with A split by columns (input features); sums partial outputs over t ranks.

    Without SP the sum is an all-reduce (f-bar); with SP a reduce-scatter along the sequence
    (g-bar).  The bias is added after the reduction, as in Megatron.
    """

    def __init__(self, n_in, n_out, comm: Comm, sp: bool, bias=True, dtype=None, device=None):
        super().__init__()
        if n_in % comm.world:
            raise ValueError(f"{n_in} input features not divisible by t={comm.world}")
        self.comm, self.sp = comm, sp
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(_init_(torch.empty(n_out, n_in // comm.world, **kw)))
        self.bias = nn.Parameter(torch.zeros(n_out, **kw)) if bias else None

    def forward(self, x):
        out = F.linear(x, self.weight)
        if self.comm.world > 1:
            if self.sp:
                out = ReduceScatterToSequenceParallelRegion.apply(out, self.comm)
            else:
                out = ReduceFromTensorParallelRegion.apply(out, self.comm)
        if self.bias is not None:
            out = out + self.bias
        return out


class VocabParallelEmbedding(nn.Module):
    """Word embedding with the vocabulary split over t ranks (Megatron's VocabParallelEmbedding).

    Input [b, s] int64, output [b, s, h], all-reduced over the ranks.
    """

    def __init__(self, v, h, comm: Comm, dtype=None, device=None):
        super().__init__()
        if v % comm.world:
            raise ValueError(f"vocabulary {v} not divisible by t={comm.world}")
        self.comm = comm
        self.v_local = v // comm.world
        self.start = comm.rank * self.v_local
        self.weight = nn.Parameter(_init_(torch.empty(self.v_local, h, dtype=dtype, device=device)))

    def forward(self, ids):
        if self.comm.world == 1:
            return F.embedding(tag(ids, "token_ids"), self.weight)
        input_mask = (ids < self.start) | (ids >= self.start + self.v_local)
        masked = ids.clone() - self.start
        masked[input_mask] = 0
        out = F.embedding(tag(masked, "token_ids"), self.weight)
        out[tag(input_mask, "embedding_input_mask"), :] = 0.0
        return ReduceFromTensorParallelRegion.apply(out, self.comm)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's _VocabParallelCrossEntropy (cross_entropy.py), used for every t as Megatron does.

    Input: fp32 logits [s, b, v/t], targets [s, b] int64.  Saves the softmax (computed in place
    in the fp32 logits' buffer), the out-of-shard target mask and the shard-local targets.
    """

    @staticmethod
    def forward(ctx, logits, target, comm, v_start):
        v_local = logits.shape[-1]
        logits_max = torch.max(logits, dim=-1)[0]
        comm.all_reduce_(logits_max, op="max")
        logits = logits - logits_max.unsqueeze(-1)
        target_mask = (target < v_start) | (target >= v_start + v_local)
        masked_target = target.clone() - v_start
        masked_target[target_mask] = 0
        logits_2d = logits.view(-1, v_local)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(logits_2d.shape[0], device=logits.device)
        predicted = logits_2d[arange_1d, masked_target_1d].clone().contiguous().view_as(target)
        predicted[target_mask] = 0.0
        comm.all_reduce_(predicted)
        exp_logits = torch.exp(logits, out=logits)
        sum_exp = exp_logits.sum(dim=-1)
        comm.all_reduce_(sum_exp)
        loss = torch.log(sum_exp) - predicted
        exp_logits.div_(sum_exp.unsqueeze(-1))
        tag(exp_logits, "logits_fp32")
        tag(target_mask, "target_mask")
        tag(masked_target_1d, "target_ids")
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        v_local = softmax.shape[-1]
        grad_2d = softmax.view(-1, v_local)
        arange_1d = torch.arange(grad_2d.shape[0], device=grad_2d.device)
        grad_2d[arange_1d, masked_target_1d] -= 1.0 - target_mask.view(-1).float()
        softmax.mul_(g.unsqueeze(-1))
        return softmax, None, None, None
