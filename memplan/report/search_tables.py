"""The rich output of `memplan search`: the listing of one model's plans (render_search), the best plan of
every preset (render_search_all) and the progress bar of a long search (DelayedProgress)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable, Optional

from rich.console import Console

if TYPE_CHECKING:  # the planner (and numpy) load only when a search runs
    from memplan.plan.search import SearchResult
from memplan.core.units import format_batch
from memplan.memory.offload import offloads
from memplan.report.escape import NOTE_LIMIT, markup
from memplan.report.tables import Col, compact, make_table
from memplan.report.text import (
    PLAN_LEGEND,
    format_gb,
    p_cell,
    pinned_techniques,
    plan_text,
    rec_cell,
    row_chunk,
    zero_cell,
)


def _folded_cell(listed: Any) -> str:
    """'+5 ZeRO', '+9 ZeRO +5 rec', '' (planner.FOLDING_RULE)."""
    parts = [f"+{n} {what}" for n, what in ((len(listed.zero_variants), "ZeRO"),
                                            (len(listed.recompute_variants), "rec")) if n]
    return " ".join(parts)


def _listing_heading(result: SearchResult, has_time: bool) -> str:
    count = len(result.listed())
    if not has_time:
        return f"{count} plans that fit (least memory first)"
    if result.sort == "memory":
        return f"{count} plans that fit, least device memory first"
    return f"fastest {count} plans that fit"


def render_search(result: SearchResult, console: Console) -> None:
    m = result.model
    where = f" {markup(result.gpu.name)}" if result.gpu else ""
    assumed = f" ({markup(result.gpu_assumed, NOTE_LIMIT)})" if result.gpu_assumed is not None else ""
    console.print(
        f"[bold]{markup(m.name)}[/] ({result.impl}) on {result.gpus}{where} GPUs{assumed}, {format_gb(result.budget_bytes)} per GPU, "
        f"global batch {format_batch(result.global_batch, m.seq_length)}: {result.candidates:,} plans evaluated in "
        f"{result.seconds:.2f} s, {result.feasible:,} fit"
        + (f" (and in {format_gb(result.host_budget_bytes)} of host memory per node)" if result.host_budget_bytes is not None
           else "") + pinned_techniques(result.training, "; every plan with")
    )
    has_time = result.evaluated.step_time_s is not None
    listing = result.listed()
    host = offloads(result.training)
    folded = any(x.zero_variants or x.recompute_variants for x in listing)
    if result.distinct_fit is not None and result.feasible and result.impl == "torchtitan":
        console.print(f"variants folded into {result.distinct_fit:,} rows: +n HSDP other dp_replicate x dp_shard "
                      "splits, +n AC AC modes no faster, no smaller (--all-variants lists them)")
    elif result.distinct_fit is not None and result.feasible:
        console.print(f"variants folded into {result.distinct_fit:,} rows: +n ZeRO other ZeRO stages / shard groups, "
                      "+n rec recompute choices no faster, no smaller (--all-variants lists them)")
    if listing and result.impl == "torchtitan":
        console.print(_titan_table(result, console, has_time, folded))
    elif listing:
        narrow = compact(console)
        extra = _cp_ep_columns(result)
        table = make_table(console, [Col(c, "right") for c in ("#", "t", "p", "d", *extra, "b", "m", "SP")]
                           + [Col("recompute", "right", short="rec"), Col("ZeRO", "right"),
                              Col("device memory", "right", short="memory"), Col("step time", "right", short="time"),
                              Col("MFU", "right")]
                           + ([Col("host memory per node", "right", short="host")] if host else [])
                           + ([Col("folded", "left")] if folded else []),
                           title=_listing_heading(result, has_time))
        for rank, x in enumerate(listing, 1):
            row = result.row(x.plan)
            chunk = row_chunk(row, m.num_layers)
            table.add_row(
                str(rank), str(row["tp"]), p_cell(row, m.num_layers), str(row["dp"]), *(str(row[c]) for c in extra),
                str(row["micro_batch"]), str(row["vpp"]), "on" if row["sp"] else "off", rec_cell(row, chunk, narrow), zero_cell(row),
                format_gb(row["memory"]["device_bytes"]),
                f"{row['step_time_s']:.2f} s" if has_time else "-", f"{row['mfu']:.1%}" if has_time else "-",
                *([format_gb(row["memory"]["host_bytes_per_node"])] if host else []),
                *([_folded_cell(x)] if folded else []),
            )
        console.print(table)
    else:
        console.print(f"[red]no plan fits in {format_gb(result.budget_bytes)}[/]")
    if result.nearest_miss is not None:
        row = result.row(result.nearest_miss)
        console.print(f"nearest miss: {plan_text(row, layers=m.num_layers)} {_miss(result, row)}")
    if result.fastest_miss is not None and has_time:
        row = result.row(result.fastest_miss)
        console.print(
            f"did not fit: {result.candidates - result.feasible:,} plans; the fastest of them, "
            f"{plan_text(row, layers=m.num_layers)} "
            f"({row['step_time_s']:.2f} s), {_miss(result, row)}"
        )
    elif result.candidates > result.feasible:
        console.print(f"did not fit: {result.candidates - result.feasible:,} plans")
    for note in result.notes:
        console.print(f"note: {markup(note, NOTE_LIMIT)}")


def _titan_table(result: SearchResult, console: Console, has_time: bool, folded: bool) -> Any:
    """The listing of `search --impl torchtitan`: torchtitan's dimensions (memplan/plan/titan.py titan_dims); cp
    where the search tried cp > 1; pp, the schedule and the pipeline's micro-batch size where it tried pp > 1 (the
    local batch then the pipeline's M micro-batches)."""
    cp, ep = _cp_ep_columns(result)[:1] == ("cp",), result.model.is_moe
    f8 = result.float8 is not None or result.training.float8 is not None  # searched or pinned
    p = result.evaluated.plans.p
    pp = bool(getattr(p, "max", lambda: p)() > 1)
    table = make_table(console, [Col("#", "right"), Col("dp_replicate", "right", short="rep"),
                                 Col("dp_shard", "right", short="shard"), Col("tp", "right")]
                       + [Col("cp", "right")] * cp + [Col("ep", "right")] * ep
                       + [Col("pp", "right"), Col("schedule", "right", short="sched"),
                          Col("micro-batch", "right", short="mb")] * pp + [
                                 Col("local batch", "right", short="b"), Col("AC", "right"), Col("compile", "right")]
                       + [Col("float8", "right")] * f8 + [
                                 Col("device memory", "right", short="memory"), Col("step time", "right", short="time"),
                                 Col("MFU", "right")] + ([Col("folded", "left")] if folded else []),
                       title=_listing_heading(result, has_time))
    for rank, x in enumerate(result.listed(), 1):
        row = result.row(x.plan)
        dims = row["torchtitan"]
        fold = _folded_cell(x).replace("ZeRO", "HSDP").replace("rec", "AC")
        keys = ("dp_replicate", "dp_shard", "tp") + ("cp",) * cp + ("ep",) * ep + ("pp", "pipeline_schedule",
                                                                    "pipeline_microbatch_size") * pp
        table.add_row(str(rank), *(str(dims[k]) if dims[k] is not None else "-" for k in keys),
                      *(str(dims[k]) for k in ("local_batch", "ac")),
                      ("async" if dims.get("async_tp") else "on") if dims["compile"] else "off",
                      *([dims["float8"] or "off"] * f8),
                      format_gb(row["memory"]["device_bytes"]),
                      f"{row['step_time_s']:.2f} s" if has_time else "-", f"{row['mfu']:.1%}" if has_time else "-",
                      *([fold] if folded else []))
    return table


