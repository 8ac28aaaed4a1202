"""torchtune 0.6.1's losses as its recipes run them (`--impl torchtune`): the whole cross-entropy on the fp32 logits
its TransformerDecoder returns, and CEWithChunkedOutputLoss (`--loss-chunks N`, the default of its recipes' configs).

Measured on CPU against torchtune's own model and loss (validation/torchtune.py `measure_torchtune_loss`,
tests/test_torchtune.py); what each keeps, as the recipes' `_loss_step` runs it (labels shifted by a torch.hstack,
`del logits` before the backward):

- whole loss (num_output_chunks 0): `TransformerDecoder.unembed` returns `self.output(h).float()`, so the bf16 logits
  die at the upcast inside the model; the loss's log_softmax makes its saved fp32 output beside the fp32 logits.
- chunked (`model.set_num_output_chunks(N)`): `chunked_output` returns N bf16 chunks of the logits (no upcast in the
  model); CEWithChunkedOutputLoss upcasts one chunk at a time, `F.cross_entropy(chunk.float(), reduction="sum")`, so
  every chunk's fp32 log-softmax is SAVED (s b v fp32 in all, as with the whole loss) while all N bf16 chunks stay
  alive through the loss forward; what chunking saves is the whole fp32 copy (forward) and whole-size gradients
  (backward). With b > 1 each chunk's labels are a contiguous int64 copy (the saved targets) beside the shifted
  labels; each chunk's nll_loss keeps its fp32 total weight, the final division the int64 token count.
- chunked backward (autograd's order, op by op in the CPU run): every chunk's loss backward first (the last chunk
  first: nll_loss's and log_softmax's fp32 gradients of one chunk beside all the saved log-softmax, then its bf16
  gradient, kept), then the output projection's backward chunk by chunk: its weight gradient added out of place to
  the running sum of the earlier chunks' (autograd's input buffer), the chunks' bf16 logit gradients freed one by one.
- compiled (`--compile --loss-chunks N`: its recipes' `compile_loss` compiles `compute_cross_entropy`, one chunk's
  upcast and cross-entropy, with inductor): AOTAutograd's partitioner saves the chunk's bf16 logits (the graph's
  input) and each row's max and log of the summed exponentials (two fp32 per token), not an fp32 log-softmax, and
  no total weight; the fused kernels make no fp32 copy. So the bf16 chunks stay alive until their chunk's backward,
  whose one kernel writes the chunk's bf16 gradient directly (a fp32 sum per row beside it) and frees the saved
  chunk. Measured on CPU (inductor's C++ kernels: torch.profiler's allocation events, the saved storages by a
  saved-tensors hook; validation/compiled.py `measure_compiled_tune_loss`, tests/test_compile_loss.py); CUDA
  (Triton kernels from the same partitioned graph) derived. Its recipes' full fine-tune discards what compile_loss
  returns for a whole (unchunked) loss, which stays eager.
"""

from __future__ import annotations

from memplan.inventory.types import Moment, Term, saved, transient

MEASURED = "measured: torchtune 0.6.1 on CPU (validation/torchtune.py measure_torchtune_loss)"
COMPILED = ("measured: torchtune 0.6.1's CEWithChunkedOutputLoss with compute_cross_entropy compiled (torch 2.13 "
            "inductor on CPU, validation/compiled.py measure_compiled_tune_loss)")
# what the eager loss saves (the compiled loss replaces them: compiled_loss_terms)
EAGER_SAVED = ("logits_fp32", "target_ids", "nll_total_weight", "loss_total_elements")
COMPILED_SAVED = ("logits_bf16", "loss_row_stats", "target_ids", "loss_total_elements")


def tune_loss_terms(chunks: int) -> list[Term]:
    """What torchtune's loss saves for the backward (beside the output projection's input, a model term)."""
    src = MEASURED if chunks > 1 else "torchtune 0.6.1, traced (tests/test_torchtune.py)"
    each = f"each of the {chunks} chunks' " if chunks > 1 else ""
    terms = [
        saved("logits_fp32", f"fp32 log-softmax of {each}logits", "output layer", "s b v", "fp32", scope="last",
              src=f"{src}: the logits upcast to fp32 (in the model or per chunk in the loss), log_softmax keeps its output"),
        saved("target_ids", "target ids (int64)", "output layer", "s b", "int64", scope="last", k22=False, src=src),
        saved("nll_total_weight", f"nll_loss total weight ({chunks} fp32 scalar(s))", "output layer", str(chunks),
              "fp32", scope="last", k22=False, src=src),
    ]
    if chunks > 1:
        terms.append(saved("loss_total_elements", "token count the chunks' summed loss is divided by (int64)",
                           "output layer", "1", "int64", scope="last", k22=False, src=src))
    return terms


