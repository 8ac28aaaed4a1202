"""Reference implementations of memory-saving losses, measured by validation/step.py.

``chunked_cross_entropy``: the LM head and the cross-entropy over the sequence in ``chunks``
contiguous pieces, each under ``torch.utils.checkpoint`` (non-reentrant), the pattern of the
chunked / fused linear cross-entropy losses (Liger-Kernel's fused linear cross-entropy, the
chunked losses of torchtitan and Megatron-LM): no chunk's logits outlive its forward, and the
backward recomputes one chunk's logits at a time. The full ``[b, s, v]`` fp32 logits never exist.

``chunked_vocab_parallel_cross_entropy``: the same pattern for the K22 reference model
(validation/layers.py GPTModel, memplan's ``--impl torch``): its tied LM head and Megatron-style
vocab-parallel cross-entropy (validation/parallel.py VocabParallelCrossEntropy, fp32 logits) over
``[s, b, h]`` hidden states in ``chunks`` checkpointed pieces along s (t = 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunks: int) -> torch.Tensor:
    """Mean token cross-entropy of ``hidden @ weight.T`` ([b, s, h] x [v, h]) against ``targets``
    ([b, s]), computed in ``chunks`` pieces along s."""
    b, s, _ = hidden.shape
    total = None
    for x, y in zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)):
        part = checkpoint(_chunk_loss, x, weight, y, use_reentrant=False)
        total = part if total is None else total + part
    return total / (b * s)


def _vocab_parallel_chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, comm,
                          v_start: int) -> torch.Tensor:
    from .parallel import VocabParallelCrossEntropy

    logits = F.linear(hidden, weight)  # [s/N, b, v]
    return VocabParallelCrossEntropy.apply(logits.float(), targets, comm, v_start).sum()


def chunked_vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, comm,
                                         v_start: int, chunks: int) -> torch.Tensor:
    """Mean token loss of the reference model's head (``hidden`` [s, b, h] x ``weight`` [v, h], t = 1) and its
    vocab-parallel cross-entropy against ``targets`` [s, b], in ``chunks`` checkpointed pieces along s."""
    s, b, _ = hidden.shape
    total = None
    for x, y in zip(hidden.chunk(chunks, dim=0), targets.chunk(chunks, dim=0)):
        part = checkpoint(_vocab_parallel_chunk, x, weight, y, comm, v_start, use_reentrant=False)
        total = part if total is None else total + part
    return total / (s * b)
