"""The HF Trainer's own loop (validation/trainer_loop.py: transformers 5.23's Trainer.train() on CPU, a tiny Llama,
its second optimizer step measured with the live tracker) against memplan's step timeline, and what a padded or
packed batch adds with sdpa (--batch-layout, memplan/inventory/hf_trainer.py)."""

import dataclasses

import pytest

import memplan
from memplan.check.peak import PeakCase, predict_peak
from memplan.core.errors import MemplanError
from memplan.inventory import hf_trainer

# the tiny Llama of validation/trainer_loop.py TrainerCase: s 64, b 2, h 64, a 4, g 2 (q = h = 64), f 160, L 2, v 256
S, B, H, A, G, F, L, V = 64, 2, 64, 4, 2, 160, 2, 256
# memplan's step peak may exceed the measured one by at most this fraction (the rest of its model of transformers'
# step: 860 to 1,888 B above the Trainer's measured peaks of GRID, 0.06-0.12 %), never fall below it
BAND = 0.002


def _predict(s, b, layout, recompute="none", microbatches=1, attn="sdpa", reentrant=False):
    case = PeakCase("trainer", "llama", s, b, H, A, L=L, v=V, f=F, g=G, attn=attn, optimizer="fused",
                    recompute=recompute, microbatches=microbatches, batch_layout=layout, reentrant=reentrant)
    return int(predict_peak(case).peak_bytes)


