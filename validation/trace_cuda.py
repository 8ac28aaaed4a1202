"""What torch's CUDA kernels save, emulated on fake CPU tensors for ``kernels="cuda"`` (``CudaKernels``): dropout's
bool mask, torch's choice of sdpa kernel (its default order on an H100: ``SDPA_ORDER``) with what each keeps, layer
norm's fp32 statistics. Checked against an H100's saved bytes (validation/cuda_dropout.py)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from .trace_poly import sym_expr

# torch's default sdpa priority on sm90 (H100) with cuDNN > 9.15.0 (torch 2.11 + cuDNN 9.19 measured): CudaKernels
SDPA_ORDER = ("cudnn", "flash", "efficient", "math")


class CudaKernels:
    """What torch's CUDA kernels save, emulated on fake CPU tensors (``kernels="cuda"``).

    Read off torch's C++ dispatch (aten/src/ATen/native/Dropout.cpp, transformers/attention.cpp,
    transformers/cuda/sdp_utils.cpp) for an sm90 GPU (H100), fp16 / bf16, and measured there
    (validation/cuda_dropout.py; torch 2.11.0+cu130, cuDNN 9.19, tests/data/cuda_dropout.json):

    * ``dropout``: on CUDA ``at::dropout`` is ``native_dropout`` (a 1-byte bool mask) for
      0 < p < 1, the input itself at p = 0;
    * ``scaled_dot_product_attention``: the first kernel of ``sdpa`` (``SDPA_ORDER``) that takes the
      call. ``SDPA_ORDER`` is torch's default priority on sm90 / sm100 / sm103 with a cuDNN newer
      than 9.15.0 (sdp_utils.cpp ``check_prefer_cudnn_attention``: cuDNN, flash, memory-efficient,
      math; torch 2.9+ wheels with cuDNN 9.15.1+, e.g. torch 2.11 with cuDNN 9.19; an older cuDNN, an
      A100 or ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` put flash first: ``sdpa=SDPA_ORDER[1:]``):
      - cuDNN attention (``_scaled_dot_product_cudnn_attention``; ``check_cudnn_tensor_shapes``:
        head dims multiples of 8, <= 256 on sm90 with cuDNN >= 9.10; any mask, turned into an
        additive one in the activation dtype; GQA native) saves q, k, v, the output, an fp32
        logsumexp [b, a, s, 1], the mask and its Philox seed and offset, int64 [] each (16 bytes:
        torch/_meta_registrations.py ``meta__scaled_dot_product_cudnn_attention``). Its output is
        allocated in q's layout (``alloc_with_matching_layout``, the meta registration does the
        same), where flash and memory-efficient attention allocate [b, s, a, d]: for DeepSeek's MLA,
        whose q is a ``torch.cat`` (contiguous [b, a, s, d]), transformers' ``transpose(1, 2)
        .reshape`` before o_proj then copies the output and o_proj keeps the copy: b a s d_v
        elements more than the memory-efficient kernel (which flash's d_qk != d_v refusal leaves),
        as measured on the H100;
      - FlashAttention-2 (``_scaled_dot_product_flash_attention``: no mask, equal head dims <= 256;
        head dim padded to a multiple of 8; GQA native) saves q, k, v, the output, an fp32
        logsumexp [b, a, s] and the RNG state uint64 [2] and [] (24 bytes, GPU tensors);
      - memory-efficient attention (any mask, turned into an additive one; head dims multiples of
        8; no GQA: equal head counts) saves the same plus the mask, its logsumexp padded to a
        multiple of 32 along s, and an int64 [] seed and offset (which a CUDA run outside graph
        capture keeps on the host: 16 bytes counted that the GPU does not hold);
      - else the math kernel, as on CPU (fp32).
      With dropout (``attention_dropout > 0``) the choice is the same (cuDNN takes dropout except
      with cuDNN 9.11 - 9.13; torch 2.11 took p = 0.1, where some other sdp_utils.cpp versions
      refuse a p that is not a multiple of 1/16: neither emulated): each kernel keeps only
      the Philox state to replay it, never an s x s tensor (measured); CPU sdpa instead leaves its
      flash kernel for the fp32 math path. The math kernel's own ``at::dropout`` goes through the
      ``dropout`` below (a bool mask). A kernel list without one that takes the call raises
      RuntimeError("No available kernel"), as torch does;
    * ``native_layer_norm``: fp32 mean and rstd for fp16 / bf16 inputs (CPU: the input's dtype).

    Conditions that make a size exact (a mask's rows aligned to 8 elements: s % 8 == 0) are
    assumed, not guarded, and listed in ``assumed``.
    """

    def __init__(self, names: dict, sdpa: tuple[str, ...] = SDPA_ORDER) -> None:
        if not sdpa or set(sdpa) - set(SDPA_ORDER):
            raise ValueError(f"sdpa kernels must be some of {SDPA_ORDER}")
        self.names = names  # torch symbol -> sympy Symbol("s" / "b")
        self.order = tuple(sdpa)
        self.assumed: list[str] = []

    def overrides(self) -> dict[str, Callable]:
        return {"dropout.default": self.dropout, "scaled_dot_product_attention.default": self.sdpa}

    @staticmethod
    def dropout(input, p, train):
        if not train or p == 0:
            return input
        if p == 1:
            return input * torch.zeros((), dtype=input.dtype, device=input.device)
        return torch.ops.aten.native_dropout.default(input, p, train)[0]

    def _assume_divisible(self, size, n: int) -> None:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        if statically_known_true(size % n == 0):
            return
        expr = sym_expr(size).xreplace(self.names)
        self.assumed.append(f"{expr} % {n} == 0")

    @staticmethod
    def _additive(attn_mask, dtype):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            return torch.where(attn_mask, torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype))
        return attn_mask

    def _takes(self, kernel: str, query, key, value, attn_mask) -> bool:
        """Whether `kernel` takes the call (sdp_utils.cpp's checks that tiny and real configs meet)."""
        low = query.dtype in (torch.float16, torch.bfloat16)
        d_qk, d_v = int(query.shape[-1]), int(value.shape[-1])
        if kernel == "cudnn":
            return low and d_qk % 8 == 0 and d_v % 8 == 0 and max(d_qk, d_v) <= 256
        if kernel == "flash":
            return attn_mask is None and low and d_qk == d_v and d_qk <= 256
        if kernel == "efficient":
            align = 8 if low else 4
            return (d_qk % align == 0 and d_v % align == 0 and query.shape[1] == key.shape[1]
                    and query.dtype in (torch.float16, torch.bfloat16, torch.float32))
        return True

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        aten = torch.ops.aten
        kernel = next((k for k in self.order if self._takes(k, query, key, value, attn_mask)), None)
        if kernel is None:
            raise RuntimeError(f"No available kernel among {self.order} (the CUDA kernels' emulation)")
        d_qk = int(query.shape[-1])
        if kernel == "cudnn":
            return aten._scaled_dot_product_cudnn_attention.default(
                query, key, value, self._additive(attn_mask, query.dtype), True, dropout_p, is_causal, False,
                scale=scale)[0]
        if kernel == "flash":
            pad = -d_qk % 8
            scale_ = scale if scale is not None else 1.0 / math.sqrt(d_qk)
            if pad:
                query, key, value = (torch.nn.functional.pad(x, (0, pad)) for x in (query, key, value))
            out = aten._scaled_dot_product_flash_attention.default(query, key, value, dropout_p, is_causal, False,
                                                                    scale=scale_)[0]
            return out[..., :d_qk] if pad else out
        if kernel == "efficient":
            attn_mask = self._additive(attn_mask, query.dtype)
            if attn_mask is not None:
                # rows aligned to 8 elements: no padded copy (pad_bias); the outer strides are
                # multiples of the row stride (contiguous) or 0 (broadcast)
                self._assume_divisible(attn_mask.stride(-2), 8)
                attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            return aten._scaled_dot_product_efficient_attention.default(
                query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
        return aten._scaled_dot_product_attention_math.default(query, key, value, self._additive(attn_mask, query.dtype),
                                                               dropout_p, is_causal, None, scale=scale,
                                                               enable_gqa=enable_gqa)[0]

    def norm_stats(self):
        """A dispatch mode that gives native_layer_norm CUDA's fp32 mean and rstd."""
        from torch.utils._python_dispatch import TorchDispatchMode

        class NormStats(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func is torch.ops.aten.native_layer_norm.default and out[1].dtype in (torch.float16,
                                                                                         torch.bfloat16):
                    out = (out[0], out[1].to(torch.float32), out[2].to(torch.float32))
                return out

        return NormStats()
