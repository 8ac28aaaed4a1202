"""Mamba-1 mixers under the tracer (``kernels="cuda"``): mamba-ssm's and causal-conv1d's fused CUDA kernels stood in
on fake CPU tensors, saving what they save (``stand_ins``); with ``kernels="cpu"`` the trace is refused (``check``).

transformers' torch path of a Mamba-1 mixer (MambaMixer, FalconMambaMixer, JambaMambaMixer, ZambaMambaMixer:
``mamba_selective_scan``)
loops over the sequence, one step per token, which a trace with a symbolic s cannot follow.  On CUDA with mamba-ssm
and causal-conv1d installed, transformers calls their kernels instead (``use_kernel_func_from_hub_with_fallback``:
the package's function replaces the module's ``mamba_inner_fn`` / ``causal_conv1d_fn`` / ``mamba_selective_scan``).
What those keep for the backward is read off their source (github.com/state-spaces/mamba
mamba_ssm/ops/selective_scan_interface.py ``MambaInnerFn``, ``SelectiveScanFn``; csrc/selective_scan/selective_scan.cpp
``selective_scan_fwd``; github.com/Dao-AILab/causal-conv1d causal_conv1d/causal_conv1d_interface.py
``CausalConv1dFn``) and reproduced here by ``torch.autograd.Function`` s that allocate and save tensors of the same
shapes and dtypes (derived from the code, not measured: no GPU with mamba-ssm was at hand):

* ``MambaInner`` (Mamba, Falcon-Mamba: ``mamba_inner_fn``, checkpoint_lvl 1, which recomputes the convolution and
  delta in the backward) saves xz (in_proj's output [b, 2 I, s], copied contiguous: transformers passes a transposed
  view), x_dbl ([b s, R + 2 N], x_proj's output), B and C ([b, 1, N, s] contiguous copies), A (I x N fp32), D and
  delta_bias (fp32), the scan's intermediate states ``x`` ([b, I, n_chunks, 2 N] in A's dtype, fp32, n_chunks =
  ceil(s / 2048)) and the scan's output before the gate ``out`` ([b, I, s]); it returns out_proj's output.  Falcon-
  Mamba's dt / B / C RMSNorms (mamba_inner_fn's b / c / dt_rms_weight) replace B, C and delta by normed tensors of the
  same shapes: the same saves.
* ``CausalConv1d`` (Jamba, Zamba: ``causal_conv1d_fn``) saves its input x as given when one of its last two strides
  is 1 (Jamba's is a channel-last view of in_proj's output: no copy; Zamba's a contiguous copy made before) and
  returns a new [b, I, s] tensor (the SiLU inside the kernel).
* ``SelectiveScan`` (Jamba, and Zamba once per mixer head: ``selective_scan_fn`` with z) saves u, delta, B, C, z
  (each made contiguous where its last stride is not 1: Jamba's u, B, C and z are transposed views, copied), A, D,
  delta_bias, ``x`` as above and ``out``; it returns out_z, a new [b, I, s] tensor.
* The backwards allocate what the kernels' backwards allocate (the gradients of every input, the recomputed
  convolution, delta and out_z, mamba-ssm's fp32 dB / dC), so the traced transients follow them.

The scan's ``x`` holds ceil(s / 2048) chunks: the trace takes s a multiple of 2048 (``CHUNK``; trace_config's
``scan_chunk``), exact there."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import handle_torch_function, has_torch_function

CHUNK = 2048  # selective_scan_fwd: n_chunks = (seqlen + 2048 - 1) / 2048
MODEL_TYPES = ("mamba", "falcon_mamba", "jamba", "zamba")
_MODULES = {"mamba": "transformers.models.mamba.modeling_mamba",
            "falcon_mamba": "transformers.models.falcon_mamba.modeling_falcon_mamba",
            "jamba": "transformers.models.jamba.modeling_jamba", "zamba": "transformers.models.zamba.modeling_zamba"}


def check(config: dict, kernels: str) -> None:
    """Refuse a Mamba-1 model's trace with CPU kernels (ValueError, one line)."""
    if config.get("model_type") in MODEL_TYPES and kernels != "cuda":
        raise ValueError(f"{config['model_type']}: transformers' torch path of a Mamba-1 mixer loops over s, which a "
                         "symbolic trace cannot follow; its CUDA kernels' (mamba-ssm) saves are traced: --kernels cuda")


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _states(u: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """selective_scan_fwd's intermediate states: [b, I, n_chunks, 2 N] in A's dtype."""
    b, i, s = u.shape
    return torch.empty(b, i, s // CHUNK, 2 * A.shape[-1], dtype=A.dtype)


def _scan_backward(u, B, C, A, z) -> list:
    """selective_scan_bwd's allocations: du, ddelta, dA, dB and dC (fp32 for variable B / C), dD, ddelta_bias and,
    with z, dz and the recomputed out_z."""
    made = [torch.empty_like(u), torch.empty_like(u), torch.empty_like(A), torch.empty_like(B, dtype=torch.float32),
            torch.empty_like(C, dtype=torch.float32), torch.empty(u.shape[1], dtype=torch.float32),
            torch.empty(u.shape[1], dtype=torch.float32)]
    return made + ([torch.empty_like(z), torch.empty_like(u)] if z is not None else [])


class MambaInner(torch.autograd.Function):
    """mamba-ssm's MambaInnerFn (checkpoint_lvl 1) on fake tensors: its saves, shapes and dtypes."""

    @staticmethod
    def forward(ctx, xz, conv_w, conv_b, x_proj_w, dt_proj_w, out_w, out_b, A, D, delta_bias):
        xz = _contiguous(xz)
        b, two_i, s = xz.shape
        n, r = A.shape[-1], dt_proj_w.shape[1]
        x_dbl = torch.empty(b * s, r + 2 * n, dtype=xz.dtype)
        B, C = (torch.empty(b, 1, n, s, dtype=xz.dtype) for _ in range(2))
        out = torch.empty(b, two_i // 2, s, dtype=xz.dtype)
        states = _states(out, A)
        out_z = torch.empty(b, two_i // 2, s, dtype=xz.dtype)
        ctx.save_for_backward(xz, conv_w, conv_b, x_dbl, x_proj_w, dt_proj_w, out_w, A, B, C, D, delta_bias, states,
                              out)
        ctx.out_b = None if out_b is None else (out_b.shape, out_b.dtype)
        bias = None if out_b is None else out_b.to(out_w.dtype)
        return torch.nn.functional.linear(out_z.transpose(1, 2), out_w, bias)

    @staticmethod
    def backward(ctx, dout):
        xz, conv_w, conv_b, x_dbl, x_proj_w, dt_proj_w, out_w, A, B, C, D, delta_bias, states, out = ctx.saved_tensors
        conv_out, delta = torch.empty_like(out), torch.empty_like(out)  # recomputed (checkpoint_lvl 1)
        dxz = torch.empty_like(xz)
        dout_y = torch.empty_like(out)  # out_proj_weight.t() @ dout, [b, I, s]
        made = _scan_backward(out, B, C, A, None) + [torch.empty_like(out)]  # out_z recomputed
        dx_dbl = torch.empty_like(x_dbl)
        del conv_out, delta, dout_y, made, dx_dbl
        out_b = None if ctx.out_b is None else torch.zeros(*ctx.out_b)
        weights = (None if t is None else torch.zeros_like(t) for t in (conv_w, conv_b, x_proj_w, dt_proj_w, out_w))
        return (dxz, *weights, out_b, *(None if t is None else torch.zeros_like(t) for t in (A, D, delta_bias)))


class CausalConv1d(torch.autograd.Function):
    """causal-conv1d's CausalConv1dFn on fake tensors: saves x (copied only when neither of its last two strides is
    1), weight, bias; returns out like x."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        ctx.save_for_backward(x, weight, bias)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias = ctx.saved_tensors
        return torch.empty_like(x), torch.zeros_like(weight), None if bias is None else torch.zeros_like(bias)


class SelectiveScan(torch.autograd.Function):
    """mamba-ssm's SelectiveScanFn with z on fake tensors: its saves, shapes and dtypes; returns out_z."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias):
        u, delta, B, C, z = (_contiguous(t) for t in (u, delta, B, C, z))
        if B.dim() == 3:
            B, C = B.unsqueeze(1), C.unsqueeze(1)
        out = torch.empty_like(u)
        states = _states(u, A)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states, out)
        return torch.empty_like(u)

    @staticmethod
    def backward(ctx, dout):
        u, delta, A, B, C, D, z, delta_bias, states, out = ctx.saved_tensors
        du, ddelta, dA, dB, dC, dD, ddelta_bias, dz, _ = _scan_backward(u, B, C, A, z)
        return (du, ddelta, dA, dB.squeeze(1).to(B.dtype), dC.squeeze(1).to(C.dtype), dD, dz, ddelta_bias)


def _named(fn, *args):
    """``fn(*args)`` seen by the tracer's torch-function mode as one call named as the kernel (its saves' ids)."""
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    if has_torch_function(tensors):
        return handle_torch_function(fn, tensors, *args)
    return None


def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias,
                   A, B=None, C=None, D=None, delta_bias=None, delta_softplus=True, **norms):
    """mamba_ssm's mamba_inner_fn as transformers calls it (variable B and C, delta_bias, D)."""
    args = (xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, A, B, C,
            D, delta_bias)
    named = _named(mamba_inner_fn, *args)
    if named is not None:
        return named
    return MambaInner.apply(xz, conv1d_weight.squeeze(1) if conv1d_weight.dim() == 3 else conv1d_weight,
                            conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, A, D,
                            delta_bias)


def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
    named = _named(causal_conv1d_fn, x, weight, bias)
    return CausalConv1d.apply(x, weight, bias) if named is None else named


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, **kwargs):
    named = _named(selective_scan_fn, u, delta, A, B, C, D, z, delta_bias)
    return SelectiveScan.apply(u, delta, A, B, C, D, z, delta_bias) if named is None else named


@contextmanager
def stand_ins(config: dict, kernels: str):
    """The CUDA kernels' stand-ins in place of transformers' module functions while a Mamba-1 model is traced with
    CUDA kernels (nothing for other models)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES or kernels != "cuda":
        yield
        return
    import importlib

    module = importlib.import_module(_MODULES[model_type])
    swaps = ({"mamba_inner_fn": mamba_inner_fn} if model_type in ("mamba", "falcon_mamba") else
             {"causal_conv1d_fn": causal_conv1d_fn, "mamba_selective_scan": selective_scan_fn})
    before = {name: getattr(module, name) for name in swaps}
    try:
        for name, fn in swaps.items():
            setattr(module, name, fn)
        yield
    finally:
        for name, fn in before.items():
            setattr(module, name, fn)
