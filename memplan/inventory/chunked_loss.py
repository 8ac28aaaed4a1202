"""The LM head + vocab-parallel cross-entropy in N checkpointed sequence chunks, for `--impl torch` (measured)
and `--impl megatron` (derived, not measured): `--loss-chunks N`.

The pattern is that of Liger-Kernel's fused linear cross-entropy and torchtune's / MindSpeed-LLM's chunked
losses: the head's input [s, b, h] and the targets are split into N pieces along s, and each piece's
output projection and cross-entropy run under torch.utils.checkpoint (non-reentrant), so no chunk's logits
outlive its forward and the backward recomputes one chunk's logits at a time. The reference implementation
is validation/losses.py `chunked_vocab_parallel_cross_entropy` (the K22 reference model's tied head and
Megatron-style VocabParallelCrossEntropy on fp32 logits), measured by validation/step.py.

What a chunk holds, c = s b / N tokens (op by op in validation/step.py's log of the reference model):

- forward (and the backward's recompute of a chunk): the chunk's logits in the activation dtype, their fp32
  copy (the cross-entropy's input) and the cross-entropy's `logits - max` buffer, which exp / div turn into
  the softmax in place: 2 + 4 + 4 = 10 bytes per logit of the chunk; nothing survives a chunk's forward;
- backward: the softmax turned into the gradient in place, cast to the activation dtype, the head's backward
  (input and weight gradients). torch's autograd sums the chunks' weight gradients of the (tied) head in
  the AccumulateGrad node's input buffer: the earlier chunks' sum (v x h), the chunk's own and their new
  sum (out of place) at once; the chunks' input gradients wait in the split's buffer until the last chunk
  ((N - 1) c h). Megatron-LM's output layer writes its weight gradient straight into the fp32 main-gradient
  buffer (gradient-accumulation fusion, wgrad_gemm_accum_fp32): no v x h tensor in its backward.

Megatron-LM itself has no chunked loss: main (read at d98e8a6, 2026-08-22) offers only
`--cross-entropy-loss-fusion` with `--cross-entropy-fusion-impl native|te`
(megatron/core/models/common/language_module/language_module.py `compute_language_model_loss`), which fuses
the loss's element-wise kernels over the whole logits. A Megatron-LM run with `--loss-chunks N` therefore
needs a patched `compute_language_model_loss` / output layer (the pattern above); `--emit megatron` says so
and emits no flag for it.
"""

from __future__ import annotations

from memplan.inventory.k22 import vocab_parallel_loss_moments
from memplan.inventory.types import Moment, Term, saved, transient

INFO = ("--loss-chunks N: the LM head + cross-entropy in N checkpointed sequence chunks. hf-*: measured on "
        "transformers models (validation/losses.py chunked_cross_entropy); torch: measured on the reference model "
        "(validation/losses.py chunked_vocab_parallel_cross_entropy, t = 1); megatron: DERIVED from the torch "
        "measurement with Megatron-LM's fused wgrad accumulation, NOT MEASURED, and Megatron-LM has no such flag "
        "(a patched compute_language_model_loss; memplan/inventory/chunked_loss.py)")
MEASURED = "measured: validation/losses.py chunked_vocab_parallel_cross_entropy (validation/step.py)"
DERIVED = ("derived: the measured reference chunked loss (validation/losses.py) with Megatron-LM's fused wgrad "
           "accumulation (no weight-gradient transients), not measured")
# the terms of the whole loss that a chunked loss does not keep: each chunk's cross-entropy saves its softmax
# and targets only until the chunk's forward ends (the checkpoint recomputes them)
REPLACED = ("logits_fp32", "target_ids", "target_mask")


def chunked_head_terms(terms: list[Term], impl: str) -> list[Term]:
    """`terms` (an inventory's saved tensors) with the whole loss's saved tensors (the fp32 softmax, the
    masked targets and their mask) replaced by what the chunks' checkpoints keep: the head input (already a
    term) and the [s, b] int64 copy of the targets (the loss's transpose(0, 1).contiguous())."""
    src = MEASURED if impl == "torch" else DERIVED
    kept = [t for t in terms if t.id not in REPLACED]
    return kept + [saved("target_ids", "target ids [s, b] (int64), the chunks' checkpoint inputs", "output layer", "s b",
                      "int64", scope="last", k22=False, src=src)]


