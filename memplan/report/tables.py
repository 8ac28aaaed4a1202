"""The rich tables of `memplan estimate` (the retained memory, the step peak, the pipeline stages, host memory, the
limits) and of `memplan models`, and the console layout every rich table shares: the wide or the compact one by the
console's width (WIDE_MIN_WIDTH, compact, Col, make_table). The JSON / Markdown / CSV documents are in formats.py."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Optional

from rich import box
from rich.console import Console, JustifyMethod
from rich.padding import Padding
from rich.table import Table

if TYPE_CHECKING:
    from memplan.plan.estimate import Estimate
from memplan.core.units import format_batch, format_bytes_auto
from memplan.memory.offload import gpus_on_node
from memplan.memory.optimizers import states_label
from memplan.memory.reserved import EXPANDABLE_CONF
from memplan.memory.timeline import PART_LABELS
from memplan.plan.estimate import peak_reason, stage_rows
from memplan.plan.limits import cap_of
from memplan.plan.stage_verdict import RESERVED_RATIO
from memplan.report.escape import NOTE_LIMIT, markup
from memplan.report.text import (PLAN_LEGEND, bytes3, compact_plan, format_gb, fragmentation_label,
                                 pinned_techniques)
from memplan.timing.calibration import calibration


def _cite(source: str) -> str:
    """The short citation of a term's source (at most 28 characters): the work before a ':',
    'K22 section 4.1: QKV input 2sbh' -> 'K22 4.1', 'K22 section 4.1 without the dropout terms' ->
    'K22 4.1', 'FlashAttention-2 (Dao 2023) forward saves q, k, v, ...' -> 'FlashAttention-2 (Dao 2023)'."""
    section = re.match(r"K22 section [0-9.]*[0-9]", source)  # K22 and its section, whatever follows
    if section:
        return section.group(0).replace(" section ", " ")
    head = source.split(":")[0]
    cited = re.match(r"[^,(]*\([^)]*\)", head)  # a work and its (author year), before any list
    head = cited.group(0) if cited else head.split(",")[0]
    return head.replace(" section ", " ").replace("theoretical_memory_usage.py", "").strip()


# The compact layout's source column: the long names of works shortened (every citation then takes
# at most 11 characters), each explained in a line under the table when it appears.
SHORT_WORKS = (("FlashAttention-2 (Dao 2023)", "FlashAttn-2"), ("Transformer Engine / apex", "TE / apex"),
               ("transformers ", "HF "), ("torchtune ", "tune "), ("torchtitan ", "titan "))
SHORT_WORK_NAMES = {"FlashAttn-2": "FlashAttention-2 (Dao 2023)", "TE": "Transformer Engine",
                    "mcore": "megatron-core 0.16.1 (its local spec)",
                    "HF": "Hugging Face transformers", "tune": "torchtune", "titan": "torchtitan"}


def _short_cite(cite: str) -> str:
    """`_cite`'s citation with a long work name shortened: 'transformers 5.23.0' -> 'HF 5.23.0'."""
    for work, short in SHORT_WORKS:
        if cite.startswith(work):
            return short + cite[len(work):]
    return cite


# -- terminal tables: the wide layout, or the compact one on a narrow console ----------------------------

WIDE_MIN_WIDTH = 120
"""The narrowest console that gets the wide tables. Unwrapped they take 89 columns (a search of one
model) to 182 (validate --peak): estimate 126 for gpt3-530b (component names of up to 61
characters) and 177 for llama3-8b with flash attention, the search over every preset 124, models
170, validate 161. Piped output gets 150 (cli._console), where only the widest wrap a few rows;
below 120 (a terminal of 80 columns) rich would wrap nearly every row of most of them over 2 to 8
lines, so the tables take the compact layout instead: no vertical rules, one-space gaps, shorter
headers and condensed cells, every column but the main ones (a name, a plan, a formula) on one line."""


def compact(console: Console) -> bool:
    """Whether `console` is too narrow for the wide tables (see WIDE_MIN_WIDTH)."""
    return console.width < WIDE_MIN_WIDTH


