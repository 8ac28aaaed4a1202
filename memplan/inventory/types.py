"""The types every inventory is made of: `Term` (one saved tensor), `Moment` (a moment of the step with its
transient tensors) and `Inventory` (an implementation's terms, moments and training-loop habits), with the
constructors `saved` and `transient` and the byte sizes of the storage kinds.

Each `Term` is one saved tensor (or a small group the same op saves): its size in
elements as a polynomial in the K22 symbols, the byte size of an element, how tensor
and sequence parallelism split it, what recompute does to it, where it lives (every
layer, the first pipeline stage, the last one) and where the number comes from.
Everything else (per-layer bytes, stage totals, the symbolic text, report rows,
the planner's vectorised sums) is derived from these rows; the paper's closed forms
exist only in the tests, as checks of this table. The inventories themselves live beside this
module (k22, megatron, mcore, moe, mla, hf, traced, and the savers), composed by `assemble`.

Sources: K22 = Korthikanti et al. 2022, arXiv 2205.05198 (section 4.1 for the layer,
4.2 for TP/SP, 4.3 and appendix B for the embedding and output layer). Terms that
real PyTorch code stores but K22 ignores carry in_k22=False; the paper-only view
leaves them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Mapping

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.core.symbolic import Poly

Scope = Literal["layer", "chunk", "first", "last"]


Dtype = Literal["act", "mask", "fp32", "int64", "fp8"]


# Bytes per element of each storage kind that is not the configurable activation dtype.
MASK_BYTES = 1  # dropout keeps a bool mask (K22 section 4.1: "masks are 1 byte")


FP32_BYTES = 4  # fp32 logits for the cross-entropy (K22 section 4.3: 4sbv)


INT64_BYTES = 8  # token ids (Megatron-LM theoretical_memory_usage: 8sbp)


FP8_BYTES = 1  # Transformer Engine's FP8 copies of the linear layers' inputs (memplan/inventory/fp8.py)


@dataclass(frozen=True)
class Term:
    """One saved tensor."""

    id: str
    name: str
    block: str
    elements: Poly
    dtype: Dtype
    tp_split: bool  # split over t by tensor parallelism (inside column/row-parallel regions)
    sp_split: bool  # replicated under TP, split over t along s when sequence parallelism is on
    dropped_by_selective: bool = False  # recomputed by selective recompute (the attention core)
    kept_by_full: bool = False  # the layer input: the only tensor full recompute keeps
    scope: Scope = "layer"  # every layer; once per model chunk; the first / last stage only
    in_k22: bool = True
    source: str = ""
    needs_tp: bool = False  # exists only with tensor parallelism (t > 1)
    only_full: bool = False  # exists only under full recompute (a checkpoint's own copy of the input)
    storages: int = 1  # separate allocations of equal size it is made of (LayerNorm's mean and rstd: 2)
    # an MoE layer's routed tokens after the dispatcher's all-gather over the expert-tensor-parallel group (h wide:
    # k s b h etp / t on one GPU); the routed experts' other terms are tp_split (/t: memplan/memory/parallel.py)
    etp_gathered: bool = False
    needs_cp: bool = False  # exists only with context parallelism (cp > 1): its buffers
    only_selective: bool = False  # exists only under selective recompute (the attention checkpoint's own inputs)
    without_cp: bool = False  # exists only without context parallelism (cp = 1): a cp term replaces it
    needs_ep: bool = False  # exists only with expert parallelism (ep > 1): torchtitan's all-to-all dispatch's tensors
    without_ep: bool = False  # exists only without expert parallelism (ep = 1): torchtitan's MoE output reduce-scattered
    tokenless: bool = False  # no token dimension (torchtitan's all-to-all counts, a weight's fp32 copy): cp keeps it whole
    # of an MoE model with dense first layers, a term of its dense layers only ("dense") or of its MoE layers ("moe"),
    # its elements weighted by their share of the model's layers (memplan/inventory/moe.py weighted); a pipeline
    # stage's own share replaces it where the kinds are modelled per stage (memplan/memory/term_bytes.py kind_share)
    layer_kind: str = ""

    @property
    def recompute_flags(self) -> tuple:
        """What decides `kept` and the copy count: terms with equal flags share them."""
        return (self.scope, self.dropped_by_selective, self.kept_by_full, self.only_full, self.only_selective)

    def element_bytes(self, activation_bytes: int) -> int:
        return {"act": activation_bytes, "mask": MASK_BYTES, "fp32": FP32_BYTES, "int64": INT64_BYTES,
                "fp8": FP8_BYTES}[self.dtype]

    def size(self, activation_bytes: int) -> Poly:
        """Bytes on one GPU without parallelism, as a polynomial (e.g. 2as^2b)."""
        return self.elements * self.element_bytes(activation_bytes)

    def split_size(self, activation_bytes: int, sp: bool, cp: int = 1) -> Poly:
        """Bytes on one GPU of a tensor-parallel group, as a polynomial in t (and cp: the rank's s/cp tokens, as
        `bytes` divides them)."""
        size = self.size(activation_bytes)
        if cp > 1 and not self.tokenless:
            size = size.divide_by("cp")
        if self.etp_gathered:
            size = size * Poly.parse("etp")
        return size.divide_by("t") if (self.tp_split or (sp and self.sp_split)) else size

    def exists_at_cp(self, cp: int) -> bool:
        """Whether the term exists at context-parallel degree ``cp`` (needs_cp: only above 1, without_cp: only at 1);
        `bytes` applies the same rule to arrays of plans."""
        return not (self.needs_cp and cp == 1) and not (self.without_cp and cp > 1)

    def bytes(self, values: Mapping[str, Any], activation_bytes: int, sp: Any) -> Any:
        """Bytes on one GPU; `values` and `sp` may be scalars or numpy arrays (one per plan)."""
        full = self.size(activation_bytes).evaluate(values)
        if self.needs_tp:
            full = full * (values["t"] > 1)
        # context parallelism: every tensor holds the rank's s/cp tokens (memplan/memory/parallel.py); a term's own cp
        # factor (a buffer of all cp chunks) is in its polynomial
        cp = values.get("cp", 1)
        full = full // (1 if self.tokenless else cp)
        if self.needs_cp:
            full = full * (cp > 1)
        if self.without_cp:
            full = full * (cp == 1)
        if self.needs_ep:
            full = full * (values.get("ep", 1) > 1)
        if self.without_ep:
            full = full * (values.get("ep", 1) == 1)
        if self.etp_gathered:
            full = full * values.get("etp", values["t"])
        if self.tp_split:
            return full // values["t"]
        if self.sp_split:
            # sp is 0/1 (or an array of them): divide by t where SP is on, by 1 elsewhere.
            return full // (1 + (values["t"] - 1) * sp)
        return full

    def kept(self, recompute: Any) -> Any:
        """1 where the tensor is stored under this recompute mode, else 0 (scalar or array)."""
        if type(recompute) is Recompute:  # one mode: worked out once per term (the timelines ask it often)
            return self._kept_by_mode[recompute]
        return self._kept(recompute)

    @cached_property
    def _kept_by_mode(self) -> tuple[int, ...]:
        return tuple(self._kept(mode) for mode in sorted(Recompute))

    def _kept(self, recompute: Any) -> Any:
        if self.scope != "layer":
            # outside the layers only a checkpoint's inputs depend on recompute (the mask every
            # checkpointed layer is given)
            return 1 * (recompute == Recompute.FULL) if self.only_full else 1
        keep_none = 0 if (self.only_full or self.only_selective) else 1
        keep_selective = 0 if (self.dropped_by_selective or self.only_full) else 1
        keep_full = 1 if (self.kept_by_full or self.only_full) else 0
        return (
            (recompute == Recompute.NONE) * keep_none
            + (recompute == Recompute.SELECTIVE) * keep_selective
            + (recompute == Recompute.FULL) * keep_full
        )


def saved(id, name, block, elements, dtype="act", *, tp=False, sp=False, sel=False, full=False, scope="layer",
       k22=True, src, needs_tp=False, only_full=False, storages=1, etp_gathered=False, needs_cp=False,
       only_selective=False, without_cp=False, needs_ep=False, without_ep=False, tokenless=False):
    return Term(id, name, block, Poly.parse_sum(elements), dtype, tp, sp, sel, full, scope, k22, src, needs_tp,
                only_full, storages, etp_gathered, needs_cp, only_selective, without_cp, needs_ep, without_ep,
                tokenless)


@dataclass(frozen=True)
class Moment:
    """A moment of the step when tensors beyond the saved ones are alive: inside a layer's backward
    (scope "layer") or around the loss (scope "last"). Its bytes are what the step holds anyway
    (states, saved tensors of the layers not yet back-propagated) plus, for the layer or head in
    question, its saved terms not in `freed`, its `transients` and the gradients of the parameter
    groups in `grads` (the step timeline, memplan/memory/timeline.py, adds them up)."""

    id: str
    name: str
    phase: Literal["forward", "loss", "backward"]  # forward: inside a layer's forward (its later terms in `freed`)
    scope: Literal["layer", "last"]
    transients: tuple[Term, ...]
    freed: tuple[str, ...] = ()  # saved term ids of this layer / the head no longer alive
    grads: tuple[str, ...] = ()  # parameter groups (states.param_groups names) whose gradients exist by now
    recomputed: bool = True  # selective recompute: the attention core has been re-run by now
    fresh: bool = False  # the last group's new gradient is still its own tensor (not yet accumulated)
    source: str = ""
    grad_elements: int = 0  # gradients made so far of the layer's own parameters, in elements (traced moments)
    # layers it happens in: all, not recomputed, recomputed (full), re-run in the backward by any recompute mode
    # (full, or torchtitan's selective-op, which checkpoints the whole block)
    applies: Literal["any", "plain", "recomputed", "rerun"] = "any"
    layers: tuple[int, ...] = ()  # the model's layers (from 0) it happens in, when not all (a traced layer group)
    # saved term ids the moment's transients make (log_softmax of the fp32 logits): the allocation stream
    # (memplan/memory/stream.py) allocates them after the transients, as the real code does
    made_after: tuple[str, ...] = ()
    # transient ids of this moment the next moment's first transient is computed from: autograd frees a node's
    # incoming gradient after the node has made its output, so the stream frees them after that allocation (where
    # the next moment's first transient is the same id, it is that tensor, kept: megatron-core's logits gradient)
    handed_on: tuple[str, ...] = ()


def transient(id, name, elements, dtype="act", *, tp=False, sp=False, scope="layer", src="", needs_cp=False,
              storages=1, tokenless=False):
    """A transient tensor (a Term that no backward keeps; `storages`: the separate equal tensors it is made of;
    `tokenless`: no token dimension, a weight's gradient: context parallelism keeps it whole)."""
    return saved(id, name, "transient", elements, dtype, tp=tp, sp=sp, scope=scope, k22=False, src=src,
              needs_cp=needs_cp, storages=storages, tokenless=tokenless)


# Parameter groups (memplan/memory/states.py) by role.
QKV_W, PROJ_W = "QKV projection weight", "attention output projection weight"


FC1_W, FC2_W = "MLP input projection weight", "MLP output projection weight"
OUTPUT_LAYER_W = "output layer (LM head)"


GradLifetime = Literal["buffer", "backward"]


@dataclass(frozen=True)
class Inventory:
    """The saved tensors of one architecture as one implementation runs it, the moments its step
    peaks at, and how its training loop holds gradients and steps the optimizer."""

    name: str
    terms: tuple[Term, ...]
    moments: tuple[Moment, ...] = ()
    grad_lifetime: GradLifetime = "buffer"  # a main-gradient buffer for the whole step, or torch .grad
    grad_hook_transient: bool = False  # each bf16 .grad lives until a hook adds it to the fp32 buffer
    optimizer_impl: str = "fused"  # the implementation's default AdamW
    runtime: Literal["torch", "megatron"] = "torch"  # which process figure of the GPU preset applies
    held: tuple[Term, ...] = ()  # inputs the training loop holds for the micro-batch (not saved by autograd)
    # torch autograd keeps a tied output layer's weight gradient in its input buffer until the
    # embedding's backward adds its own (out of place); Megatron-LM's fused wgrad writes it to the buffer
    tied_grad_waits: bool = True
    # every allocation is rounded up to this many bytes: 512 for PyTorch's CUDA caching allocator
    # (c10/cuda/CUDACachingAllocator.cpp kMinBlockSize), 1 on CPU
    granularity: int = 1
    origin: str = ""  # a traced inventory's origin (memplan/inventory/traced.py); empty for hand-written ones
    traced_from: tuple[tuple[str, int], ...] = ()  # (symbol, least value) a trace's sizes hold from: (("b", 2),)
    traced_multiple: tuple[tuple[str, int], ...] = ()  # (symbol, m): a trace's sizes hold where m divides it (a scan's chunk)
    # how the weight matrices are stored (shapes.weight_shapes): transformers keeps a gated model's
    # q/k/v_proj and gate/up_proj apart ("separate"; Phi-3's fused qkv_proj is not modelled), Megatron-LM,
    # the reference layer and transformers' GPT-2 (Conv1D c_attn, c_fc) fuse them
    weight_layout: Literal["fused", "separate"] = "fused"
    # the run's allocation stream (memplan/memory/stream.py) was checked against a recording of the real code's
    # allocations (tests/test_alloc_fixtures.py): the replay alone decides fit, no flat margin (memory/timeline.py
    # device_memory); set by memplan/inventory/assemble.py training_inventory
    stream_checked: bool = False
    # a gradient-checkpointed layer's forward in the real code's op order, for the allocation stream only: ("+", t)
    # makes term t's tensor (a saved term of the layer, by id, or a transient of its own), ("-", t) frees it; run
    # without saving, every tensor made is freed within the layer (memplan/memory/stream.py _layer_forward)
    checkpointed_forward: tuple[tuple[str, Term], ...] = ()
    # a traced step's allocations and frees in the real code's order: (recompute "none" / "full", the model's layers,
    # memplan/inventory/step_order.py `expand`'s events) of each run traced; memplan/memory/stream_traced.py makes
    # each step of the stream from it (empty: the stream derived from the timeline, memplan/memory/stream.py)
    step_order: tuple[tuple[str, int, tuple], ...] = ()
    # torchtitan's async TP (memplan/inventory/titan_async_tp.py): its symmetric-memory workspace per sequence before
    # the TP split, made outside the caching allocator (memplan/memory/device.py counts it beside the runtime); 0: none
    symm_workspace_bytes: int = 0


HF_IMPLS = ("hf-eager", "hf-sdpa", "torchtune")  # torch .grad loops, one device per replica


DEVICES = ("cuda", "cpu")


CUDA_BLOCK_BYTES = 512  # PyTorch's CUDA caching allocator rounds every block up to a multiple of this


def display_poly(poly: Poly, model: ModelSpec) -> Poly:
    """Write a size in the model's own terms: f = 4h, g = a and q = h are substituted when they hold."""
    if model.q == model.hidden_size:
        poly = poly.rename("q", "h")
    if model.f == 4 * model.hidden_size:
        poly = poly.substitute("f", Poly.parse("4 h"))
    if model.g == model.num_attention_heads:
        poly = poly.rename("g", "a")
    return poly