def chunked_loss_moments(chunks: int, impl: str, forward_extra: tuple[Term, ...] = ()) -> list[Moment]:
    """The moments of the chunked head + loss (module docstring), N = `chunks`:

    - loss forward of a chunk: its logits (activation dtype), their fp32 copy and the softmax buffer;
    - loss backward, the recompute of the last chunk back-propagated (chunk 1, the one with the most
      gradients alive): the same three, beside the earlier chunks' input gradients and, in torch, the
      running sum of the head's weight gradients;
    - head backward of that chunk (torch only): the running sum, the chunk's weight gradient and their new
      sum, beside the input gradients of all chunks."""
    src = MEASURED if impl == "torch" else DERIVED
    c = f"s b v /{chunks}"

    def logits() -> tuple[Term, ...]:
        return (transient("logits", "logits of one chunk (activation dtype)", c, tp=True, scope="last", src=src),
                transient("logits_fp32_copy", "fp32 copy of one chunk's logits", c, "fp32", tp=True, scope="last", src=src),
                transient("softmax_chunk", "one chunk's softmax buffer (logits - max, exp and divide in place; fp32)", c,
                   "fp32", tp=True, scope="last", src=src))

    earlier = transient("grad_head_input_chunks", "input gradients of the chunks back-propagated before",
                 f"{chunks - 1} s b h /{chunks}", scope="last", src=src)
    moments = [Moment("loss_forward", "loss forward of one chunk: logits, their fp32 copy and softmax", "loss",
                      "last", logits() + tuple(forward_extra), source=src)]
    if impl != "torch":  # Megatron-LM: the head's weight gradient goes into the main-gradient buffer
        moments.append(Moment("loss_backward", "loss backward: recompute of the last chunk back-propagated",
                              "backward", "last", logits() + (earlier,), source=src))
        return moments
    running = transient("grad_head_weight_sum", "running sum of the chunks' LM head weight gradients (autograd buffer)",
                 "v h", scope="last", src=src)
    every = transient("grad_head_input_all_chunks", "input gradients of the chunks back-propagated so far", "s b h",
               scope="last", src=src)
    moments += [
        Moment("loss_backward", "loss backward: recompute of the last chunk back-propagated", "backward", "last",
               logits() + (running, earlier), source=src),
        Moment("head_backward", "LM head backward of the last chunk: its weight gradient added to the running sum",
               "backward", "last",
               (running, transient("grad_head_weight_chunk", "the chunk's LM head weight gradient", "v h", scope="last",
                            src=src),
                transient("grad_head_weight_new_sum", "the new running sum (out of place)", "v h", scope="last", src=src),
                every), source=src),
    ]
    return moments


def note(chunks: int, impl: str) -> str:
    """What an estimate says about its chunked loss."""
    if impl == "torchtune":
        return (f"torchtune's CEWithChunkedOutputLoss in {chunks} chunks (its model's set_num_output_chunks): every "
                "chunk's fp32 log-softmax is saved as with the whole loss, the N bf16 chunks live through the loss "
                "forward; measured on CPU against torchtune 0.6.1 (memplan/inventory/tune_loss.py)")
    if impl == "torch":
        return (f"LM head + loss in {chunks} checkpointed sequence chunks: measured on the reference model "
                "(validation/losses.py chunked_vocab_parallel_cross_entropy, t = 1)")
    return (f"LM head + loss in {chunks} checkpointed sequence chunks: derived from the measured reference chunked "
            "loss, not measured; Megatron-LM has no such option (only --cross-entropy-loss-fusion), so a run needs a "
            "patched compute_language_model_loss (memplan/inventory/chunked_loss.py)")


def launch_note(chunks: int) -> str:
    """What `--emit megatron` says about a chunked loss it cannot express."""
    return (f"--loss-chunks {chunks}: Megatron-LM (main, d98e8a6) has no chunked LM head + loss, no flag is given; "
            "the plan's memory assumes a patched compute_language_model_loss that runs the output layer and the "
            "vocab-parallel cross-entropy in checkpointed sequence chunks (memplan/inventory/chunked_loss.py); "
            "--cross-entropy-loss-fusion only fuses the loss over the whole logits")


def loss_moments(impl: str, chunks: int, src: str, forward_extra: tuple[Term, ...] = ()) -> list[Moment]:
    """The vocab-parallel loss's moments, or with chunks > 1 those of the chunked head + loss
    (memplan/inventory/chunked_loss.py)."""
    if chunks == 1:
        return vocab_parallel_loss_moments(src, forward_extra)
    return chunked_loss_moments(chunks, impl, forward_extra)


def loss_terms(terms: list[Term], impl: str, chunks: int) -> list[Term]:
    if chunks == 1:
        return terms
    return chunked_head_terms(terms, impl)
