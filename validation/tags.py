"""Label vocabulary and the tag registry.

The reference layers call ``tag(tensor, label)`` on the tensors they hand to an op that saves them
for backward.  A tag names a *storage*; it computes nothing.  During a measurement a
``TagRegistry`` is active and remembers storage -> label; the ledger looks every saved storage up
in it after the forward pass.  Outside a measurement ``tag`` is a no-op.

Storages are identified by ``StorageWeakRef`` (the StorageImpl pointer).  It works for real and
for fake (meta) storages alike, and holding the weak reference keeps the StorageImpl's address
from being reused while the registry lives, so keys never collide.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

#: Saved tensors of one transformer layer (K22 section 4.1 rows, plus what torch adds).
LAYER_LABELS: tuple[str, ...] = (
    "ln1_input",
    "ln1_stats",
    "qkv_input",
    "qk",
    "softmax_out",
    "softmax_mask",
    "attn_dropout_out",
    "v",
    "proj_input",
    "attn_dropout_mask",
    "ln2_input",
    "ln2_stats",
    "fc1_input",
    "gelu_input",
    "fc2_input",
    "mlp_dropout_mask",
    "causal_mask",
)

#: Saved tensors outside the layers (K22 sections 4.3 / 5), plus what Megatron-style code adds.
MODEL_LABELS: tuple[str, ...] = (
    "token_ids",
    "position_ids",
    "embedding_input_mask",  # new: vocab-parallel embedding's out-of-shard mask (t > 1 only)
    "embedding_dropout_mask",
    "final_ln_input",
    "final_ln_stats",
    "head_input",
    "logits_fp32",
    "target_ids",  # new: int64 targets kept by the cross-entropy
    "target_mask",  # new: vocab-parallel cross-entropy's out-of-shard target mask
)

LABELS: tuple[str, ...] = LAYER_LABELS + MODEL_LABELS
UNLABELED = "unlabeled"
PARAMETER = "parameter"  # weights saved by linears; listed, never counted as activations

_ACTIVE: list["TagRegistry"] = []


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


class TagRegistry:
    """storage -> label, filled by ``tag`` while active (a context manager)."""

    def __init__(self) -> None:
        self.labels: dict[StorageWeakRef, str] = {}
        self.conflicts: list[str] = []
        self.frozen = False

    def add(self, t: torch.Tensor, label: str) -> None:
        if self.frozen:
            return
        if label not in LABELS:
            raise ValueError(f"unknown label {label!r}")
        key = storage_key(t)
        old = self.labels.get(key)
        if old is not None and old != label:
            self.conflicts.append(f"storage tagged {old!r} then {label!r} (shape {tuple(t.shape)})")
            return
        self.labels[key] = label

    def get(self, key: StorageWeakRef) -> str | None:
        return self.labels.get(key)

    def __enter__(self) -> "TagRegistry":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)


def tag(t: torch.Tensor, label: str) -> torch.Tensor:
    """Name the storage of ``t`` (returns ``t`` unchanged)."""
    if _ACTIVE:
        _ACTIVE[-1].add(t, label)
    return t