def compiled_loss_terms(chunks: int) -> list[Term]:
    """What the compiled chunked loss saves (module docstring), N > 1 chunks."""
    return [
        saved("logits_bf16", f"bf16 logits of the {chunks} chunks (the compiled cross-entropy's saved input)",
              "output layer", "s b v", scope="last", k22=False, src=COMPILED),
        saved("loss_row_stats", "each row's max and log of summed exponentials (2 fp32 per token)", "output layer",
              "2 s b", "fp32", scope="last", k22=False, src=COMPILED),
        saved("target_ids", "target ids (int64)", "output layer", "s b", "int64", scope="last", k22=False,
              src=COMPILED),
        saved("loss_total_elements", "token count the chunks' summed loss is divided by (int64)", "output layer", "1",
              "int64", scope="last", k22=False, src=COMPILED)]


def tune_loss_forward(chunks: int, compiled: bool = False) -> Moment:
    """The loss forward's peak: the whole loss's fp32 logits (the model's output) beside the log-softmax it makes; a
    chunked loss's N bf16 chunks, one chunk's fp32 copy and the shifted labels beside the last chunk's log-softmax."""
    if compiled:  # the bf16 chunks are saved; inductor's kernels make no fp32 copy
        return Moment("loss_forward", "loss forward of the last chunk (compiled): the shifted labels", "loss", "last",
                      (transient("shifted_labels", "the recipe's shifted labels (int64)", "s b", "int64", scope="last",
                                 src=COMPILED),), source=COMPILED)
    if chunks == 1:
        return Moment("loss_forward", "loss forward: the model's fp32 logits, log-softmax", "loss", "last",
                      (transient("logits_fp32_copy", "fp32 logits returned by the model", "s b v", "fp32",
                                 scope="last", src=MEASURED),), source=MEASURED)
    return Moment("loss_forward", "loss forward of the last chunk: all bf16 chunks, one fp32 copy", "loss", "last",
                  (transient("logits", f"bf16 logits of the {chunks} chunks (the model's output)", "s b v",
                             scope="last", src=MEASURED),
                   transient("logits_fp32_copy", "fp32 copy of one chunk's logits", f"s b v /{chunks}", "fp32",
                             scope="last", src=MEASURED),
                   transient("shifted_labels", "the recipe's shifted labels (int64; with b > 1 the chunks' targets "
                             "are copies: 8 s bytes on the safe side with b = 1)", "s b", "int64", scope="last",
                             src=MEASURED)),
                  source=MEASURED)


def tune_chunked_backward(chunks: int, compiled: bool = False) -> list[Moment]:
    """The chunked loss's backward moments (module docstring), N > 1 chunks, eager or compiled. The output
    projection's .grad is made after the last chunk's (autograd's AccumulateGrad): none of these has it."""
    c = f"s b v /{chunks}"
    loss_saved = COMPILED_SAVED if compiled else EAGER_SAVED

    def bf16_grads(n: int) -> tuple[Term, ...]:
        return (transient("grad_logits", f"bf16 gradients of {n} chunks' logits", f"{n} s b v /{chunks}",
                          scope="last", src=MEASURED),) if n else ()

    weight = transient("grad_head_weight_chunk", "one chunk's output-projection weight gradient", "v h", scope="last",
                       src=MEASURED)
    loss = Moment("loss_backward", "loss backward of the last chunk: its nll_loss and log_softmax fp32 gradients",
                  "backward", "last", (transient("grad_nll", "nll_loss gradient of one chunk (fp32)", c, "fp32",
                                                 scope="last", src=MEASURED),
                                       transient("grad_log_softmax", "log_softmax gradient of one chunk (fp32)", c,
                                                 "fp32", scope="last", src=MEASURED)), source=MEASURED)
    if compiled:  # one kernel writes the chunk's bf16 gradient; its saved chunk is freed after it
        loss = Moment("loss_backward", "loss backward of the last chunk (compiled): its bf16 gradient", "backward",
                      "last", (transient("grad_logits_chunk", "bf16 gradient of one chunk's logits", c, scope="last",
                                         src=COMPILED),
                               transient("grad_row_sum", "the chunk's fp32 sum per row", f"s b /{chunks}", "fp32",
                                         scope="last", src=COMPILED)), source=COMPILED)
    return [
        loss,
        Moment("head_backward", "output projection backward of the first chunk: all chunks' bf16 logit gradients",
               "backward", "last", (*bf16_grads(chunks), weight,
                                    transient("grad_head_input", "one chunk's input gradient", f"s b h /{chunks}",
                                              scope="last", src=MEASURED)), loss_saved, source=MEASURED),
        # the second chunk's weight gradient added out of place to the first's: three v x h tensors at once
        Moment(
            "head_weight_sum", "output projection backward of the second chunk: its weight gradient summed",
            "backward", "last",
            (*bf16_grads(chunks - 2), weight,
             transient("grad_head_weight_sum", "running sum of the chunks' weight gradients (autograd buffer)", "v h",
                       scope="last", src=MEASURED),
             transient("grad_head_weight_new_sum", "the new sum (out of place)", "v h", scope="last", src=MEASURED)),
            loss_saved, source=MEASURED)]
