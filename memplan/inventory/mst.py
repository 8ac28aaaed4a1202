"""Mini-Sequence Transformer (MsT; Luo et al. 2024, arXiv 2407.15892) for transformers' Llama layout.

MsT runs the two blocks with the widest intermediates, the MLP (f wide) and the LM head + cross-entropy
(v wide), on M pieces of the sequence one after another, on top of the layer-level gradient
checkpointing it always turns on. Its code (github.com/wdlctc/mini-s, commit 797c54b,
minis/mini_sequence.py) wraps transformers' LlamaMLP (``LlamaMLPWarpper``: ``x.split(chunk, dim=1)``,
the MLP on each piece, ``torch.cat``) and LlamaForCausalLM (``LlamaForCausalLMWarpper.minis_processing``
with the autograd function ``_LM_head``: each piece's logits and loss in its forward, nothing saved but the
piece's input and targets; the backward recomputes the logits, turns their softmax into the gradient in
place, casts it to bf16 and adds the LM head's weight gradient into one ``.grad`` in place), and class
``minisequence`` calls ``gradient_checkpointing_enable()``.

What that changes in memory, as measured on validation/mst.py (the same algorithm written from the paper):

- The saved tensors stay: a checkpointed layer keeps its input; its backward re-runs the layer and every
  piece's MLP tensors are saved again, the same s b f-wide total as without MsT (for b = 1 the pieces are
  views). The pieces' backward then runs one at a time: the f-wide gradients are those of one piece
  (c = s/M tokens), and each finished piece frees its saved tensors. The largest moments are the first
  piece's (everything saved alive) and the second's (one piece freed, but the first piece's input gradient
  and the three projections' running weight-gradient sums alive: autograd sums a weight's gradients over
  the pieces in its input buffer, out of place, before .grad gets them).
- The loss keeps no logits: per piece, the forward holds the fp32 logits and the log-softmax (c v each);
  the backward of the last piece processed holds the recomputed fp32 logits, their softmax (fp32) and the
  bf16 gradient (10 c v bytes), the LM head's weight gradient (made by the first piece) and the input
  gradients of the other pieces ((M - 1) c h, concatenated after the last).

Sizes are exact when M divides s (and b = 1, MsT's own setting: for b > 1 the pieces are strided views that
the linear layers copy, which this model leaves out and refuses).

``--mst auto`` chooses M as MsT's code does: the MLP in pieces of max(4096 // b, 1024) tokens
(``LlamaMLPWarpper(chunk_size=4096, chunk_mode=True)``: ``max(self.chunk_size // bsz, 1024)``), so
M = ceil(s / that); the LM head in ``mini_s = 64`` pieces (``LlamaForCausalLMWarpper``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Union

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.core.symbolic import Poly
from memplan.inventory.types import FC2_W, OUTPUT_LAYER_W, Inventory, Moment, Term, saved, transient

# MsT's code (minis/mini_sequence.py, commit 797c54b): the MLP's piece length and its floor, the LM head's pieces
AUTO_MLP_TOKENS = 4096
AUTO_MLP_MIN_TOKENS = 1024
AUTO_HEAD_CHUNKS = 64

SRC = "measured: MsT (validation/mst.py) in a transformers 5.23.0 training step (validation/step.py)"
CODE = "github.com/wdlctc/mini-s minis/mini_sequence.py"

# what `memplan impls` lists for these techniques: how each is known
TECHNIQUES = {
    "--mst M|auto": "MsT mini-sequences (arXiv 2407.15892) for --impl hf-* on the Llama layout, b = 1, with "
                    "--recompute full: measured on CPU (validation/mst.py, a reference MsT MLP and LM head written from "
                    "the paper, in validation/step.py; `memplan validate --peak`); the 'auto' pieces are read from "
                    f"{CODE} (derived from its code, not measured); not expressible with --emit megatron (Megatron-LM "
                    "has no MsT)",
    "--optimizer-in-backward": "each parameter stepped in the backward by a post-accumulate-grad hook (for-loop "
                               "AdamW; MsT's scripts/benchmark_minis.py): measured on CPU (validation/step.py loop "
                               "in-backward); the steps' temporaries inside the layers are not counted (memplan/"
                               "timeline.py)",
}

MstSetting = Union[int, str]  # a number of pieces (1: off) or "auto"


def pieces(setting: MstSetting, s: int, b: int) -> tuple[int, int]:
    """(MLP pieces, LM-head pieces) for sequence length s and micro-batch b: (1, 1) is MsT off."""
    if setting == "auto":
        tokens = max(AUTO_MLP_TOKENS // b, AUTO_MLP_MIN_TOKENS)
        return math.ceil(s / tokens), min(AUTO_HEAD_CHUNKS, s)
    return min(int(setting), s), min(int(setting), s)


def is_on(setting: MstSetting) -> bool:
    return setting != 1


def pieces_for(model: ModelSpec, training: Any, impl: str) -> tuple[int, int]:
    """The (MLP, LM-head) pieces of `training.mst` for this model and implementation, checked (MsT off: (1, 1))."""
    check(model, impl, training.mst, training.micro_batch)
    return pieces(training.mst, model.seq_length, training.micro_batch) if is_on(training.mst) else (1, 1)


def check(model: ModelSpec, impl: str, setting: MstSetting, b: int) -> None:
    """MsT as modelled: transformers' Llama layout (the classes mini-s wraps), b = 1 (its experiments' batch)."""
    if not is_on(setting):
        return
    if impl not in ("hf-sdpa", "hf-eager"):
        raise MemplanError(f"--mst is modelled for transformers models (--impl hf-sdpa / hf-eager: {CODE} wraps "
                           f"transformers' LlamaMLP and LlamaForCausalLM), not --impl {impl}")
    if model.inventory is not None or model.mlp != "swiglu" or model.norm != "rmsnorm" or model.is_moe:
        raise MemplanError(f"--mst is modelled for the Llama layout (RMSNorm, SwiGLU MLP: the classes {CODE} wraps)")
    if b != 1:
        raise MemplanError("--mst is modelled for micro-batch 1 (MsT's setting; with b > 1 the pieces are strided "
                           "views the linear layers copy, which memplan does not model yet)")


# the f-wide tensors a Llama MLP saves (memplan/inventory/hf.py _llama_layer)
MLP_WIDE = ("silu_input", "up_out", "silu_out", "fc2_input")
FIRST, SECOND = "mst_first", "mst_second"  # suffixes of the pieces processed first / second in the backward


def search_pins(micro_batch: Any, recompute: Any, recompute_num_layers: Any, num_layers: int) -> tuple[int, int]:
    """What a search with MsT pins (micro-batch, recomputed layers, with full recompute): MsT's setting,
    micro-batch 1 with every decoder layer checkpointed (mini-s' minisequence turns transformers' gradient
    checkpointing on); a pinned value that contradicts it is refused."""
    if micro_batch not in (None, 1):
        raise MemplanError("--mst is modelled for micro-batch 1 (MsT's setting): drop --micro-batch or give 1")
    if recompute not in (None, Recompute.FULL):
        raise MemplanError("MsT runs with gradient checkpointing (mini-s' minisequence turns it on): give "
                           "--recompute full or leave it out")
    if recompute_num_layers not in (None, num_layers):
        raise MemplanError("MsT checkpoints every layer: drop --recompute-num-layers")
    return 1, num_layers


def _share(term: Term, elements: Poly, suffix: str, which: str) -> Term:
    return dataclasses.replace(term, id=f"{term.id}_{suffix}", name=f"{term.name}, {which}", elements=elements,
                               source=f"{term.source}; split into MsT pieces ({CODE})")


def apply(inventory: Inventory, model: ModelSpec, mlp: int, head: int) -> Inventory:
    """The transformers Llama inventory with MsT's MLP in `mlp` pieces and LM head + loss in `head` pieces."""
    if mlp <= 1 and head <= 1:
        return inventory
    terms = list(inventory.terms)
    moments = list(inventory.moments)
    if mlp > 1:
        terms, moments = _mlp(terms, moments, mlp)
    if head > 1:
        terms, moments = _head(terms, moments, model, head)
    return dataclasses.replace(inventory, name=f"{inventory.name}/mst{mlp}x{head}", terms=tuple(terms),
                               moments=tuple(moments))


