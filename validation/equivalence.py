"""Self-check of the harness: the tensor / sequence-parallel layer computes the same function as
the single-rank layer (forward output, input gradient and every weight gradient), in float64,
dropout off, with real gloo processes.  If this fails, the measured per-rank memory would be the
memory of some other computation.
"""

from __future__ import annotations

import torch

from .layers import GPTLayer, LayerConfig, causal_mask
from .parallel import DistComm, SimulatedComm
from .ranks import run_ranks

VARIANTS = tuple((sp, rc) for sp in (False, True) for rc in ("none", "selective", "full"))


def _check(rank: int, t: int, sp: bool, rc: str, s=32, b=2, h=64, a=4, f=128) -> bool:
    dt = torch.float64
    torch.manual_seed(0)
    full = GPTLayer(LayerConfig(h=h, a=a, f=f, p_drop=0.0), SimulatedComm(0, 1), dtype=dt)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_()
    comm = DistComm()
    par = GPTLayer(LayerConfig(h=h, a=a, f=f, sp=sp, recompute=rc, p_drop=0.0), comm, dtype=dt)
    ref = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in par.named_parameters():
            q = ref[name]
            if p.shape != q.shape:
                dim = next(i for i in range(p.dim()) if p.shape[i] != q.shape[i])
                q = q.narrow(dim, rank * p.shape[dim], p.shape[dim])
            p.copy_(q)
    mask = causal_mask(s)
    x = torch.randn(s, b, h, dtype=dt, requires_grad=True)
    y = full(x, mask)
    g = torch.randn_like(y)
    y.backward(g)
    n = s // t
    local = (lambda z: z[rank * n:(rank + 1) * n]) if sp else (lambda z: z)
    xl = local(x.detach()).clone().requires_grad_()
    yl = par(xl, mask)
    yl.backward(local(g))
    ok = torch.allclose(yl, local(y.detach())) and torch.allclose(xl.grad, local(x.grad))
    for name, p in par.named_parameters():
        q = ref[name]
        grad = p.grad.clone()
        if p.shape != q.shape:
            dim = next(i for i in range(p.dim()) if p.shape[i] != q.shape[i])
            want = q.grad.narrow(dim, rank * p.shape[dim], p.shape[dim])
        else:
            want = q.grad
            if sp:  # replicated weights see only this rank's sequence chunk (Megatron all-reduces)
                comm.all_reduce_(grad)
        ok = ok and torch.allclose(grad, want)
    return bool(ok)


def _check_rank(rank: int, t: int) -> dict[tuple[bool, str], bool]:
    """Run by ``ranks.run_ranks`` in rank ``rank``'s process, inside the gloo process group."""
    return {v: _check(rank, t, *v) for v in VARIANTS}


def check_tensor_parallel_equivalence(t: int = 2) -> dict[tuple[bool, str], bool]:
    """{(sp, recompute): all ranks match the single-rank layer}."""
    per_rank = run_ranks(_check_rank, t)
    return {v: all(res[v] for res in per_rank) for v in VARIANTS}
