"""THE inventory: every tensor a training step keeps for the backward pass, as data.

Each `Term` is one saved tensor (or a small group the same op saves): its size in
elements as a polynomial in the K22 symbols, the byte size of an element, how tensor
and sequence parallelism split it, what recompute does to it, where it lives (every
layer, the first pipeline stage, the last one) and where the number comes from.
Everything else (per-layer bytes, stage totals, the symbolic text, report rows,
the planner's vectorised sums) is derived from these rows; the paper's closed forms
exist only in the tests, as checks of this table.

Sources: K22 = Korthikanti et al. 2022, arXiv 2205.05198 (section 4.1 for the layer,
4.2 for TP/SP, 4.3 and appendix B for the embedding and output layer). Terms that
real PyTorch code stores but K22 ignores carry in_k22=False; the paper-only view
leaves them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from memplan.specs import Config, ModelSpec, Recompute
from memplan.symbolic import Poly

Scope = Literal["layer", "first", "last"]
Dtype = Literal["act", "mask", "fp32", "int64"]

# Bytes per element of each storage kind that is not the configurable activation dtype.
MASK_BYTES = 1  # dropout keeps a bool mask (K22 section 4.1: "masks are 1 byte")
FP32_BYTES = 4  # fp32 logits for the cross-entropy (K22 section 4.3: 4sbv)
INT64_BYTES = 8  # token ids (Megatron-LM theoretical_memory_usage: 8sbp)


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
    scope: Scope = "layer"
    in_k22: bool = True
    source: str = ""

    def element_bytes(self, activation_bytes: int) -> int:
        return {"act": activation_bytes, "mask": MASK_BYTES, "fp32": FP32_BYTES, "int64": INT64_BYTES}[
            self.dtype
        ]

    def size(self, activation_bytes: int) -> Poly:
        """Bytes on one GPU without parallelism, as a polynomial (e.g. 2as^2b)."""
        return self.elements * self.element_bytes(activation_bytes)

    def split_size(self, activation_bytes: int, sp: bool) -> Poly:
        """Bytes on one GPU of a tensor-parallel group, as a polynomial in t."""
        size = self.size(activation_bytes)
        return size.divide_by("t") if (self.tp_split or (sp and self.sp_split)) else size

    def bytes(self, values: Mapping[str, Any], activation_bytes: int, sp: Any) -> Any:
        """Bytes on one GPU; `values` and `sp` may be scalars or numpy arrays (one per plan)."""
        full = self.size(activation_bytes).evaluate(values)
        if self.tp_split:
            return full // values["t"]
        if self.sp_split:
            # sp is 0/1 (or an array of them): divide by t where SP is on, by 1 elsewhere.
            return full // (1 + (values["t"] - 1) * sp)
        return full

    def kept(self, recompute: Any) -> Any:
        """1 where the tensor is stored under this recompute mode, else 0 (scalar or array)."""
        if self.scope != "layer":
            return 1
        keep_selective = 0 if self.dropped_by_selective else 1
        keep_full = 1 if self.kept_by_full else 0
        return (
            (recompute == Recompute.NONE) * 1
            + (recompute == Recompute.SELECTIVE) * keep_selective
            + (recompute == Recompute.FULL) * keep_full
        )


def _t(id, name, block, elements, dtype="act", *, tp, sp, sel=False, full=False, scope="layer", k22=True, src):
    return Term(id, name, block, Poly.parse_sum(elements), dtype, tp, sp, sel, full, scope, k22, src)


# A K22 GPT layer (pre-LN, learned positions, GeLU MLP of width f, dropout), section 4.1.
# K and V have g heads of h/a each (g = a in K22), so their elements are s b h g/a.
def k22_layer(model: ModelSpec) -> list[Term]:
    s41 = "K22 section 4.1"
    terms = [
        _t("ln1_input", "input of layer norm 1 (the layer input)", "layer norms", "s b h",
           tp=False, sp=True, full=True, src=f"{s41}: layer norms 4sbh"),
        _t("qkv_input", "input of the QKV projection", "attention", "s b h",
           tp=False, sp=True, src=f"{s41}: QKV input 2sbh"),
        # Q (s b h) and K (s b h g/a) are saved together by QK^T.
        _t("qk", "Q and K (saved by QK^T)", "attention", "s b h + s b h g /a",
           tp=True, sp=False, src=f"{s41}: QK^T 4sbh"),
    ]
    if model.dropout:
        terms += [
            _t("softmax_out", "softmax output", "attention", "a s^2 b",
               tp=True, sp=False, sel=True, src=f"{s41}: softmax 2as^2b"),
            _t("softmax_mask", "softmax dropout mask", "attention", "a s^2 b", "mask",
               tp=True, sp=False, sel=True, src=f"{s41}: softmax dropout as^2b"),
            _t("attn_dropout_out", "softmax dropout output (saved by attention over V)", "attention",
               "a s^2 b", tp=True, sp=False, sel=True, src=f"{s41}: attention over V 2as^2b"),
        ]
    else:
        # Without dropout, attention over V saves the softmax output, which softmax's own
        # backward also needs: one tensor, stored once.
        terms += [
            _t("softmax_out", "softmax output (saved by softmax and by attention over V)", "attention",
               "a s^2 b", tp=True, sp=False, sel=True, src=f"{s41} without the dropout terms"),
        ]
    terms += [
        _t("v", "V (saved by attention over V)", "attention", "s b h g /a",
           tp=True, sp=False, src=f"{s41}: attention over V 2sbh"),
        _t("proj_input", "input of the output projection", "attention", "s b h",
           tp=True, sp=False, src=f"{s41}: output projection 2sbh"),
    ]
    if model.dropout:
        terms.append(_t("attn_dropout_mask", "dropout mask after attention", "attention", "s b h", "mask",
                        tp=False, sp=True, src=f"{s41}: attention dropout sbh"))
    terms += [
        _t("ln2_input", "input of layer norm 2", "layer norms", "s b h",
           tp=False, sp=True, src=f"{s41}: layer norms 4sbh"),
        _t("fc1_input", "input of the first MLP linear", "MLP", "s b h",
           tp=False, sp=True, src=f"{s41}: MLP 2sbh"),
        _t("gelu_input", "GeLU input", "MLP", "s b f",
           tp=True, sp=False, src=f"{s41}: GeLU 8sbh (f = 4h)"),
        _t("fc2_input", "input of the second MLP linear (GeLU output)", "MLP", "s b f",
           tp=True, sp=False, src=f"{s41}: second linear 8sbh (f = 4h)"),
    ]
    if model.dropout:
        terms.append(_t("mlp_dropout_mask", "dropout mask after the MLP", "MLP", "s b h", "mask",
                        tp=False, sp=True, src=f"{s41}: MLP dropout sbh"))
    return terms


def k22_outside_layers(model: ModelSpec) -> list[Term]:
    """Embedding on the first stage; final norm, output layer and loss on the last (K22 4.3)."""
    terms = [
        _t("token_ids", "token ids (int64 embedding input)", "embedding", "s b", "int64",
           tp=False, sp=False, scope="first", k22=False,
           src="Megatron-LM theoretical_memory_usage.py: 8sbp"),
    ]
    if model.dropout:
        terms.append(_t("embedding_dropout_mask", "embedding dropout mask", "embedding", "s b h", "mask",
                        tp=False, sp=True, scope="first", src="K22 section 4.3: sbhp/t"))
    terms += [
        _t("final_ln_input", "input of the final layer norm", "output layer", "s b h",
           tp=False, sp=True, scope="last", src="K22 section 4.3: 2sbh/t"),
        _t("head_input", "input of the output projection (LM head)", "output layer", "s b h",
           tp=False, sp=True, scope="last", src="K22 section 4.3: 2sbh/t"),
        _t("logits_fp32", "fp32 logits for the cross-entropy", "output layer", "s b v", "fp32",
           tp=True, sp=False, scope="last", src="K22 section 4.3: 4sbv/t"),
    ]
    return terms


@dataclass(frozen=True)
class Inventory:
    """The saved tensors of one architecture as one implementation runs it."""

    name: str
    terms: tuple[Term, ...]

    def scoped(self, scope: Scope, paper_only: bool = False) -> tuple[Term, ...]:
        return tuple(t for t in self.terms if t.scope == scope and (t.in_k22 or not paper_only))


def inventory_for(model: ModelSpec) -> Inventory:
    """The inventory of a model spec (today: the K22 GPT layer family)."""
    return Inventory("k22-gpt", tuple(k22_layer(model) + k22_outside_layers(model)))


def symbol_values(config: Config, **override: Any) -> dict[str, Any]:
    """Bind the symbols once: s, b, h, a, f, g, v, t (values may be numpy arrays in the planner)."""
    m = config.model
    values = dict(
        s=m.seq_length,
        b=config.training.micro_batch,
        h=m.hidden_size,
        a=m.num_attention_heads,
        f=m.f,
        g=m.g,
        v=m.vocab_size,
        t=config.parallel.tp,
    )
    values.update(override)
    return values


def display_poly(poly: Poly, model: ModelSpec) -> Poly:
    """Write a size in the model's own terms: f = 4h and g = a are substituted when they hold."""
    if model.f == 4 * model.hidden_size:
        poly = poly.substitute("f", Poly.parse("4 h"))
    if model.g == model.num_attention_heads:
        poly = poly.rename("g", "a")
    return poly