def _mlp(terms: list[Term], moments: list[Moment], M: int) -> tuple[list[Term], list[Moment]]:
    """Each f-wide saved tensor as the first piece's share, the second's (M > 2) and the rest; the MLP's
    backward moments of the first two pieces in place of the whole MLP's."""
    one = Poly.parse(f"s b f /{M}")
    out: list[Term] = []
    for t in terms:
        if t.id not in MLP_WIDE:
            out.append(t)
            continue
        out.append(_share(t, one, FIRST, "the piece back-propagated first"))
        if M >= 2:
            out.append(_share(t, one, SECOND, "the piece back-propagated second"))
        if M >= 3:
            out.append(dataclasses.replace(t, elements=Poly.parse(f"{M - 2} s b f /{M}"),
                                           name=f"{t.name}, the other {M - 2} pieces"))
    piece = f"s b f /{M}"
    dy = transient("grad_residual", "gradient of the layer output (residual stream)", "s b h", src=SRC)
    d_fc2 = transient("grad_fc2_input_piece", "gradient of one piece's down-projection input", piece, src=SRC)
    two_f = transient("grad_activation_products_piece", "gradients of one piece's activation product factors",
               f"2 {piece}", src=SRC)
    d_in = transient("grad_mlp_input_first_piece", "input gradient of the first piece (held for the concatenation)",
              f"s b h /{M}", src=SRC)
    # autograd sums each projection's weight gradients over the pieces in its input buffer (out of place)
    sums = transient("grad_mlp_weight_sums", "running sums of the gate, up and down projections' weight gradients",
              "3 h f", src=SRC)
    d_fc2_w = transient("grad_fc2_weight_piece", "the second piece's down-projection weight gradient and the new running "
                 "sum it is added into (out of place)", "2 h f", src=SRC)
    first = tuple(f"{w}_{FIRST}" for w in MLP_WIDE)
    mst = [
        Moment("mst_fc2_backward", "MsT MLP backward, first piece: the down projection's gradients", "backward",
               "layer", (dy, d_fc2), (), (FC2_W,), fresh=True, source=SRC),
        # the first piece's down-projection weight gradient waits in autograd's buffer for the other pieces' (it
        # is neither .grad yet nor stepped by an optimizer in the backward)
        Moment("mst_mlp_backward", "MsT MLP backward, first piece: gradients of the activation product",
               "backward", "layer", (dy, d_fc2, two_f, transient("grad_fc2_weight_first_piece", "the first piece's "
                                                          "down-projection weight gradient (autograd buffer)", "h f",
                                                          src=SRC)), (f"fc2_input_{FIRST}",), (), source=SRC),
        Moment("mst_fc2_backward_2", "MsT MLP backward, second piece: its down-projection weight gradient beside "
               "the running sums", "backward", "layer", (dy, d_fc2, sums, d_fc2_w, d_in), first, (), source=SRC),
        Moment("mst_mlp_backward_2", "MsT MLP backward, second piece: gradients of the activation product",
               "backward", "layer", (dy, d_fc2, two_f, sums, d_in), first + (f"fc2_input_{SECOND}",), (),
               source=SRC),
    ]
    pieces_ids = tuple(f"{w}_{x}" for w in MLP_WIDE for x in (FIRST, SECOND))
    rest = [dataclasses.replace(m, freed=m.freed + pieces_ids) for m in moments
            if m.scope != "layer" or m.id not in ("fc2_backward", "mlp_backward")]
    return out, mst + rest


