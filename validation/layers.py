"""A K22-shaped GPT layer and model (per tensor-parallel rank), tagged for the ledger.

Layout [s, b, h] as in Megatron.  Every tensor an op will save for backward is passed through
``tag`` with its label; nothing here computes a size.

Two deliberate choices, both checked by tests:

* Dropout calls ``torch.native_dropout``.  On CUDA ``F.dropout`` dispatches to it (its mask is a
  1-byte bool, as K22 assumes); on CPU ``F.dropout`` does NOT: it decomposes into
  ``bernoulli_`` + ``mul`` and saves a mask in the activation dtype (2 bytes for bf16).  Calling
  ``native_dropout`` directly gives the CUDA behaviour on every device.
* Layer norm calls ``torch.native_layer_norm`` (what ``F.layer_norm`` calls) so that the mean and
  rstd it saves can be tagged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .parallel import (
    ColumnParallelLinear,
    Comm,
    CopyToTensorParallelRegion,
    LinearWithSequenceParallel,
    RowParallelLinear,
    ScatterToSequenceParallelRegion,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
)
from .tags import tag

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class LayerConfig:
    h: int
    a: int
    f: int
    sp: bool = False
    recompute: str = "none"
    p_drop: float = 0.1
    eps: float = 1e-5


def dropout(x: torch.Tensor, p: float, mask_label: str) -> torch.Tensor:
    """Training-mode dropout through ``aten::native_dropout`` (saves a bool mask)."""
    out, mask = torch.native_dropout(x, p, True)
    tag(mask, mask_label)
    return out


def causal_mask(s: int, device=None) -> torch.Tensor:
    """[s, s] bool, True above the diagonal (positions to mask), built once per forward."""
    return tag(torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1), "causal_mask")


class LayerNorm(nn.Module):
    def __init__(self, h, stats_label, eps=1e-5, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(h, dtype=dtype, device=device))
        self.eps, self.stats_label = eps, stats_label

    def forward(self, x):
        out, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        tag(mean, self.stats_label)
        tag(rstd, self.stats_label)
        return out


def attention_core(q, k, v, mask, p_drop: float, scale: float):
    """QK^T -> scale, causal mask -> softmax -> dropout -> attention over V.

    q, k, v: [b*a/t, s, d].  This is the region selective recompute checkpoints.
    """
    scores = torch.bmm(q, k.transpose(1, 2)) * scale  # bmm saves q and k
    scores = scores.masked_fill(mask, float("-inf"))  # saves the (shared) mask
    probs = torch.softmax(scores, dim=-1)  # saves its output
    tag(probs, "softmax_out")
    probs = dropout(probs, p_drop, "softmax_mask")
    tag(probs, "attn_dropout_out")
    return torch.bmm(probs, v)  # saves the dropout output and v


class ParallelAttention(nn.Module):
    def __init__(self, cfg: LayerConfig, comm: Comm, dtype=None, device=None):
        super().__init__()
        if cfg.a % comm.world or cfg.h % cfg.a:
            raise ValueError(f"a={cfg.a} must divide h={cfg.h} and be divisible by t={comm.world}")
        self.cfg, self.comm = cfg, comm
        self.a_local = cfg.a // comm.world
        self.d = cfg.h // cfg.a
        kw = dict(dtype=dtype, device=device)
        self.qkv = ColumnParallelLinear(cfg.h, 3 * cfg.h, comm, cfg.sp, **kw)
        self.proj = RowParallelLinear(cfg.h, cfg.h, comm, cfg.sp, **kw)

    def forward(self, x, mask):
        mixed = self.qkv(tag(x, "qkv_input"))  # [s, b, 3h/t]
        s, b, _ = mixed.shape
        mixed = mixed.view(s, b, self.a_local, 3, self.d)
        # [b*a/t, s, d].  The reshape alone would be a view of the QKV output (as in Megatron,
        # where the one 3sbh/t storage is kept); contiguous copies keep Q, K, V apart so the
        # ledger can label them separately.  Same saved bytes either way.
        q, k, v = (
            mixed[:, :, :, i].permute(1, 2, 0, 3).reshape(b * self.a_local, s, self.d).contiguous()
            for i in range(3)
        )
        tag(q, "qk")
        tag(k, "qk")
        tag(v, "v")
        args = (q, k, v, mask, self.cfg.p_drop, 1.0 / math.sqrt(self.d))
        if self.cfg.recompute == "selective":
            ctx = checkpoint(attention_core, *args, use_reentrant=False)
        else:
            ctx = attention_core(*args)
        ctx = ctx.view(b, self.a_local, s, self.d).permute(2, 0, 1, 3).contiguous().view(s, b, -1)
        return self.proj(tag(ctx, "proj_input"))


class ParallelMLP(nn.Module):
    def __init__(self, cfg: LayerConfig, comm: Comm, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.fc1 = ColumnParallelLinear(cfg.h, cfg.f, comm, cfg.sp, **kw)
        self.fc2 = RowParallelLinear(cfg.f, cfg.h, comm, cfg.sp, **kw)

    def forward(self, x):
        y = self.fc1(tag(x, "fc1_input"))
        y = F.gelu(tag(y, "gelu_input"))
        return self.fc2(tag(y, "fc2_input"))


class GPTLayer(nn.Module):
    """Pre-LN transformer layer, per tensor-parallel rank.  Input/output [s/t if sp else s, b, h]."""

    def __init__(self, cfg: LayerConfig, comm: Comm, dtype=None, device=None):
        super().__init__()
        if cfg.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}")
        kw = dict(dtype=dtype, device=device)
        self.cfg = cfg
        self.ln1 = LayerNorm(cfg.h, "ln1_stats", cfg.eps, **kw)
        self.attn = ParallelAttention(cfg, comm, **kw)
        self.ln2 = LayerNorm(cfg.h, "ln2_stats", cfg.eps, **kw)
        self.mlp = ParallelMLP(cfg, comm, **kw)

    def _forward(self, x, mask):
        tag(x, "ln1_input")
        x = x + dropout(self.attn(self.ln1(x), mask), self.cfg.p_drop, "attn_dropout_mask")
        tag(x, "ln2_input")
        return x + dropout(self.mlp(self.ln2(x)), self.cfg.p_drop, "mlp_dropout_mask")

    def forward(self, x, mask):
        if self.cfg.recompute == "full":
            tag(x, "ln1_input")
            return checkpoint(self._forward, x, mask, use_reentrant=False)
        return self._forward(x, mask)


class GPTModel(nn.Module):
    """Embedding (word v x h, vocab-parallel; learned positions s x h) + dropout, L layers,
    final LN, LM head tied to the word embedding, fp32 logits, vocab-parallel cross-entropy."""

    def __init__(self, cfg: LayerConfig, L: int, v: int, s: int, comm: Comm, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.cfg, self.comm = cfg, comm
        self.word = VocabParallelEmbedding(v, cfg.h, comm, **kw)
        self.pos = nn.Embedding(s, cfg.h, **kw)
        self.layers = nn.ModuleList(GPTLayer(cfg, comm, **kw) for _ in range(L))
        self.final_ln = LayerNorm(cfg.h, "final_ln_stats", cfg.eps, **kw)
        self.loss_chunks = 1  # > 1: LM head + loss in that many checkpointed sequence chunks (validation/losses.py)

    def forward(self, token_ids, position_ids, targets, mask):
        """token_ids, position_ids, targets: [b, s] int64; mask: [s, s] bool.  Returns mean loss."""
        comm, sp = self.comm, self.cfg.sp and self.comm.world > 1
        emb = self.word(token_ids) + self.pos(tag(position_ids, "position_ids"))  # [b, s, h]
        x = emb.transpose(0, 1).contiguous()  # [s, b, h]
        if sp:
            x = ScatterToSequenceParallelRegion.apply(x, comm)
        x = dropout(x, self.cfg.p_drop, "embedding_dropout_mask")
        for layer in self.layers:
            x = layer(x, mask)
        x = self.final_ln(tag(x, "final_ln_input"))
        tag(x, "head_input")
        w = self.word.weight  # tied: the LM head is the (vocab-parallel) word embedding
        if self.loss_chunks > 1:  # the head and loss in checkpointed sequence chunks (validation/losses.py)
            from .losses import chunked_vocab_parallel_cross_entropy

            if comm.world > 1:
                raise ValueError("the chunked loss of the reference model runs with t = 1")
            targets_sb = targets.transpose(0, 1).contiguous()
            return chunked_vocab_parallel_cross_entropy(x, w, targets_sb, comm, self.word.start, self.loss_chunks)
        if sp:
            logits = LinearWithSequenceParallel.apply(x, w, None, comm)
        else:
            if comm.world > 1:
                x = CopyToTensorParallelRegion.apply(x, comm)
            logits = F.linear(x, w)  # [s, b, v/t]
        targets_sb = targets.transpose(0, 1).contiguous()
        losses = VocabParallelCrossEntropy.apply(logits.float(), targets_sb, comm, self.word.start)
        return losses.mean()
