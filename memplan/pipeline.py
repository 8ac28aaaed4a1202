"""Pipeline schedules: how many micro-batches (and model chunks) a stage holds at its peak.

1F1B (PipeDream-flush, Megatron-LM's default): stage i runs p - i - 1 warm-up forwards, so it
holds min(p - i, M) micro-batches of its L/p layers; the first stage holds p, i.e. L layers'
worth (K22 section 4.2.3, Eq. 5). Interleaved with m chunks per rank (Megatron-LM
`get_forward_backward_func` warm-up count): rank i runs 2(p - i - 1) + (m - 1)p warm-up chunk
forwards and holds one more, each of L/(pm) layers; on the first rank that is
L(1 + (p - 1)/(pm)) layers (K22 section 4.2.3). With fewer micro-batches than warm-up steps,
only those exist (Megatron-LM caps the warm-up at the total).

All functions take scalars or numpy arrays.
"""

from __future__ import annotations

from typing import Any



def _minimum(x: Any, y: Any) -> Any:
    """min(x, y) by arithmetic, for ints and numpy arrays alike (no numpy import needed)."""
    return x - (x - y) * (x > y)


def chunks_in_flight(stage: Any, p: Any, m: Any, microbatches: Any) -> Any:
    """(micro-batch, model chunk) activation sets stage `stage` holds at its peak."""
    one_f_one_b = p - stage
    interleaved = 2 * (p - stage - 1) + (m - 1) * p + 1
    warmup_plus_one = (m == 1) * one_f_one_b + (m != 1) * interleaved
    return _minimum(warmup_plus_one, microbatches * m)


def microbatches_in_flight(stage: Any, p: Any, microbatches: Any) -> Any:
    """Micro-batches whose embedding (first stage) or output layer (last stage) activations are
    alive at the stage's peak: p - stage under 1F1B (K22 section 4.3: the sbhp of the first stage)."""
    return _minimum(p - stage, microbatches)


def interleaving_factor(p: int, m: int) -> float:
    """K22's first-stage factor 1 + (p - 1)/(p m) (1 when m = 1: no interleaving)."""
    return 1.0 if m == 1 else 1 + (p - 1) / (p * m)
