"""The HF Trainer's own loop, measured: ``transformers.Trainer.train()`` on CPU (``use_cpu=True``) on a tiny Llama.

The model is ``hf.build_model`` (transformers' LlamaForCausalLM from a config, bf16 weights: bf16-true, as the
``torch`` loop of validation/step.py). The Trainer runs its defaults unless the case says otherwise:
``optim`` ``adamw_torch_fused`` (transformers 5.23's default for torch >= 2.8, on CPU as on CUDA),
``max_grad_norm`` 1.0 (``clip_grad_norm_`` before the step), ``model.zero_grad()`` (set_to_none) after it,
``gradient_checkpointing`` through ``activation_checkpointing_enable`` (``use_reentrant=False`` unless the kwargs
say otherwise), the loss the model computes (ForCausalLMLoss, ``reduction="sum"`` divided by
``num_items_in_batch``, which the Trainer counts over all micro-batches of the step before the first one: the
loss is not divided again by ``gradient_accumulation_steps``).

Batches (``TrainerCase.batching``):

* ``"full"``: every row s tokens, no attention mask (``default_data_collator``).
* ``"padded"``: rows of different lengths padded to s with an ``attention_mask`` (zeros on the padding) and
  labels -100 there: a padded batch as ``DataCollatorWithPadding`` / ``DataCollatorForSeq2Seq`` give it.
* ``"packed"``: the same rows concatenated by ``DataCollatorWithFlattening`` (one row of sum(lengths) tokens,
  ``position_ids`` restarting at each sequence, no attention mask, -100 at each sequence's first label).

Measured: the Trainer's second optimizer step (from the end of step 1, so the batch fetch of step 2 is inside
the window, to the end of step 2), with validation/step.py's ``StepTracker`` (live bytes of storages created by
aten ops in the window, after every op) and its layer hooks for the labels; persistent bytes (weights, buffers,
optimizer states and step counters) are read off the tensors when the window opens. Labels: the layer hooks
give forward / backward per layer; the Trainer calls ``loss.backward()`` itself, so the loss's backward (down to
the last layer's output) stays labelled ``loss``; ``on_substep_end`` starts the next micro-batch and
``on_pre_optimizer_step`` the optimizer phase (gradient clipping is in the backward's last segment). Nothing here
computes a byte count from a formula.

    PYTHONPATH=. python -m validation.trainer_loop [--ga 2] [--checkpointing] [--batching packed]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from dataclasses import dataclass, field

import torch

from . import hf
from .step import LayerHooks, StepTracker, format_report, StepMeasurement, StepCase

BATCHINGS = ("full", "padded", "packed")


@dataclass(frozen=True)
class TrainerCase:
    """A tiny Llama trained by the HF Trainer. ``lengths``: the rows' token counts for ``padded`` / ``packed``
    (``b`` rows per micro-batch; None: s, s - s/4, ...); ``full`` rows are s long."""

    s: int = 64
    b: int = 2
    h: int = 64
    a: int = 4
    g: int = 2
    f: int = 160
    L: int = 2
    v: int = 256
    attn: str = "sdpa"
    ga: int = 1  # gradient_accumulation_steps
    checkpointing: bool = False  # gradient_checkpointing
    use_reentrant: bool | None = None  # gradient_checkpointing_kwargs (None: transformers' default)
    optim: str = "adamw_torch_fused"
    max_grad_norm: float = 1.0
    batching: str = "full"
    lengths: tuple[int, ...] | None = None
    seed: int = 0

    def row_lengths(self) -> tuple[int, ...]:
        if self.batching == "full":
            return (self.s,) * self.b
        return self.lengths or tuple(self.s - i * (self.s // 4) for i in range(self.b))

    def check(self) -> None:
        if self.batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {BATCHINGS}")
        lens = self.row_lengths()
        if len(lens) != self.b or max(lens) > self.s or min(lens) < 2:
            raise ValueError("lengths: b rows, each 2..s tokens")


def _rows(case: TrainerCase, n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(case.seed)
    lens = case.row_lengths()
    rows = []
    for i in range(n):
        k = lens[i % case.b]
        ids = torch.randint(0, case.v, (k,), generator=gen).tolist()
        if case.batching == "packed":
            rows.append({"input_ids": ids, "labels": list(ids)})
        elif case.batching == "padded":
            pad = case.s - k
            rows.append({"input_ids": ids + [0] * pad, "attention_mask": [1] * k + [0] * pad,
                         "labels": ids + [-100] * pad})
        else:
            rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


def _collator(case: TrainerCase):
    tf = hf._transformers()
    if case.batching == "packed":
        flat = tf.DataCollatorWithFlattening(return_position_ids=True)

        def packed(rows):
            # DataCollatorWithFlattening returns lists of Python ints where numpy is absent: tensors here
            out = flat(rows, return_tensors="pt")
            return {k: torch.as_tensor(v) for k, v in out.items()}
        return packed
    return tf.default_data_collator


def _persistent(model, optimizer) -> dict[str, int]:
    seen: set = set()

    def nbytes(tensors) -> int:
        n = 0
        for t in tensors:
            st = t.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                n += st.nbytes()
        return n

    states = [st for st in optimizer.state.values()]
    return {
        "weights": nbytes(model.parameters()),
        "buffers": nbytes(model.buffers()),
        "gradients": nbytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_states": nbytes(v for s in states for k, v in s.items() if k != "step" and torch.is_tensor(v)),
        "optimizer_steps": nbytes(s["step"] for s in states if torch.is_tensor(s.get("step"))),
    }


@dataclass
class _Window:
    layers: list
    tracker: StepTracker | None = None
    hooks: LayerHooks | None = None
    persistent: dict = field(default_factory=dict)
    mb: int = 0
    keep_ops: bool = False


def _callback(window: _Window):
    tf = hf._transformers()

    class Measure(tf.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == 1:  # open the window: step 2's batch fetch, micro-batches, optimizer
                gc.collect()
                window.persistent = _persistent(model, optimizer)
                window.tracker = StepTracker(sum(window.persistent.values()), keep_ops=window.keep_ops)
                window.hooks = LayerHooks(window.tracker, window.layers)
                window.tracker.__enter__()
            elif state.global_step == 2 and window.tracker is not None:
                window.tracker.set(phase="optimizer", layer=None, microbatch=None)
                window.tracker.__exit__(None, None, None)
                window.hooks.close()

        def on_substep_end(self, args, state, control, **kw):  # after a micro-batch that is not the last
            if window.tracker is not None:
                window.mb += 1
                window.tracker.set(phase="forward", layer=None, microbatch=window.mb)

        def on_pre_optimizer_step(self, args, state, control, **kw):
            if window.tracker is not None:
                window.tracker.set(phase="optimizer", layer=None, microbatch=None)
    return Measure()


def measure_trainer(case: TrainerCase, ops: bool = False) -> StepMeasurement:
    """Run ``Trainer.train()`` for two optimizer steps; measure the second (module docstring)."""
    case.check()
    tf = hf._transformers()
    torch.manual_seed(case.seed)
    model = hf.build_model(hf.HFCase(s=case.s, b=case.b, h=case.h, a=case.a, f=case.f, v=case.v, L=case.L,
                                     arch="llama", attn=case.attn, g=case.g, p_drop=0.0, backend="live"))
    layers = list(hf._base(model).layers)
    window = _Window(layers, keep_ops=ops)
    with tempfile.TemporaryDirectory(prefix="memplan-trainer-") as out:
        gc_kwargs = None if case.use_reentrant is None else {"use_reentrant": case.use_reentrant}
        args = tf.TrainingArguments(
            output_dir=out, use_cpu=True, per_device_train_batch_size=case.b, gradient_accumulation_steps=case.ga,
            max_steps=2, learning_rate=1e-4, weight_decay=0.01, optim=case.optim, max_grad_norm=case.max_grad_norm,
            gradient_checkpointing=case.checkpointing, gradient_checkpointing_kwargs=gc_kwargs,
            logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True, seed=case.seed,
            dataloader_num_workers=0)
        trainer = tf.Trainer(model=model, args=args, train_dataset=_rows(case, 2 * case.ga * case.b),
                             data_collator=_collator(case), callbacks=[_callback(window)])
        trainer.train()
        optimizer = trainer.optimizer
    tr = window.tracker
    phase, layer, mb, op = tr.peak_label
    total = sum(window.persistent.values())
    scase = StepCase(model="llama", attn=case.attn, s=case.s, b=case.b, h=case.h, a=case.a, L=case.L, v=case.v,
                     f=case.f, g=case.g, recompute="full" if case.checkpointing else "none",
                     optimizer="fused" if "fused" in case.optim else "foreach", microbatches=case.ga)
    notes = [f"torch {torch.__version__}", f"transformers {tf.__version__}", f"{case}",
             f"optimizer {type(optimizer).__name__} defaults {dict((k, v) for k, v in optimizer.defaults.items() if k in ('fused', 'foreach'))}"]
    return StepMeasurement(case=scase, persistent=window.persistent, persistent_total=total,
                           peak_bytes=total + tr.max_live, tracked_peak_bytes=total + tr.max_live, peak_phase=phase,
                           peak_layer=layer, peak_microbatch=mb, peak_op=op, timeline=tr.timeline(),
                           retained_after_forward=0, grad_bytes_at_end_of_backward=0, live_at_end=tr.live, ops=tr.ops,
                           notes=notes)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m validation.trainer_loop", description=__doc__.split("\n")[0])
    for name, default in (("s", 64), ("b", 2), ("h", 64), ("L", 2), ("v", 256), ("ga", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--reentrant", action="store_true", help="gradient_checkpointing_kwargs use_reentrant=True")
    p.add_argument("--optim", default="adamw_torch_fused")
    p.add_argument("--batching", choices=BATCHINGS, default="full")
    p.add_argument("--ops", action="store_true", help="the op-level log")
    p.add_argument("--lengths", type=int, nargs="*", default=None)
    ns = p.parse_args(argv)
    case = TrainerCase(s=ns.s, b=ns.b, h=ns.h, L=ns.L, v=ns.v, ga=ns.ga, attn=ns.attn, checkpointing=ns.checkpointing,
                       use_reentrant=True if ns.reentrant else None, optim=ns.optim, batching=ns.batching,
                       lengths=tuple(ns.lengths) if ns.lengths else None)
    print(format_report(measure_trainer(case, ops=ns.ops), ops=ns.ops))


if __name__ == "__main__":
    main()