class Col(NamedTuple):
    """A table column: its header and justification in both layouts, and in the compact one its
    shorter header, whether it may fold over lines (only a main column: a name, a plan or a
    formula) and its widest width (folding past it)."""

    header: str
    justify: JustifyMethod = "left"
    short: Optional[str] = None
    fold: bool = False
    max_width: Optional[int] = None
    style: Optional[str] = None


def make_table(console: Console, columns: Iterable[Col], title: Optional[str] = None,
               short_title: Optional[str] = None) -> Table:
    """The one place a table's box and column options are chosen, by the console's width: the wide
    layout (rich's default heavy box) at WIDE_MIN_WIDTH columns or more, otherwise the compact one
    (SIMPLE_HEAD, no edge, no padding: the 1-space column dividers are the gaps; columns other than
    the `fold` ones on one line, cut with an ellipsis if they must be)."""
    if not compact(console):
        table = Table(title=title)
        for c in columns:
            table.add_column(c.header, justify=c.justify, style=c.style)
        return table
    table = Table(title=short_title or title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=0)
    for c in columns:
        table.add_column(c.header if c.short is None else c.short, justify=c.justify, style=c.style,
                         no_wrap=not c.fold, overflow="fold" if c.fold else "ellipsis", max_width=c.max_width)
    return table


def _gpu_states_label(training: Any) -> str:
    """The optimizer row's label; with optimizer offload, what share stays on the GPU."""
    fraction = training.offload_optimizer_fraction
    label = states_label(training)
    return label if not fraction else f"{label}, the {1 - fraction:.0%} not offloaded"


def _term_cell(name: str, narrow: bool) -> Any:
    """A term's name indented under 'activations'; in the compact layout a folded name keeps the indent."""
    return Padding(name, (0, 0, 0, 2)) if narrow else f"  {name}"