def _cp_ep_columns(result: SearchResult) -> tuple[str, ...]:
    """The context- and expert-parallel columns a listing shows: cp when the search tried cp > 1, ep and etp for an
    MoE model (their row keys are the columns' names)."""
    plans = result.space.rows if result.space is not None else vars(result.evaluated.plans)
    cp = plans.get("cp", 1)
    tried_cp = bool(getattr(cp, "max", lambda: cp)() > 1)
    return ("cp",) * tried_cp + (("ep", "etp") if result.model.is_moe else ())


def _miss(result: SearchResult, row: dict[str, Any]) -> str:
    """Why a plan does not fit: its device memory over the budget, else its host memory per node over --host-mem."""
    need = row["memory"]["device_bytes"]
    if need > result.budget_bytes or need <= 0 or result.host_budget_bytes is None:
        return f"needs {format_gb(need)}, over by {format_gb(need - result.budget_bytes)}"
    host = row["memory"]["host_bytes_per_node"]
    return (f"needs {format_gb(need)} and {format_gb(host)} of host memory per node, over the {format_gb(result.host_budget_bytes)} of "
            f"--host-mem by {format_gb(host - result.host_budget_bytes)}")


def render_search_all(results: list[SearchResult], skipped: list[Any], console: Console,
                      gpu_given: bool = False, assumed: Iterable[str] = ()) -> None:
    """Every preset's best plan (the first of its listing), the GPU it was timed on (`assumed`: the
    models whose preset names no GPU), and the presets that could not be searched with the reason
    (planner.Skipped)."""
    assumed = set(assumed)
    if not results:
        return
    first = results[0]
    narrow = compact(console)
    gpus = list(dict.fromkeys(r.gpu.name if r.gpu else "-" for r in results))
    budgets = {r.budget_bytes for r in results}
    budget = f"{format_gb(first.budget_bytes)} per GPU" if len(budgets) == 1 else "each GPU's memory as the budget"
    if gpu_given:
        console.print(f"every preset on {first.gpus} {gpus[0]} GPUs (--gpu), {budget}:")
    else:
        console.print(f"every preset on {first.gpus} GPUs, each timed on its own preset's GPU (--gpu NAME sets one "
                      f"for all), {budget}:")
    best = "the least device memory" if first.sort == "memory" else "the fastest"
    console.print(f"best plan: {best} that fits" + (", variants folded" if first.folded else ""))

    def gpu_cell(r: SearchResult) -> str:
        name = markup(r.gpu.name) if r.gpu else "-"
        name = name if len(budgets) == 1 else f"{name} {format_gb(r.budget_bytes)}"
        return f"{name} (assumed)" if r.model.name in assumed else name

    if narrow and not gpu_given:  # the GPU column would not fit 80 columns: one line per GPU
        for cell in dict.fromkeys(gpu_cell(r) for r in results):
            console.print(f"on {cell}: {', '.join(markup(r.model.name) for r in results if gpu_cell(r) == cell)}")
    gpu_col = [] if narrow or gpu_given else [Col("GPU")]
    table = make_table(console, (Col("model", fold=True), *gpu_col, Col("plans", "right"), Col("fit", "right"),
                                 Col("best plan", fold=True), Col("memory", "right"),
                                 Col("step time", "right", short="time"), Col("MFU", "right")))
    for r in results:
        gpu = [gpu_cell(r)] if gpu_col else []
        if r.top:
            row = r.row(r.top[0])
            has_time = "step_time_s" in row
            table.add_row(markup(r.model.name), *gpu, f"{r.candidates:,}", f"{r.feasible:,}",
                          plan_text(row, r.model.num_layers if narrow else None),
                          format_gb(row["memory"]["device_bytes"]), f"{row['step_time_s']:.2f} s" if has_time else "-",
                          f"{row['mfu']:.1%}" if has_time else "-")
        else:
            row = r.row(r.nearest_miss)
            table.add_row(markup(r.model.name), *gpu, f"{r.candidates:,}", "[red]0[/]",
                          plan_text(row, r.model.num_layers) if narrow else f"nearest miss: {plan_text(row)}",
                          format_gb(row["memory"]["device_bytes"]), "-", "-")
    console.print(table)
    if narrow:
        misses = " fit 0: the plan shown is the nearest miss (the least memory)." if any(
            not r.top for r in results) else ""
        console.print(f"[dim]best plan: {PLAN_LEGEND}.{misses}[/]")
    defaulted = sorted({markup(r.gpu.name) for r in results if r.model.name in assumed and r.gpu})
    if defaulted and not gpu_given:
        console.print(f"(assumed): the preset names no GPU; timed on {', '.join(defaulted)}, memplan's default "
                      "(--gpu NAME sets one)")
    for s in skipped:
        console.print(f"skipped {s.model}" + (f" ({s.gpu})" if s.gpu else "") + f": {s.reason}")


class DelayedProgress:
    """A progress bar that appears only once a search has run for more than `delay` seconds."""

    def __init__(self, console: Console, delay: float = 1.0):
        self._time = time
        self.console, self.delay = console, delay
        self.start = time.perf_counter()
        self.bar = None
        self.task = None

    def __call__(self, done: int, total: int, label: Optional[str] = None) -> None:
        """`done` of `total` plans evaluated; `label` names what is searched (a preset and its GPU):
        a new label restarts the bar under that name."""
        description = f"evaluating plans of {label}" if label else "evaluating plans"
        if self.bar is None:
            if self._time.perf_counter() - self.start < self.delay:
                return
            from rich.progress import Progress

            self.bar = Progress(console=self.console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task(description, total=total)
        self.bar.update(self.task, completed=done, total=total, description=description)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
