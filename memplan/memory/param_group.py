"""A parameter group (``ParamGroup``): named parameters with a polynomial count, whether tensor parallelism splits
them, where they live (``Scope``) and whether a step trains them; memplan/memory/states.py makes a model's groups."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Literal, Mapping, Optional

from memplan.core.symbolic import Poly

# Where a group lives: in every layer, in each mixture-of-experts layer ("moe"), in each dense layer of an
# MoE model ("dense": the layers before the first MoE one), on the first stage or on the last.
# Gemma 4's layers differ by kind: "full" (each full-attention layer: its own head width and K / V heads, beyond a
# sliding layer's), "kv_shared" / "kv_shared_full" (each K / V-sharing layer, sliding / full: no K / V of its own).
# Mllama's cross-attention layers: "cross" (each one's q / k norms and gates, beyond a self-attention layer's).
# A hybrid's (ModelSpec.layer_pattern) blocks: "attention", "ssm" (a Mamba-2 mixer), "conv" (LFM2's gated short
# convolution), "mamba1" (a Mamba-1 mixer), "shared" (a use of Zamba's shared block), "delta" (a gated DeltaNet),
# "rglru" (RecurrentGemma's RG-LRU recurrent block), "rwkv" (an RWKV block's time mixing and channel mixing but its
# key / value MLP), "lightning" (MiniMax's lightning attention), "mlstm"
# (xLSTM's mLSTM layer), "moa" (JetMoE's mixture of attention experts),
# "norm" (one norm), and its MLPs "dense" / "moe", each counted as often as the pattern holds it
# (ModelSpec.layer_blocks).
Scope = Literal["layer", "moe", "dense", "first", "last", "full", "kv_shared", "kv_shared_full", "cross", "attention",
                "ssm", "conv", "mamba1", "shared", "delta", "rglru", "rwkv", "lightning", "mlstm", "moa", "norm"]
HYBRID_SCOPES = ("attention", "ssm", "conv", "mamba1", "shared", "delta", "rglru", "rwkv", "lightning", "mlstm", "moa",
                 "norm")
LAYER_SCOPES = ("layer", "moe", "dense", *HYBRID_SCOPES)


@dataclass(frozen=True)
class ParamGroup:
    name: str
    count: Poly
    tp_split: bool
    scope: Scope
    expert: bool = False  # the routed experts: split over ep x etp instead of t (memplan/memory/parallel.py)
    whole: Optional[Poly] = None  # the part of count kept whole under TP (ModelSpec.mla_down_replicated)
    # False: weights only, never a gradient, so no optimizer state (torch AdamW skips a parameter whose .grad is None):
    # a frozen table (requires_grad false) or a module run under torch.no_grad (DeepSeek-V3.2's indexer); counted in
    # the parameters as transformers counts them (measured: validation/untrained.py)
    trained: bool = True
    requires_grad: bool = True  # False: a frozen table; True with trained False: a module run under torch.no_grad

    def per_gpu(self, values: Mapping[str, Any]) -> Any:
        n = self.count.evaluate(values)
        if self.whole is not None:
            kept = self.whole.evaluate(values)
            return -(-(n - kept) // values["t"]) + kept
        if self.expert:  # E/ep experts on a GPU, each f_e/etp wide (ep | E and etp | f_e: specs.py)
            return n // (values.get("ep", 1) * values.get("etp", values["t"]))
        # Vocabulary-parallel embeddings are padded to a multiple of t (Megatron-LM pads v).
        return -(-n // values["t"]) if self.tp_split else n


def number(n: int) -> Poly:
    """A count that is a number of the model's own (negative where a layer kind holds less than a sliding layer)."""
    return Poly((((), Fraction(n)),)).simplified()


def stepped(group: ParamGroup, dp_stack: Optional[str] = None) -> bool:
    """Whether the optimizer keeps a gradient and states for the group: a trained one; under DeepSpeed ZeRO also one
    that requires a gradient but gets none (stage_1_and_2.py flattens every requires_grad parameter into its fp32
    partitions and zero-fills a missing .grad: derived from DeepSpeed's code, not measured)."""
    return group.trained or (dp_stack == "deepspeed" and group.requires_grad)


def trained_only(count: Callable[[ParamGroup], Any], dp_stack: Optional[str] = None) -> Callable[[ParamGroup], Any]:
    """`count` (a group's parameters on one GPU) for the groups the optimizer steps (`stepped`), 0 for the others."""
    return lambda group: count(group) if stepped(group, dp_stack) else 0