def render_estimate(est: Estimate, console: Console) -> None:
    c, peak = est.config, est.peak
    m, par, tr = c.model, c.parallel, c.training
    console.print(
        f"[bold]{markup(m.name)}[/]: L={m.num_layers} h={m.hidden_size} a={m.num_attention_heads} "
        + (f"latent attention r_kv={m.kv_lora_rank} r_q={m.q_lora_rank} d_qk={m.qk_nope_head_dim}+"
           f"{m.qk_rope_head_dim} d_v={m.v_head_dim} " if m.is_mla else
           f"q={m.q} (head_dim {m.head_dim}) " if m.q != m.hidden_size else "")
        + (f"E={m.num_experts} top-{m.moe_top_k} f_e={m.fe} " if m.is_moe else "")
        + f"s={m.seq_length} v={m.vocab_size}, {est.total_params / 1e9:,.1f} billion parameters"
        + (f" ({est.active_params / 1e9:,.1f} billion active per token)" if m.is_moe else "")
    )
    console.print(
        f"plan: t={par.tp} p={par.pp} d={par.dp} m={par.vpp} SP={'on' if par.sp else 'off'} "
        f"recompute={tr.recompute.label} ZeRO={par.zero}"
        f"{f' over {par.shard} ranks' if par.zero and par.shard < par.dp else ''} b={tr.micro_batch} "
        f"global batch={format_batch(c.global_batch, m.seq_length)} ({c.num_microbatches} micro-batches per step) "
        f"on {par.gpus} GPUs{pinned_techniques(tr)}"
        + (f"; GPU {markup(est.gpu.name)} ({markup(est.gpu_assumed, NOTE_LIMIT)})" if est.gpu_assumed is not None else "")
    )
    console.print(
        f"activations per layer per micro-batch on one GPU: {est.per_layer_symbolic} = "
        f"{format_bytes_auto(est.per_layer_bytes)}" + ("  [dim](paper-only view)[/]" if est.paper_only else "")
    )

    # Compact: the per-layer formula folds at its '+' past 10 columns and the activations row leaves
    # its formula to the line above; copies are headed 'x' (per layer x copies = bytes), bytes have 3
    # digits, long work names in the source column are shortened (SHORT_WORKS).
    narrow = compact(console)
    gb, auto = (bytes3, bytes3) if narrow else (format_gb, format_bytes_auto)
    table = make_table(console, (Col("component", fold=True), Col("per layer", "right", fold=True, max_width=10),
                                 Col("copies", "right", short="x"), Col("bytes", "right"), Col("share", "right"),
                                 Col("source", style="dim")),
                       title=f"Memory retained at the first backward, one GPU of stage {est.most_loaded} (the most "
                             f"loaded of {par.pp})",
                       short_title=f"Retained at the first backward, one GPU of stage {est.most_loaded} (most "
                                   f"loaded of {par.pp})")
    total = peak.total
    for label, value in (("weights", peak.weights), ("gradients", peak.gradients),
                         (_gpu_states_label(tr), peak.optimizer)):
        table.add_row(label, "", "", gb(value), f"{value / total:.1%}", "")
    table.add_row("[bold]activations[/]", "" if narrow else est.per_layer_symbolic, "", gb(peak.activations),
                  f"{peak.activations / total:.1%}", "")
    cites = [_cite(r.term.source) for r in est.rows]
    if narrow:
        cites = [_short_cite(c) for c in cites]
    for r, cite in zip(est.rows, cites):
        mark = "" if r.term.in_k22 else " *"
        table.add_row(_term_cell(f"{markup(r.term.name, None)}{mark}", narrow), r.symbolic, str(r.copies), auto(r.stage_bytes),
                      f"{r.stage_bytes / total:.1%}", cite)
    if peak.recompute_working_bytes:
        table.add_row(_term_cell("recompute working set (one layer, transient) *", narrow), "", "1",
                      auto(peak.recompute_working_bytes), f"{peak.recompute_working_bytes / total:.1%}", "memplan")
    table.add_row("[bold]retained at the first backward[/]", "", "", f"[bold]{gb(total)}[/]",
                  "100%" if narrow else "100.0%", "")
    console.print(table)
    if any(not r.term.in_k22 for r in est.rows):
        console.print("[dim]* not in K22: stored by real implementations; --paper-only leaves them out[/]")
    used = [f"{short} = {name}" for short, name in SHORT_WORK_NAMES.items()
            if any(re.match(rf"{re.escape(short)}\b", c) for c in cites)]
    if narrow and used:
        console.print("[dim]sources: " + "; ".join(used) + "[/]")
    for note in est.notes:
        console.print(f"note: {markup(note, NOTE_LIMIT)}")
    if est.perf is not None:
        p = est.perf
        cal = calibration(est.config.model, est.gpu, est.inventory.name.split("/")[0], est.config.training.fp8)
        calibrated = p.calibrated and cal.calibrated  # p: the kernels step_time modelled
        spread = f" ± {p.uncertainty:.0%}" if calibrated else ""
        label = "" if calibrated else f"[yellow]{cal.note or 'uncalibrated'}[/]; "
        console.print(
            f"step time {p.step_time_s:.2f} s{spread} on {markup(est.gpu.name)} ({label}{p.tokens_per_s:,.0f} tokens/s, "
            f"MFU {p.mfu:.1%}): compute {p.compute_s:.2f} s, memory-bound {p.memory_s:.2f} s, recompute "
            f"{p.recompute_s:.2f} s, pipeline bubble {p.bubble_s:.2f} s ({p.bubble_share:.1%} of the step), TP comm "
            f"exposed {p.tp_comm_exposed_s:.2f} s, DP comm exposed {p.dp_comm_exposed_s:.2f} s, PP sends {p.pp_comm_s:.2f} s"
            + (f", host copies {p.host_copy_s:.2f} s (offload, exposed)" if p.host_copy_s else "")
            + (f", CP / EP comm exposed {p.cp_ep_comm_exposed_s:.2f} s" if p.cp_ep_comm_exposed_s else "")
        )
    render_peak(est, console)
    if est.budget_bytes is not None:
        where = f" ({markup(est.gpu.name)})" if est.gpu is not None else ""
        head = est.headroom_bytes
        fragmentation = ("the replayed fragmentation" if est.device.replayed else
                         f"{est.device.margin:.0%} fragmentation margin")
        margin = f"allocated peak + {fragmentation} + runtime = {format_gb(est.device.total)}"
        if head >= 0:
            console.print(f"[green]fits[/] in {format_gb(est.budget_bytes)}{where}: {margin}, {format_gb(head)} headroom "
                          f"on stage {est.decided}")
        else:
            console.print(f"[red]does not fit[/] in {format_gb(est.budget_bytes)}{where}: {margin}, over by "
                          f"{format_gb(-head)} on stage {est.decided}")
    else:
        console.print("no fit verdict: give --mem SIZE or --gpu NAME")
    render_replay(est, console)
    render_host(est, console)