def _head(terms: list[Term], moments: list[Moment], model: ModelSpec, M: int) -> tuple[list[Term], list[Moment]]:
    """The loss keeps lm_head's input and the targets (views / copies of them per piece); the loss moments are
    one piece's (MsT's _LM_head forward and backward)."""
    kept = [t for t in terms if t.scope != "last" or t.id in ("head_input", "final_norm_fp32_input",
                                                               "final_norm_rstd", "final_norm_normed")]
    kept.append(saved("target_ids", "target ids (int64), saved per piece", "output layer", "s b", "int64",
                   scope="last", k22=False, src=f"{SRC}: MsT's LM head saves each piece's input and targets"))
    c = f"s b v /{M}"
    head = OUTPUT_LAYER_W if not model.tied_embeddings else "word embedding"

    def fp32(id: str, name: str) -> Term:
        return transient(id, name, c, "fp32", scope="last", src=SRC)

    earlier = transient("grad_head_input_pieces", "input gradients of the other pieces (held for the concatenation)",
                 f"{M - 1} s b h /{M}", scope="last", src=SRC)
    loss = [
        Moment("loss_forward", "MsT loss forward of one piece: fp32 logits and log-softmax", "loss", "last",
               (fp32("logits_fp32_copy", "fp32 logits of one piece"),
                fp32("log_softmax", "log-softmax of one piece (fp32)")), source=SRC),
        Moment("loss_backward", "MsT loss backward of the last piece: recomputed fp32 logits, their softmax and "
               "its bf16 cast, beside the LM head's weight gradient", "backward", "last",
               (fp32("logits_fp32_copy", "recomputed fp32 logits of the piece"),
                fp32("softmax", "softmax of the piece = the logits' gradient (fp32, in place)"),
                transient("grad_logits", "the logits' gradient cast to bf16", c, scope="last", src=SRC), earlier),
               (), (head,), source=SRC),
    ]
    return kept, [m for m in moments if m.scope != "last"] + loss
