"""The rich output of `memplan validate`: memplan against the measured saved tensors (render_validation)
and against the measured peak of a training step (render_peak_validation)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from memplan.report.tables import Col, compact, make_table
from memplan.report.text import RECOMPUTE_SHORT, bytes3


def render_validation(results: list[Any], summary: dict[str, Any], console: Console, terms: bool = False) -> None:
    # Compact: one row of a bold implementation name above its cases instead of an impl column, the
    # measured bytes to 3 digits and memplan's error against them (the exact bytes of both: --json).
    narrow = compact(console)
    text = ("impl", "case", "scope", "recompute", "backend")
    short = {"recompute": "rec", "result": ""}  # PASS / FAIL speak for themselves
    columns = [Col(c, "left" if c in text else "right", short=short.get(c), fold=c == "case")
               for c in ("impl", "case", "scope", "t", "SP", "recompute", "backend", "memplan", "measured", "error",
                         "K22 only", "result") if not (narrow and c in ("impl", "memplan"))]
    table = make_table(console, columns, title="memplan vs measured saved tensors (bytes per rank)",
                       short_title="memplan's error against the measured saved tensors (bytes per rank)")
    impl = None
    for r in results:
        c = r.case
        verdict = "[green]PASS[/]" if r.passed else "[red]FAIL[/]"
        if not narrow:
            table.add_row(c.impl, c.name, c.scope, str(c.t), "on" if c.sp else "off", c.recompute, c.backend,
                          f"{r.predicted_total:,} B", f"{r.measured_total:,} B", f"{r.error:.4%}",
                          f"{r.paper_total:,} B", verdict)
            continue
        if c.impl != impl:
            impl = c.impl
            table.add_row(f"[bold]{impl}[/]")
        table.add_row(c.name, c.scope, str(c.t), "on" if c.sp else "off", RECOMPUTE_SHORT.get(c.recompute, c.recompute),
                      c.backend, bytes3(r.measured_total), f"{r.error:.4%}", bytes3(r.paper_total), verdict)
    console.print(table)
    for r in results:
        if terms or not r.passed:
            detail = make_table(console, (Col("term", fold=True), Col("memplan", "right"), Col("measured", "right"),
                                          Col("difference", "right")),
                                title=f"{r.case.name} {r.case.scope} t={r.case.t} SP={'on' if r.case.sp else 'off'} "
                                      f"{r.case.recompute} ({r.case.backend})")
            for label, pred, meas in r.term_rows():
                style = "" if pred == meas else "[red]"
                detail.add_row(f"{style}{label}", f"{pred:,} B", f"{meas:,} B", f"{pred - meas:+,} B")
            console.print(detail)
    console.print(
        f"{summary['passed']} passed, {summary['failed']} failed; largest error {summary['largest_error']:.4%} "
        f"(tolerance of a case's activation bytes: 0.1% for the reference layer, 1% for transformers, 0.01% for megatron-core)"
    )


PHASE_SHORT = (("forward", "fwd"), ("backward", "bwd"), ("optimizer", "opt"))


def _peak_at(predicted_at: str, measured_at: str) -> str:
    """The compact layout's 'peak at': 'bwd 2' where memplan and the measurement agree, else
    'loss / bwd 2' (memplan / measured)."""
    def short(at: str) -> str:
        for word, abbr in PHASE_SHORT:
            at = at.replace(word, abbr)
        return at

    return short(predicted_at) if predicted_at == measured_at else f"{short(predicted_at)} / {short(measured_at)}"


def _optimizer_cell(case: Any) -> str:
    """A peak case's optimizer: its implementation alone for AdamW ('foreach'), else both ('adafactor for-loop')."""
    algorithm = getattr(case, "algorithm", "adamw")
    return case.optimizer if algorithm == "adamw" else f"{algorithm} {case.optimizer}"