def render_replay(est: Estimate, console: Console) -> None:
    """The caching allocator's replay of the deciding stage's run: what it reserved, or where the run dies; with
    several stages, what each stage's replay reserved."""
    r = est.reserved
    if r is None:
        return
    res = r.result
    what = (f"caching allocator ({markup(r.label)}; the run of stage {r.stage} replayed, {r.events:,} allocations and "
            "frees; derived, not measured)")
    if len(est.stage_verdicts) > 1:
        render_stage_replays(est, console)
    if r.fits:
        console.print(f"{what}: reserved peak {format_gb(res.reserved_peak_bytes)} of {may_take(r.capacity_bytes)}, "
                      f"{format_gb(res.inactive_split_bytes_at_reserved_peak)} free inside its segments "
                      f"(inactive split), {res.segments_at_reserved_peak:,} segments")
        return
    e = r.oom_event
    console.print(f"[red]{what}: the run dies[/] in {markup(e['phase'])} allocating {markup(e['name'], None)} "
                  f"({format_gb(e['requested_bytes'])}): {format_gb(e['reserved_bytes'])} reserved, "
                  f"{format_gb(e['allocated_bytes'])} allocated, of {may_take(r.capacity_bytes)}")
    if r.expandable_fits:
        console.print(f"with expandable segments the run fits: export PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_CONF}")


def may_take(capacity_bytes: int) -> str:
    """The memory the allocator may take; a budget below what lives outside PyTorch's pool leaves it none."""
    if capacity_bytes >= 0:
        return f"{format_gb(capacity_bytes)} it may take"
    return (f"0 GB it may take (the budget is {format_gb(-capacity_bytes)} short of what lives outside PyTorch's pool: "
            "CUDA context, kernels, NCCL)")


def render_stage_replays(est: Estimate, console: Console) -> None:
    """One line on every stage's replay (plan/stage_verdict.py): the runs that die, those that complete (their
    reserved peaks; more than four: the range), the stages that stood on another's identical run, those not
    replayed, and the stage that decides."""
    runs = [v for v in est.stage_verdicts if v.reserved is not None and v.same_as is None]
    done = [v for v in runs if not v.dies]
    peak = {v.stage: v.reserved.result.reserved_peak_bytes for v in done}
    parts = [f"stage {v.stage} dies in {markup(v.reserved.oom_event['phase'])}" for v in runs if v.dies]
    if len(done) > 4:
        low, high = min(peak, key=peak.get), max(peak, key=peak.get)
        parts.append(f"{_stage_list(sorted(peak))} complete, reserved peaks {format_gb(peak[low])} (stage {low}) to "
                     f"{format_gb(peak[high])} (stage {high})")
    else:
        parts += [f"stage {i} reserved peak {format_gb(b)}" for i, b in peak.items()]
    parts += [f"stage {v.stage} as stage {v.same_as} (the same run)" for v in est.stage_verdicts
              if v.same_as is not None]
    skipped = [v.stage for v in est.stage_verdicts if v.reserved is None]
    if skipped:
        parts.append(f"{_stage_list(skipped)} not replayed ({RESERVED_RATIO[0] / RESERVED_RATIO[1]:g} x allocated peak + "
                     "runtime within the budget)")
    console.print("the stages' runs (plan/stage_verdict.py): " + "; ".join(parts) + f"; stage {est.decided} decides")


def _stage_list(stages: list[int]) -> str:
    """"stage 4", "stages 1, 2", "stages 5-34" (runs of consecutive stages as ranges)."""
    runs: list[list[int]] = []
    for i in stages:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
    return ("stage " if len(stages) == 1 else "stages ") + text