@pytest.fixture(scope="module")
def measured():
    """One Trainer run: rows of 64 and 48 tokens padded to 64 (an attention mask), 2 micro-batches a step (the
    Trainer's loss over num_items_in_batch, gradients kept between them), gradient checkpointing (transformers'
    default: use_reentrant=False), the Trainer's defaults otherwise (fused AdamW, max_grad_norm 1). The packed
    batches and the other loops: test_trainer_grid (slow)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from validation.trainer_loop import TrainerCase, measure_trainer

    return measure_trainer(TrainerCase(batching="padded", ga=2, checkpointing=True))


def _within(predicted, measured):
    return 0 <= predicted - measured <= BAND * measured


def _padded():
    return _predict(S, B, "padded", recompute="full", microbatches=2)


def test_trainer_step_matches(measured):
    # the Trainer's default optimizer on CPU is torch's fused AdamW (transformers: adamw_torch_fused for torch >= 2.8),
    # what memplan's hf-* inventories assume: bf16 weights (2 B), two bf16 moments (4 B)
    assert "'fused': True" in measured.notes[-1]
    assert measured.persistent["optimizer_states"] == 2 * measured.persistent["weights"]
    assert _within(_padded(), measured.peak_bytes), (_padded(), measured.peak_bytes)
    # what memplan said before --batch-layout: below the measured peak
    assert not _within(_predict(S, B, "full", recompute="full", microbatches=2), measured.peak_bytes)


@pytest.mark.parametrize("term_id", ["sdpa_attention_mask", "checkpoint_bool_mask", "k"])
def test_removing_a_mask_term_fails(measured, monkeypatch, term_id):
    """Each term hf_trainer adds (the saved additive mask, the bool mask kept by checkpointing, K at all heads) is
    needed to stay within the band."""
    apply = hf_trainer.apply

    def without(inventory, model, impl, layout):
        inv = apply(inventory, model, impl, layout)
        if term_id == "k":  # K back to g heads
            terms = tuple(next(u for u in inventory.terms if u.id == "k") if t.id == "k" else t for t in inv.terms)
        else:
            terms = tuple(t for t in inv.terms if t.id != term_id)
        return dataclasses.replace(inv, terms=terms)

    monkeypatch.setattr(hf_trainer, "apply", without)
    assert not _within(_padded(), measured.peak_bytes)


def test_mask_terms_by_hand():
    # per layer, hand-derived from transformers' code (memplan/inventory/hf_trainer.py): the additive mask b s^2 bf16
    # (2 B) and K, V at a heads instead of g: 2 tensors x s b q (1 - g/a) x 2 B; in the Trainer runs above, the
    # measured padded peak minus the same step on full rows (validation/trainer_loop.py TrainerCase(), one
    # micro-batch: 1,937,956 - 1,872,420 = 65,536 B) is exactly L x (2 x 2 x 64^2 + 2 x 64 x 2 x 64 x 1/2 x 2)
    per_layer = 2 * B * S * S + 2 * S * B * H * (1 - G / A) * 2
    assert L * per_layer == 65_536 == 1_937_956 - 1_872_420
    assert _predict(S, B, "padded") - _predict(S, B, "full") == L * per_layer


def test_eager_and_full_unchanged():
    # eager attention builds its [b, 1, s, s] mask for every batch (measured: the Trainer's padded and full eager
    # steps peak at the same 2,294,308 B, TrainerCase(attn="eager") with and without batching="padded"): the layout
    # changes nothing there
    assert _predict(S, B, "padded", attn="eager") == _predict(S, B, "full", attn="eager")


def test_reentrant_checkpointing_by_hand():
    # use_reentrant=True (transformers' default is False): torch's CheckpointFunction.backward holds the recomputed
    # layer's output, s b h bf16 = 64 x 2 x 64 x 2 = 16,384 B, through the layer's backward; measured with the Trainer
    # (validation/trainer_loop.py, TrainerCase(checkpointing=True) with use_reentrant True / None): 1,337,252 -
    # 1,320,868 = 16,384 B at layer 1's MLP backward (test_trainer_grid re-measures both)
    assert 1_337_252 - 1_320_868 == S * B * H * 2
    assert _predict(S, B, "full", "full", reentrant=True) - _predict(S, B, "full", "full") == S * B * H * 2
    with pytest.raises(MemplanError, match="checkpoint-reentrant"):
        memplan.estimate("llama3-8b", impl="hf-sdpa", gpus=1, seq_len=2048, checkpoint_reentrant=True)


def test_layout_refused_where_not_modelled():
    with pytest.raises(MemplanError, match="batch-layout"):
        memplan.estimate("llama3-8b", impl="torchtitan", gpus=1, seq_len=2048, batch_layout="packed")
    with pytest.raises(MemplanError, match="batch-layout"):
        memplan.estimate("gpt3-175b", impl="hf-sdpa", gpus=8, seq_len=2048, recompute="none", batch_layout="padded")


# every loop of the comparison, measured (validation/trainer_loop.py) against memplan: (TrainerCase options, memplan's
# s, b, layout, recompute, micro-batches); the packed rows are one row of 64 + 48 = 112 tokens (DataCollatorWithFlattening).
# `PYTHONPATH=. python tests/test_trainer_loop.py` measures them all and prints the table of docs/reference.md; the
# suite (slow) runs the packed batch with checkpointing (transformers' packed-sequence detection from position_ids),
# which the fast test's padded batch does not reach; the reentrant and eager cases are hand-checked above
GRID = [
    (dict(), S, B, "full", "none", 1),
    (dict(ga=2), S, B, "full", "none", 2),
    (dict(checkpointing=True), S, B, "full", "full", 1),
    (dict(batching="padded"), S, B, "padded", "none", 1),
    (dict(batching="packed"), 112, 1, "packed", "none", 1),
    (dict(batching="packed", checkpointing=True), 112, 1, "packed", "full", 1),
    (dict(checkpointing=True, use_reentrant=True), S, B, "full", "full", 1),
    (dict(attn="eager", batching="padded"), S, B, "padded", "none", 1),
]


def _grid_case(options, s, b, layout, recompute, microbatches):
    """(measured, predicted, predicted without the layout's and reentrancy's terms) of one GRID case."""
    from validation.trainer_loop import TrainerCase, measure_trainer

    m = measure_trainer(TrainerCase(**options)).peak_bytes
    attn, reentrant = options.get("attn", "sdpa"), bool(options.get("use_reentrant"))
    return (m, _predict(s, b, layout, recompute, microbatches, attn, reentrant),
            _predict(s, b, "full", recompute, microbatches, attn))


@pytest.mark.slow
@pytest.mark.parametrize("case", [GRID[5]], ids=["packed-checkpointing"])
def test_trainer_grid(case):
    pytest.importorskip("accelerate")
    measured, predicted, _ = _grid_case(*case)
    assert _within(predicted, measured), (predicted, measured)


if __name__ == "__main__":
    for case in GRID:
        m, p, p0 = _grid_case(*case)
        print(f"{case[0]}: measured {m:,} B, memplan {p:,} B ({(p - m) / m:+.3%}), without the terms {p0:,} B "
              f"({(p0 - m) / m:+.2%})")