def render_peak_validation(results: list[Any], summary: dict[str, Any], console: Console) -> None:
    # Compact: impl alone (it decides the loop: torch runs the Megatron-like one, hf-* torch's), the
    # measured peak to 3 digits with memplan's error against it, and 'peak at' once where both agree.
    narrow = compact(console)
    short = {"loop": "impl", "recompute": "rec", "backend": "via", "peak at (memplan / measured)": "peak at",
             "result": ""}
    # 'adafactor for-loop' folds at 80 columns rather than squeezing the case names
    widths = {"peak at (memplan / measured)": 7, "optimizer": 9 if narrow else None}
    columns = [Col(c, "right" if c in ("b", "M", "memplan", "measured", "error") else "left", short=short.get(c),
                   fold=c in ("case", "optimizer", "peak at (memplan / measured)"),
                   max_width=widths.get(c))  # 'bwd 12'; 'loss / bwd 2' folds
               for c in ("case", "loop", "recompute", "optimizer", "b", "M", "backend", "memplan", "measured", "error",
                         "peak at (memplan / measured)", "result") if not (narrow and c == "memplan")]
    table = make_table(console, columns,
                       title="memplan vs measured allocated peak of a training step (second step, CPU live-storage "
                             "tracker; fake = FakeTensorMode)",
                       short_title="memplan's error against the measured allocated peak of a training step")
    for r in results:
        c = r.case
        verdict = "[green]PASS[/]" if r.passed else "[red]FAIL[/]"
        if narrow:
            table.add_row(c.name, c.impl, RECOMPUTE_SHORT.get(c.recompute, c.recompute), _optimizer_cell(c), str(c.b),
                          str(c.microbatches), c.backend, bytes3(r.measured), f"{r.error:+.3%}",
                          _peak_at(r.predicted_at, r.measured_at), verdict)
        else:
            table.add_row(c.name, f"{c.loop} ({c.impl})", c.recompute, _optimizer_cell(c), str(c.b), str(c.microbatches),
                          c.backend, f"{r.predicted:,} B", f"{r.measured:,} B", f"{r.error:+.3%}",
                          f"{r.predicted_at} / {r.measured_at}", verdict)
    console.print(table)
    if narrow:
        console.print("peak at: phase and layer (1 = the first of the chunk) where the step peaks, memplan / measured "
                      "where they differ (fwd, bwd, opt: forward, backward, optimizer); M: micro-batches; via: live "
                      "storages, FakeTensorMode (fake) or CUDA")
    else:
        console.print("peak at: phase and layer (1 = the first of the chunk) where the step peaks")
    console.print(f"{summary['passed']} passed, {summary['failed']} failed; largest error "
                  f"{summary['largest_error']:.3%} (tolerance {summary['tolerance']:.0%} of the measured peak)")


def render_allocator_validation(results: list[Any], max_seq: list[Any], summary: dict[str, Any],
                                console: Console) -> None:
    """`validate --allocator`: each run's recorded allocation stream and memplan's own stream of it, replayed through
    memplan's caching-allocator model; on CUDA, the allocator's own figures and memplan's longest sequence."""
    cuda = any(r.measured for r in results)
    columns = [Col("case", "left", fold=True), Col("allocator", "left", short="alloc"),
               Col("events (run / memplan)", "right", short="events"),
               Col("live peak (run)", "right", short="live"), Col("memplan's peak vs the run", "right", short="error"),
               Col("reserved: run replayed", "right", short="res. run"),
               Col("reserved: memplan replayed", "right", short="res. memplan")]
    if cuda:
        columns.append(Col("reserved: measured", "right", short="res. measured"))
    columns.append(Col("result", "left", short=""))
    device = "CUDA: torch.cuda.memory._snapshot()" if cuda else "CPU: live-storage tracker, op outputs"
    table = make_table(console, columns,
                       title=f"allocation streams of real runs ({device}) and memplan's, through memplan's "
                             "caching-allocator model",
                       short_title="real runs' allocation streams through memplan's allocator model")
    for r in results:
        cells = [r.case.name, r.allocator, f"{r.recorded_events:,} / {r.memplan_events:,}",
                 f"{r.recorded_live_peak:,} B", f"{r.peak_error:+.3%}", f"{r.recorded.reserved_peak_bytes:,} B",
                 f"{r.memplan.reserved_peak_bytes:,} B"]
        if cuda:
            cells.append(f"{r.measured['max_memory_reserved']:,} B")
        cells.append("[green]PASS[/]" if r.passed else "[red]FAIL[/] " + ", ".join(k for k, v in r.checks.items()
                                                                                 if not v))
        table.add_row(*cells)
    console.print(table)
    if not cuda:
        console.print("CPU: no caching allocator runs; the recorded order is the real code's (op outputs, CPU kernels), "
                      "both reserved figures are memplan's model replaying it (derived). --device cuda records "
                      "torch.cuda.memory._snapshot() and checks the replay against max_memory_reserved.")
    for m in max_seq:
        what = ("memplan: no length fits" if m.tried is None else
                f"memplan {m.predicted:,} tokens; {m.tried:,} {'trains' if m.trains else 'dies'}, "
                f"{m.longer:,} {'dies' if m.next_dies else 'trains'}")
        console.print(f"longest sequence, {m.case.name} ({m.allocator}): {what}: "
                      + ("[green]PASS[/]" if m.passed else "[red]FAIL[/]"))
    console.print(f"{summary['cases'] - summary['failed']} of {summary['cases']} passed")