def render_host(est: Estimate, console: Console) -> None:
    """Host memory the offload takes (per GPU, per node) and its verdict against --host-mem."""
    h = est.host
    if h.total:
        parts = [(h.optimizer, "optimizer states"), (h.staging, "pinned staging"), (h.activations, "saved activations"),
                 (h.weights, "weights the layers save")]
        n = gpus_on_node(est.config.parallel.gpus, est.gpu.gpus_per_node if est.gpu is not None else 8)
        console.print(f"host memory (offload): {format_gb(est.host_bytes_per_node)} per node = {n} GPU{'s' if n != 1 else ''} "
                      f"x {format_gb(h.total)} ("
                      + " + ".join(f"{label} {format_gb(v)}" for v, label in parts if v) + ")")
    if est.host_budget_bytes is None:
        return
    per_node = est.host_bytes_per_node
    if est.fits_host:
        console.print(f"[green]fits host memory[/]: {format_gb(per_node)} per node of {format_gb(est.host_budget_bytes)} "
                      "(--host-mem)")
    else:
        console.print(f"[red]does not fit host memory[/]: {format_gb(per_node)} per node, over the "
                      f"{format_gb(est.host_budget_bytes)} of --host-mem by {format_gb(per_node - est.host_budget_bytes)}")


def render_limits(limits: dict[str, Any], est: Estimate, console: Console) -> None:
    """`--max-seq` / `--max-micro-batch` answers."""
    words = {"max_seq_len": ("longest sequence length", "tokens"), "max_micro_batch": ("largest micro-batch", "sequences")}
    for key, value in limits.items():
        what, unit = words[key]
        if value is None:
            console.print(f"[red]{what}: none fits[/] in {format_gb(est.budget_bytes)} with this plan")
        else:
            cap = cap_of(key, value, est.config)
            console.print(f"{what} that fits in {format_gb(est.budget_bytes)} with this plan: [bold]{value:,}[/] {unit}"
                          + (f" (memplan's cap of {cap:,}: the plan fits there, longer ones are not tried, so this "
                             "is no fit limit)" if cap is not None else ""))


def _where(e: Any) -> str:
    return f"{e.phase}{f' of layer {e.layer}' if e.layer is not None else ''}: {e.moment}"


def render_peak(est: Estimate, console: Console) -> None:
    """The step's peak on the most loaded GPU: persistent and transient memory apart, what the
    device adds, and the largest moment of each phase."""
    step, dev = est.decided_step, est.device
    e = step.peak_event
    table = make_table(console, (Col("component", fold=True), Col("bytes", "right"), Col("kind")),
                       title=f"Peak of a training step on one GPU of stage {est.decided}, at {_where(e)}",
                       short_title=f"Step peak, one GPU of stage {est.decided}, at {_where(e)}")
    # ZeRO-3 / FSDP: the shards persist, the unsharded units are in flight (the peak moment's, memory/stage.py)
    kinds = {"weights": "persistent" if est.config.parallel.zero < 3 else "shards + in flight", "optimizer": "persistent",
             "gradients": "persistent" if est.inventory.grad_lifetime == "buffer" else "step",
             "saved": "step", "transient": "transient"}
    for k, kind in kinds.items():
        label = (_gpu_states_label(est.config.training) if k == "optimizer" else PART_LABELS[k]) + (
            " alive" if kind == "step" else "")
        table.add_row(label, format_gb(e.parts[k]), kind)
    table.add_row("[bold]peak of the step's tensors[/]", f"[bold]{format_gb(step.peak_bytes)}[/]", "")
    table.add_row("cuBLAS workspaces (forward, backward; in PyTorch's pool)", format_gb(dev.workspace_bytes), "runtime")
    table.add_row("[bold]allocated peak[/] (torch.cuda.max_memory_allocated)", f"[bold]{format_gb(dev.allocated_peak)}[/]",
                  "")
    table.add_row(fragmentation_label(dev), format_gb(dev.fragmentation_bytes), "allocator")
    table.add_row("CUDA context, kernels, NCCL (outside PyTorch)", format_gb(dev.runtime_bytes - dev.symm_workspace_bytes),
                  "runtime")
    if dev.symm_workspace_bytes:  # torchtitan's async TP (memplan/inventory/titan_async_tp.py)
        table.add_row("async TP symmetric-memory workspace (outside PyTorch's pool; derived)",
                      format_gb(dev.symm_workspace_bytes), "runtime")
    table.add_row("[bold]device memory needed[/]", f"[bold]{format_gb(dev.total)}[/]", "")
    console.print(table)
    phases: dict[str, Any] = {}
    for ev in step.events:
        if ev.bytes and (ev.phase not in phases or ev.bytes > phases[ev.phase].bytes):
            phases[ev.phase] = ev
    console.print("largest moment of each phase: " + "; ".join(
        f"{p} {format_gb(ev.bytes)}{f' (layer {ev.layer})' if ev.layer is not None else ''}" for p, ev in phases.items()))
    if est.config.parallel.pp > 1:
        render_stages(est, console)
        low = min(range(len(est.steps)), key=lambda i: est.steps[i].peak_bytes)
        console.print(f"stage peaks from {format_gb(est.steps[low].peak_bytes)} (stage {low}) to "
                      f"{format_gb(est.step.peak_bytes)} (stage {est.most_loaded}); the last stage "
                      f"{format_gb(est.steps[-1].peak_bytes)} (--json: memory.stage_peak_bytes)")


