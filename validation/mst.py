"""Mini-Sequence Transformer (MsT; Luo et al. 2024, arXiv 2407.15892), a reference implementation
written from the paper's description, measured by validation/step.py.

MsT partitions the sequence of the two blocks whose intermediates are wide, the MLP (f wide) and
the LM head + cross-entropy (v wide), into M mini-sequences processed one after another, and relies
on the layer-level gradient checkpointing (activation recomputation) the model already has: MsT's
own wrapper (github.com/wdlctc/mini-s, minis/mini_sequence.py, class ``minisequence``) always turns
gradient checkpointing on. What this module does, in the paper's terms:

* ``MiniSequenceMLP`` wraps a decoder layer's MLP: the input ``[b, s, h]`` is split along s into
  pieces of ``ceil(s / M)`` tokens, the unchanged MLP runs on each piece in turn and the outputs are
  concatenated. Under the layer's checkpoint the forward keeps nothing of the pieces; the backward
  re-runs the layer (the checkpoint's recomputation) and back-propagates the pieces one by one, so
  the f-wide gradients exist for one piece at a time.
* ``mini_sequence_loss``: the final hidden states are split along s into M pieces; each piece's
  logits, their fp32 copy and the cross-entropy exist only inside that piece's forward (nothing of
  them is saved: the piece keeps its input, a view, and its targets); the backward of a piece
  recomputes its logits, turns their softmax into the logits' gradient in place (softmax minus the
  one-hot targets, times the incoming gradient), casts it to the weights' dtype and makes the input
  gradient and the LM head's weight gradient, which it adds in place into the weight's ``.grad`` (so
  the pieces share one v x h gradient, as MsT's LM-head wrapper does).

Chunk counts: ``chunks`` pieces (``ceil(s / chunks)`` tokens each; MsT's ``--mst auto`` rule is
memplan/inventory/mst.py's). Targets are not shifted (the last position is scored too), which changes no size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MiniSequenceMLP(nn.Module):
    """An MLP run on ``chunks`` pieces of the sequence, one after another (MsT's MLP)."""

    def __init__(self, mlp: nn.Module, chunks: int) -> None:
        super().__init__()
        self.mlp, self.chunks = mlp, chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        piece = math.ceil(x.shape[1] / self.chunks)
        return torch.cat([self.mlp(part) for part in x.split(piece, dim=1)], dim=1)


def wrap_mlps(layers, chunks: int) -> None:
    """Replace each decoder layer's ``mlp`` by its mini-sequence version (the parameters are the same)."""
    for layer in layers:
        layer.mlp = MiniSequenceMLP(layer.mlp, chunks)


class _HeadPiece(torch.autograd.Function):
    """The LM head and the summed cross-entropy of one piece; the backward recomputes the logits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, weight).float()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        ctx.save_for_backward(hidden, targets)
        ctx.weight = weight  # a parameter: alive anyway, not a saved activation
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, targets = ctx.saved_tensors
        weight = ctx.weight
        logits = F.linear(hidden, weight).float()
        grad = torch.softmax(logits, dim=-1)
        flat = grad.view(-1, grad.shape[-1])
        flat[torch.arange(flat.shape[0]), targets.reshape(-1)] -= 1
        grad.mul_(grad_loss)
        grad = grad.to(hidden.dtype)
        flat, rows = grad.view(-1, grad.shape[-1]), hidden.reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            if weight.grad is None:
                weight.grad = flat.t() @ rows
            else:
                weight.grad.addmm_(flat.t(), rows)
        del logits
        return grad @ weight, None, None


def mini_sequence_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       chunks: int) -> torch.Tensor:
    """Mean token cross-entropy of ``hidden @ weight.T`` ([b, s, h] x [v, h]) against ``targets``
    ([b, s]), the LM head and loss run on ``chunks`` pieces of the sequence (MsT's LM head)."""
    b, s, _ = hidden.shape
    piece = math.ceil(s / chunks)
    total = None
    for x, y in zip(hidden.split(piece, dim=1), targets.split(piece, dim=1)):
        part = _HeadPiece.apply(x.contiguous(), weight, y.contiguous())
        total = part if total is None else total + part
    return total / (b * s)