STAGE_TABLE_ROWS = 12  # more stages: the first three, the peak and the last two (--json lists every one)


def render_stages(est: Estimate, console: Console) -> None:
    """Every pipeline stage, one GPU each: layers, activation sets in flight, states, saved activations, step peak;
    then why the peak stage is the peak."""
    rows = stage_rows(est)
    shown = list(range(len(rows)))
    if len(rows) > STAGE_TABLE_ROWS:
        shown = sorted({0, 1, 2, est.most_loaded, len(rows) - 2, len(rows) - 1})
    table = make_table(console, (Col("stage", "right"), Col("layers", "right"), Col("in flight", "right", short="fl"),
                                 Col("layer sets", "right", short="sets"), Col("states", "right"),
                                 Col("activations", "right", short="acts"), Col("step peak", "right", short="peak"),
                                 Col("peak at", fold=True)),
                       title="Every pipeline stage, one GPU each (in flight: model chunks at the first backward)",
                       short_title="Pipeline stages, one GPU each")
    previous = -1
    for i in shown:
        r = rows[i]
        if i > previous + 1:
            table.add_row("...", "", "", "", "", "", "", "")
        mark = "[bold]" if i == est.most_loaded else ""
        end = "[/]" if mark else ""
        table.add_row(f"{mark}{r.stage}{end}", str(r.layers), str(r.chunks), str(r.layer_copies), format_gb(r.states_bytes),
                      format_gb(r.activations_bytes), f"{mark}{format_gb(r.peak_bytes)}{end}", r.peak_at)
        previous = i
    console.print(table)
    console.print(peak_reason(est))


def render_models(rows: list[dict[str, Any]], console: Console) -> None:
    narrow = compact(console)
    table = make_table(console, [Col("name", fold=True)] + [Col(c, "right") for c in ("L", "h", "a")]
                       + [Col("kv heads", "right", short="kv")] + [Col(c, "right") for c in ("s", "v")]
                       + [Col("params", "right"), Col("default plan", fold=True)],
                       title="model presets", short_title="model presets (params in billions)")
    for r in rows:
        table.add_row(markup(r["name"]), str(r["L"]), str(r["h"]), str(r["a"]), str(r["g"]), str(r["s"]),
                      str(r["v"]), _billions(r["params"], narrow),
                      compact_plan(_plan_fields(r["plan"])) if narrow else r["plan"])
    console.print(table)
    if narrow:
        console.print(f"[dim]default plan: {PLAN_LEGEND}[/]")


def _billions(params: int, narrow: bool) -> str:
    """A parameter count in billions: '529.6 billion'; compact, without the unit (in the title) and, from 1,000
    billion on, without the tenths (the header's width)."""
    if not narrow:
        return f"{params / 1e9:,.1f} billion"
    return f"{params / 1e9:,.1f}" if params < 1e12 else f"{params / 1e9:,.0f}"


def _plan_fields(text: str) -> dict[str, str]:
    """'tp=8 pp=64 sp=True' -> {'tp': '8', 'pp': '64', 'sp': 'True'} (`memplan models`' plan)."""
    return dict(item.partition("=")[::2] for item in text.split())

