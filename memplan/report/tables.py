"""The only module that imports rich: tables for the terminal, plain dicts for JSON."""

from __future__ import annotations

import csv
import json
import re
import sys
import time
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Optional

from rich import box
from rich.console import Console, JustifyMethod
from rich.padding import Padding
from rich.table import Table

if TYPE_CHECKING:  # the planner (and numpy) load only when a search runs
    from memplan.plan.estimate import Estimate
    from memplan.plan.search import SearchResult
from memplan.core.specs import Config
from memplan.core.units import format_batch, format_bytes, format_bytes_auto
from memplan.memory.offload import gpus_on_node, offloads
from memplan.memory.optimizers import states_label
from memplan.memory.timeline import PART_LABELS, optimizer_impl
from memplan.plan.estimate import peak_reason, stage_rows
from memplan.timing.perf import calibration


def _gb(n: int) -> str:
    return format_bytes(n, "GB")


def _bytes3(n: int) -> str:
    """Bytes to 3 significant digits in the largest decimal unit that keeps them >= 1 (the compact
    layout): '524 KB', '1.07 GB', '16.1 GB', '512 B'."""
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= factor * 0.9995:  # what rounds up to 1.00 takes the larger unit
            x = n / factor
            return f"{x:.2f} {unit}" if abs(x) < 9.995 else f"{x:.1f} {unit}" if abs(x) < 99.95 else f"{x:.0f} {unit}"
    return f"{int(n)} B"


def config_dict(config: Config) -> dict[str, Any]:
    return {
        "model": config.model.model_dump(),
        "parallel": config.parallel.model_dump(),
        "training": {**config.training.model_dump(), "recompute": config.training.recompute.label},
        "global_batch": config.global_batch,
        "num_microbatches": config.num_microbatches,
        "gpus": config.parallel.gpus,
    }


def estimate_dict(est: Estimate) -> dict[str, Any]:
    peak = est.peak
    out: dict[str, Any] = {
        "plan": est.config.plan_summary(),
        "config": config_dict(est.config),
        "inventory": est.inventory.name,
        "inventory_origin": est.inventory.origin or None,
        "impl": est.inventory.name.split("/")[0],  # names are impl/attention/device or impl/device
        "optimizer": {"name": est.config.training.optimizer,
                      "impl": optimizer_impl(est.config.training, est.inventory),
                      "label": states_label(est.config.training)},
        "paper_only": est.paper_only,
        "params": {"total": est.total_params, "most_loaded_gpu": int(peak.params)},
        "most_loaded_stage": est.most_loaded,
        "memory": {
            "weights_bytes": int(peak.weights),
            "gradients_bytes": int(peak.gradients),
            "optimizer_bytes": int(peak.optimizer),
            "activations_bytes": int(peak.activations),
            "total_bytes": int(peak.total),
        },
        "activations": {
            "per_layer_bytes": int(est.per_layer_bytes),
            "per_layer_symbolic": est.per_layer_symbolic,
            "recompute_working_bytes": int(peak.recompute_working_bytes),
            "terms": [
                {
                    "id": r.term.id,
                    "name": r.term.name,
                    "block": r.term.block,
                    "symbolic": r.symbolic,
                    "bytes": int(r.bytes),
                    "copies": int(r.copies),
                    "stage_bytes": int(r.stage_bytes),
                    "share": r.share,
                    "in_k22": r.term.in_k22,
                    "source": r.term.source,
                }
                for r in est.rows
            ],
        },
        "stages": [
            {
                "stage": s.stage,
                "layers": int(s.layers),
                "params": int(s.params),
                "weights_bytes": int(s.weights),
                "gradients_bytes": int(s.gradients),
                "optimizer_bytes": int(s.optimizer),
                "activations_bytes": int(s.activations),
                "total_bytes": int(s.total),
            }
            for s in est.stages
        ],
        "notes": est.notes,
    }
    out["memory"].update(peak_dict(est))
    h = est.host
    out["host"] = {"optimizer_bytes": int(h.optimizer), "staging_bytes": int(h.staging),
                   "activations_bytes": int(h.activations), "weights_bytes": int(h.weights),
                   "per_gpu_bytes": int(h.total), "gpus_per_node": int(gpus_on_node(
                       est.config.parallel.gpus, est.gpu.gpus_per_node if est.gpu is not None else 8))}
    out["host_bytes_per_node"] = est.host_bytes_per_node
    if est.host_budget_bytes is not None:
        out["host_budget_bytes"] = int(est.host_budget_bytes)
        out["fits_host"] = est.fits_host
    if est.budget_bytes is not None:
        out["budget_bytes"] = int(est.budget_bytes)
        out["headroom_bytes"] = int(est.headroom_bytes)
        out["fits"] = est.fits
    if est.gpu is not None:
        out["gpu"] = est.gpu.name
    if est.perf is not None:
        out["perf"] = perf_dict(est.perf)
    return out


def peak_dict(est: Estimate) -> dict[str, Any]:
    """The step peak of the most loaded GPU (`peak_bytes` is what torch.cuda.max_memory_allocated
    reports), when it happens, the timeline, and what the device needs (`device_bytes`)."""
    step, dev = est.step, est.device
    e = step.peak_event
    return {
        "peak_bytes": int(step.peak_bytes),
        "workspace_bytes": int(dev.workspace_bytes),
        "allocated_peak_bytes": int(dev.allocated_peak),
        "peak_phase": e.phase,
        "peak_layer": e.layer,
        "peak_moment": e.moment,
        "peak_parts": {k: int(v) for k, v in e.parts.items()},
        "persistent_bytes": int(step.persistent_bytes),
        "optimizer_temporary_bytes": int(step.optimizer_temp_bytes),
        "fragmentation_margin": dev.margin,
        "fragmentation_bytes": int(dev.fragmentation_bytes),
        "runtime_bytes": int(dev.runtime_bytes),
        "device_bytes": int(dev.total),
        "stage_peak_bytes": [int(s.peak_bytes) for s in est.steps],
        "timeline": [{"phase": ev.phase, "layer": ev.layer, "moment": ev.moment, "bytes": int(ev.bytes)}
                     for ev in step.events if ev.bytes],
    }


def perf_dict(perf: Any) -> dict[str, Any]:
    """Every field of a scalar StepTime (seconds, FLOPs, fractions)."""
    return {k: (None if v is None else float(v)) for k, v in perf.__dict__.items()}


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
               ("transformers ", "HF "))
SHORT_WORK_NAMES = {"FlashAttn-2": "FlashAttention-2 (Dao 2023)", "TE": "Transformer Engine",
                    "mcore": "megatron-core 0.16.1 (its local spec)",
                    "HF": "Hugging Face transformers"}


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


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


# -- Markdown and CSV: renderings of the JSON dicts (estimate_dict, search_dict) ---------------------

ESTIMATE_COLUMNS = ("section", "item", "symbolic", "bytes_per_copy", "copies", "value", "unit", "share", "in_k22",
                    "source")
# memory.* fields of estimate_dict in report order, with what they are
MEMORY_ROWS = (
    ("weights_bytes", "weights"),
    ("gradients_bytes", "gradients"),
    ("optimizer_bytes", "optimizer (master + moments)"),
    ("activations_bytes", "saved activations at the first backward"),
    ("total_bytes", "retained at the first backward"),
    ("peak_bytes", "peak of the step's tensors"),
    ("workspace_bytes", "cuBLAS workspace (inside PyTorch's pool)"),
    ("allocated_peak_bytes", "allocated peak (torch.cuda.max_memory_allocated)"),
    ("fragmentation_bytes", "fragmentation margin"),
    ("runtime_bytes", "CUDA context, kernels, NCCL (outside PyTorch)"),
    ("device_bytes", "device memory needed"),
)
# other scalar fields: (key, item, unit)
OTHER_ROWS = (
    ("budget_bytes", "budget per GPU", "B"),
    ("headroom_bytes", "headroom (budget - device memory needed)", "B"),
    ("fits", "fits in the budget", ""),
    ("host_bytes_per_node", "host memory per node (offload)", "B"),
    ("host_budget_bytes", "host memory budget per node", "B"),
    ("fits_host", "fits in the host memory budget", ""),
    ("max_seq_len", "longest sequence length that fits", "tokens"),
    ("max_micro_batch", "largest micro-batch that fits", "sequences"),
)
PERF_ROWS = (("step_time_s", "step time", "s"), ("tokens_per_s", "throughput", "tokens/s"),
             ("mfu", "model FLOPs utilisation", "fraction"))


def estimate_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per activation term, then the summary rows, from `estimate_dict`'s dict."""
    act, mem = data["activations"], data["memory"]
    rows = [dict(section="activations", item=t["name"], symbolic=t["symbolic"], bytes_per_copy=t["bytes"],
                 copies=t["copies"], value=t["stage_bytes"], unit="B", share=t["share"], in_k22=t["in_k22"],
                 source=t["source"]) for t in act["terms"]]
    if act["recompute_working_bytes"]:
        rows.append(dict(section="activations", item="recompute working set (one layer, transient)",
                         copies=1, value=act["recompute_working_bytes"], unit="B", in_k22=False, source="memplan"))
    rows.append(dict(section="summary", item="activations per layer per micro-batch",
                     symbolic=act["per_layer_symbolic"], value=act["per_layer_bytes"], unit="B"))
    where = f"{mem['peak_phase']}" + (f" of layer {mem['peak_layer']}" if mem["peak_layer"] is not None else "")
    for key, item in MEMORY_ROWS:
        if key == "peak_bytes":
            item = f"{item} (at {where}: {mem['peak_moment']})"
        elif key == "optimizer_bytes" and "optimizer" in data:
            item = data["optimizer"]["label"]
        rows.append(dict(section="memory", item=item, value=mem[key], unit="B"))
    rows += [dict(section="summary", item=item, value=data[key], unit=unit) for key, item, unit in OTHER_ROWS
             if key in data]
    perf = data.get("perf") or {}
    rows += [dict(section="perf", item=item, value=perf[key], unit=unit) for key, item, unit in PERF_ROWS
             if perf.get(key) is not None]
    return rows


def search_rows(data: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per plan (the ranked plans that fit, then the fastest one over the budget or the
    nearest miss) from `search_dict`'s dict (or a list of them: every preset)."""
    rows = []
    for result in data if isinstance(data, list) else [data]:
        if "skipped" in result:  # a preset that could not be searched (skipped_dict)
            rows.append({"model": result["model"], "rank": "", "status": "skipped", "gpu": result["gpu"],
                         "reason": result["skipped"]})
            continue
        ranked = [("fits", str(rank), plan) for rank, plan in enumerate(result["plans"], 1)]
        others = [(status, "", result[key]) for key, status in (("fastest_over_budget", "fastest over budget"),
                                                                 ("nearest_miss", "nearest miss")) if key in result]
        for status, rank, plan in ranked + others:
            flat = {k: v for k, v in plan.items() if k != "memory"}
            rows.append({"model": result["model"], "rank": rank, "status": status, **flat, **plan["memory"]})
    return rows


def _cell(value: Any) -> str:
    """A Markdown cell: integers and large numbers with thousands separators, others to 4 digits."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """Every key of the rows, in first-seen order."""
    return tuple(dict.fromkeys(k for r in rows for k in r))


def _estimate_heading(data: dict[str, Any]) -> str:
    c = data["config"]
    par, tr = c["parallel"], c["training"]
    return (f"**{c['model']['name']}** ({data['impl']}): t={par['tp']} p={par['pp']} d={par['dp']} m={par['vpp']} "
            f"SP={'on' if par['sp'] else 'off'} recompute={tr['recompute']} ZeRO={par['zero']} b={tr['micro_batch']}, "
            f"global batch {c['global_batch']} sequences, on {c['gpus']} GPUs; stage {data['most_loaded_stage']} "
            "is the most loaded (bytes: B)")


def _search_heading(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"**{result['model']}** on {result['gpus']:,} {result['gpu'] or ''} GPUs: skipped, {result['skipped']}"
    return (f"**{result['model']}** ({result['impl']}) on {result['gpus']:,} {result['gpu'] or ''} GPUs, budget "
            f"{_gb(result['budget_bytes'])} per GPU, global batch {result['global_batch']:,} sequences: "
            f"{result['candidates_evaluated']:,} plans evaluated, {result['feasible']:,} fit (bytes: B, times: s)")


def render_output(fmt: str, kind: str, data: Any) -> None:
    """Print `data` (estimate_dict / search_dict) as json, markdown or csv."""
    if fmt == "json":
        print_json(data)
        return
    rows = estimate_rows(data) if kind == "estimate" else search_rows(data)
    columns = ESTIMATE_COLUMNS if kind == "estimate" else _columns(rows)
    if fmt == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return
    results = [data] if kind == "estimate" or not isinstance(data, list) else data
    heading = "\n".join(_estimate_heading(r) if kind == "estimate" else _search_heading(r) for r in results)
    notes = [f"- note: {n}" for r in results for n in r.get("notes", [])]
    print("\n\n".join([heading, markdown_table(rows, columns)] + (["\n".join(notes)] if notes else [])))


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
        f"[bold]{m.name}[/]: L={m.num_layers} h={m.hidden_size} a={m.num_attention_heads} "
        + (f"latent attention r_kv={m.kv_lora_rank} r_q={m.q_lora_rank} d_qk={m.qk_nope_head_dim}+"
           f"{m.qk_rope_head_dim} d_v={m.v_head_dim} " if m.is_mla else
           f"q={m.q} (head_dim {m.head_dim}) " if m.q != m.hidden_size else "")
        + (f"E={m.num_experts} top-{m.moe_top_k} f_e={m.fe} " if m.is_moe else "")
        + f"s={m.seq_length} v={m.vocab_size}, {est.total_params / 1e9:,.1f} billion parameters"
    )
    console.print(
        f"plan: t={par.tp} p={par.pp} d={par.dp} m={par.vpp} SP={'on' if par.sp else 'off'} "
        f"recompute={tr.recompute.label} ZeRO={par.zero}"
        f"{f' over {par.shard} ranks' if par.zero and par.shard < par.dp else ''} b={tr.micro_batch} "
        f"global batch={format_batch(c.global_batch, m.seq_length)} ({c.num_microbatches} micro-batches per step) "
        f"on {par.gpus} GPUs{pinned_techniques(tr)}"
    )
    console.print(
        f"activations per layer per micro-batch on one GPU: {est.per_layer_symbolic} = "
        f"{format_bytes_auto(est.per_layer_bytes)}" + ("  [dim](paper-only view)[/]" if est.paper_only else "")
    )

    # Compact: the per-layer formula folds at its '+' past 10 columns and the activations row leaves
    # its formula to the line above; copies are headed 'x' (per layer x copies = bytes), bytes have 3
    # digits, long work names in the source column are shortened (SHORT_WORKS).
    narrow = compact(console)
    gb, auto = (_bytes3, _bytes3) if narrow else (_gb, format_bytes_auto)
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
        table.add_row(_term_cell(f"{r.term.name}{mark}", narrow), r.symbolic, str(r.copies), auto(r.stage_bytes),
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
        console.print(f"note: {note}")
    if est.perf is not None:
        p = est.perf
        cal = calibration(est.config.model, est.gpu, est.inventory.name.split("/")[0], est.config.training.fp8)
        calibrated = p.calibrated and cal.calibrated  # p: the kernels step_time modelled
        spread = f" ± {p.uncertainty:.0%}" if calibrated else ""
        label = "" if calibrated else f"[yellow]{cal.note or 'uncalibrated'}[/]; "
        console.print(
            f"step time {p.step_time_s:.2f} s{spread} on {est.gpu.name} ({label}{p.tokens_per_s:,.0f} tokens/s, "
            f"MFU {p.mfu:.1%}): compute {p.compute_s:.2f} s, memory-bound {p.memory_s:.2f} s, recompute "
            f"{p.recompute_s:.2f} s, pipeline bubble {p.bubble_s:.2f} s ({p.bubble_share:.1%} of the step), TP comm "
            f"exposed {p.tp_comm_exposed_s:.2f} s, DP comm exposed {p.dp_comm_exposed_s:.2f} s, PP sends {p.pp_comm_s:.2f} s"
            + (f", host copies {p.host_copy_s:.2f} s (offload, exposed)" if p.host_copy_s else "")
            + (f", CP / EP comm exposed {p.cp_ep_comm_exposed_s:.2f} s" if p.cp_ep_comm_exposed_s else "")
        )
    render_peak(est, console)
    if est.budget_bytes is not None:
        where = f" ({est.gpu.name})" if est.gpu is not None else ""
        head = est.headroom_bytes
        margin = (f"allocated peak + {est.device.margin:.0%} fragmentation margin + runtime = "
                  f"{_gb(est.device.total)}")
        if head >= 0:
            console.print(f"[green]fits[/] in {_gb(est.budget_bytes)}{where}: {margin}, {_gb(head)} headroom "
                          f"on stage {est.most_loaded}")
        else:
            console.print(f"[red]does not fit[/] in {_gb(est.budget_bytes)}{where}: {margin}, over by "
                          f"{_gb(-head)} on stage {est.most_loaded}")
    else:
        console.print("no fit verdict: give --mem SIZE or --gpu NAME")
    render_host(est, console)


def render_host(est: Estimate, console: Console) -> None:
    """Host memory the offload takes (per GPU, per node) and its verdict against --host-mem."""
    h = est.host
    if h.total:
        parts = [(h.optimizer, "optimizer states"), (h.staging, "pinned staging"), (h.activations, "saved activations"),
                 (h.weights, "weights the layers save")]
        n = gpus_on_node(est.config.parallel.gpus, est.gpu.gpus_per_node if est.gpu is not None else 8)
        console.print(f"host memory (offload): {_gb(est.host_bytes_per_node)} per node = {n} GPU{'s' if n != 1 else ''} "
                      f"x {_gb(h.total)} ("
                      + " + ".join(f"{label} {_gb(v)}" for v, label in parts if v) + ")")
    if est.host_budget_bytes is None:
        return
    per_node = est.host_bytes_per_node
    if est.fits_host:
        console.print(f"[green]fits host memory[/]: {_gb(per_node)} per node of {_gb(est.host_budget_bytes)} "
                      "(--host-mem)")
    else:
        console.print(f"[red]does not fit host memory[/]: {_gb(per_node)} per node, over the "
                      f"{_gb(est.host_budget_bytes)} of --host-mem by {_gb(per_node - est.host_budget_bytes)}")


def explain_lines(steps: list[Any], sections: dict[str, str]) -> list[str]:
    """`memplan explain`: each step as 'label: formula = values = result unit  [source]', by section."""
    lines: list[str] = []
    section = None
    for s in steps:
        if s.section != section:
            section = s.section
            lines += ["" if lines else None, f"== {sections[section]} =="]
        chain = [s.formula] + ([s.substituted] if s.substituted and s.substituted != s.formula else [])
        if s.value is not None:
            chain.append(f"{s.value:,} {s.unit}".rstrip())
        lines.append(f"{s.label}: " + " = ".join(chain) + (f"  [{s.source}]" if s.source else ""))
        if s.note:
            lines.append(f"    ({s.note})")
    return [line for line in lines if line is not None]


def render_limits(limits: dict[str, Any], est: Estimate, console: Console) -> None:
    """`--max-seq` / `--max-micro-batch` answers."""
    words = {"max_seq_len": ("longest sequence length", "tokens"), "max_micro_batch": ("largest micro-batch", "sequences")}
    for key, value in limits.items():
        what, unit = words[key]
        if value is None:
            console.print(f"[red]{what}: none fits[/] in {_gb(est.budget_bytes)} with this plan")
        else:
            console.print(f"{what} that fits in {_gb(est.budget_bytes)} with this plan: [bold]{value:,}[/] {unit}")


def _where(e: Any) -> str:
    return f"{e.phase}{f' of layer {e.layer}' if e.layer is not None else ''}: {e.moment}"


def render_peak(est: Estimate, console: Console) -> None:
    """The step's peak on the most loaded GPU: persistent and transient memory apart, what the
    device adds, and the largest moment of each phase."""
    step, dev = est.step, est.device
    e = step.peak_event
    table = make_table(console, (Col("component", fold=True), Col("bytes", "right"), Col("kind")),
                       title=f"Peak of a training step on one GPU of stage {est.most_loaded}, at {_where(e)}",
                       short_title=f"Step peak, one GPU of stage {est.most_loaded}, at {_where(e)}")
    kinds = {"weights": "persistent", "optimizer": "persistent",
             "gradients": "persistent" if est.inventory.grad_lifetime == "buffer" else "step",
             "saved": "step", "transient": "transient"}
    for k, kind in kinds.items():
        label = (_gpu_states_label(est.config.training) if k == "optimizer" else PART_LABELS[k]) + (
            " alive" if kind == "step" else "")
        table.add_row(label, _gb(e.parts[k]), kind)
    table.add_row("[bold]peak of the step's tensors[/]", f"[bold]{_gb(step.peak_bytes)}[/]", "")
    table.add_row("cuBLAS workspace (inside PyTorch's pool)", _gb(dev.workspace_bytes), "runtime")
    table.add_row("[bold]allocated peak[/] (torch.cuda.max_memory_allocated)", f"[bold]{_gb(dev.allocated_peak)}[/]",
                  "")
    table.add_row(f"fragmentation margin ({dev.margin:.0%} of the allocated peak)", _gb(dev.fragmentation_bytes),
                  "allocator")
    table.add_row("CUDA context, kernels, NCCL (outside PyTorch)", _gb(dev.runtime_bytes), "runtime")
    table.add_row("[bold]device memory needed[/]", f"[bold]{_gb(dev.total)}[/]", "")
    console.print(table)
    phases: dict[str, Any] = {}
    for ev in step.events:
        if ev.bytes and (ev.phase not in phases or ev.bytes > phases[ev.phase].bytes):
            phases[ev.phase] = ev
    console.print("largest moment of each phase: " + "; ".join(
        f"{p} {_gb(ev.bytes)}{f' (layer {ev.layer})' if ev.layer is not None else ''}" for p, ev in phases.items()))
    if est.config.parallel.pp > 1:
        render_stages(est, console)
        low = min(range(len(est.steps)), key=lambda i: est.steps[i].peak_bytes)
        console.print(f"stage peaks from {_gb(est.steps[low].peak_bytes)} (stage {low}) to "
                      f"{_gb(est.step.peak_bytes)} (stage {est.most_loaded}); the last stage "
                      f"{_gb(est.steps[-1].peak_bytes)} (--json: memory.stage_peak_bytes)")


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
        table.add_row(f"{mark}{r.stage}{end}", str(r.layers), str(r.chunks), str(r.layer_copies), _gb(r.states_bytes),
                      _gb(r.activations_bytes), f"{mark}{_gb(r.peak_bytes)}{end}", r.peak_at)
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
        table.add_row(r["name"], str(r["L"]), str(r["h"]), str(r["a"]), str(r["g"]), str(r["s"]),
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


# The compact layout's plans: K22's letters t, p, d, m, b, Z for the ZeRO stage, B for the global batch
PLAN_LETTERS = {"tp": "t", "pp": "p", "dp": "d", "micro_batch": "b", "vpp": "m", "zero": "Z", "global_batch": "B",
                "ep": "ep", "cp": "cp", "etp": "etp"}
RECOMPUTE_SHORT = {"none": "none", "selective": "sel", "full": "full"}
PLAN_LEGEND = ("t, p, d tensor, pipeline, data parallel; ep, cp expert, context parallel; b micro-batch; m chunks; "
               "Z ZeRO; B global batch; "
               "p16* uneven stages (first / last stage layers); "
               "t1, m1, Z0, SP off and recompute none left out")


def compact_plan(fields: dict[str, Any]) -> str:
    """A plan {tp: 8, pp: 64, dp: 1, vpp: 1, sp: True, micro_batch: 1, global_batch: 512, recompute:
    'selective'} as 't8 p64 d1 b1 SP B512 sel', in the order given: the defaults (t1, m1, Z0, SP off,
    recompute none) left out; 'zero' may be a '2/8' string (HSDP), 'recompute' a '_rec_cell' text
    ('full 2/32'); a field it does not know stays 'key=value'."""
    words = []
    split = {k: fields[k] for k in ("first_stage_layers", "last_stage_layers") if k in fields}
    for key, value in fields.items():
        text = str(value)
        if key in split:
            continue
        if key == "pp" and split:  # an uneven split (the first and / or the last stage's layers given)
            text += "*"
        if key == "sp":
            words += ["SP"] if text == "True" else []
        elif (key, text) in (("vpp", "1"), ("zero", "0"), ("recompute", "none"), ("tp", "1")):
            continue
        elif key in PLAN_LETTERS:
            words.append(f"{PLAN_LETTERS[key]}{text}")
        elif key == "recompute":
            words.append(RECOMPUTE_SHORT.get(text, text))
        else:
            words.append(f"{key}={text}")
    return " ".join(words)


def _plan_fields(text: str) -> dict[str, str]:
    """'tp=8 pp=64 sp=True' -> {'tp': '8', 'pp': '64', 'sp': 'True'} (`memplan models`' plan)."""
    return dict(item.partition("=")[::2] for item in text.split())


def plan_text(row: dict[str, Any], num_layers: Optional[int] = None, layers: Optional[int] = None) -> str:
    """'t=8 p=35 d=8 b=1 m=3 SP selective ZeRO-1' style summary of a search row; given the model's
    `num_layers`, the compact layout's 't8 p35 d8 b1 m3 SP sel Z1' (compact_plan)."""
    rec = row["recompute"]
    if num_layers is not None:
        rec_cell = _rec_cell(row, _row_chunk(row, num_layers), short=True)
        return compact_plan({"tp": row["tp"], "pp": _p_cell(row, num_layers).replace(" ", ""),
                             **{k: row[k] for k in ("dp", "micro_batch", "vpp", "sp")},
                             "recompute": rec_cell, "zero": _zero_cell(row)})
    rec_text = {"none": "no-recompute", "selective": "selective"}.get(rec, f"full x{row['recompute_num_layers']}")
    sp = " SP" if row["sp"] else ""
    cp_ep = "".join(f" {k}={row[k]}" for k in ("cp", "ep") if row.get(k, 1) > 1)
    pp = row["pp"] if layers is None else _p_cell(row, layers).replace(" ", "")  # layers: L, to show a split
    return (f"t={row['tp']} p={pp} d={row['dp']}{cp_ep} b={row['micro_batch']} m={row['vpp']}{sp} "
            f"{rec_text} ZeRO-{_zero_cell(row)}")


def _zero_cell(row: dict[str, Any]) -> str:
    """'2' when sharded over all d ranks, '2/8' when over a group of 8 (HSDP)."""
    z = row["zero"]
    return f"{z}/{row['zero_shard']}" if z and row["zero_shard"] < row["dp"] else str(z)


def _row_chunk(row: dict[str, Any], num_layers: int) -> int:
    """Layers of a search row's largest model chunk (L/(p m), or with uneven stages the largest stage's / m)."""
    first, last, p = row.get("first_stage_layers"), row.get("last_stage_layers"), row["pp"]
    if first is None or first * p == num_layers == last * p:
        return num_layers // (p * row["vpp"])
    middle = (num_layers - first - last) // (p - 2) if p > 2 else 0
    return max(first, middle, last) // row["vpp"]


def _p_cell(row: dict[str, Any], num_layers: int) -> str:
    """p, and with uneven stages the layers of the first / each middle / the last stage: '16 (7/8/7)'."""
    first, last, p = row.get("first_stage_layers"), row.get("last_stage_layers"), row["pp"]
    if first is None or first * p == num_layers == last * p:
        return str(p)
    if p == 2:
        return f"2 ({first}/{last})"
    return f"{p} ({first}/{(num_layers - first - last) // (p - 2)}/{last})"


def _rec_cell(row: dict[str, Any], layers_per_chunk: int, short: bool = False) -> str:
    """'selective', 'full', 'full 2/32' (2 of the chunk's 32 layers); `short`: 'sel' for selective."""
    if row["recompute"] != "full":
        return RECOMPUTE_SHORT.get(row["recompute"], row["recompute"]) if short else row["recompute"]
    n = row["recompute_num_layers"]
    return "full" if n == layers_per_chunk else f"full {n}/{layers_per_chunk}"


def pinned_techniques(training: Any, lead: str = ",") -> str:
    """The FP8 recipe and loss chunks of a plan (or of every plan of a search), as text; empty without them."""
    parts = []
    if training.fp8 is not None:
        parts.append(f"FP8 {training.fp8} ({training.fp8_format}"
                     + (", FP8 weights" if training.fp8_param_gather else "") + ", derived)")
    if training.loss_chunks > 1:
        parts.append(f"LM head + loss in {training.loss_chunks} chunks")
    return f"{lead} {', '.join(parts)}" if parts else ""


def search_dict(result: SearchResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": result.model.name,
        "impl": result.impl,
        "optimizer": result.training.optimizer,  # pinned: every plan steps it
        "gpus": result.gpus,
        "global_batch": result.global_batch,
        "budget_bytes": result.budget_bytes,
        "host_budget_bytes": result.host_budget_bytes,
        "offload": {"optimizer_fraction": result.training.offload_optimizer_fraction,
                    "activations": result.training.offload_activations},  # pinned: every plan offloads the same
        # pinned: every plan runs the same FP8 recipe (None: bf16) and loss chunks
        "fp8": ({"recipe": result.training.fp8, "format": result.training.fp8_format,
                 "amax_history_len": result.training.fp8_amax_history_len,
                 "param_gather": result.training.fp8_param_gather} if result.training.fp8 else None),
        "loss_chunks": result.training.loss_chunks,
        "gpu": result.gpu.name if result.gpu else None,
        "candidates_evaluated": result.candidates,
        "feasible": result.feasible,
        "seconds": result.seconds,
        "sort": result.sort,
        "variants_folded": result.folded,
        "plans": [{**result.row(x.plan), "folded_zero_variants": len(x.zero_variants),
                   "folded_recompute_variants": len(x.recompute_variants)} for x in result.listed()],
        "notes": result.notes,
    }
    if result.distinct_fit is not None:
        out["distinct_fit"] = result.distinct_fit
    if result.max_seq_len is not None:
        out["max_seq_len"] = result.max_seq_len
    if result.nearest_miss is not None:
        out["nearest_miss"] = result.row(result.nearest_miss)
    if result.fastest_miss is not None:
        out["fastest_over_budget"] = result.row(result.fastest_miss)
    return out


def skipped_dict(skipped: Any, gpus: int) -> dict[str, Any]:
    """A preset `search` over every preset could not search (planner.Skipped), in the search list's
    JSON: no plans, the reason."""
    return {"model": skipped.model, "gpus": gpus, "gpu": skipped.gpu, "skipped": skipped.reason, "plans": []}


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
    where = f" {result.gpu.name}" if result.gpu else ""
    console.print(
        f"[bold]{m.name}[/] ({result.impl}) on {result.gpus}{where} GPUs, {_gb(result.budget_bytes)} per GPU, "
        f"global batch {format_batch(result.global_batch, m.seq_length)}: {result.candidates:,} plans evaluated in "
        f"{result.seconds:.2f} s, {result.feasible:,} fit"
        + (f" (and in {_gb(result.host_budget_bytes)} of host memory per node)" if result.host_budget_bytes is not None
           else "") + pinned_techniques(result.training, "; every plan with")
    )
    has_time = result.evaluated.step_time_s is not None
    listing = result.listed()
    host = offloads(result.training)
    folded = any(x.zero_variants or x.recompute_variants for x in listing)
    if result.distinct_fit is not None and result.feasible:
        console.print(f"variants folded into {result.distinct_fit:,} rows: +n ZeRO other ZeRO stages / shard groups, "
                      "+n rec recompute choices no faster, no smaller (--all-variants lists them)")
    if listing:
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
            chunk = _row_chunk(row, m.num_layers)
            table.add_row(
                str(rank), str(row["tp"]), _p_cell(row, m.num_layers), str(row["dp"]), *(str(row[c]) for c in extra),
                str(row["micro_batch"]), str(row["vpp"]), "on" if row["sp"] else "off", _rec_cell(row, chunk, narrow), _zero_cell(row),
                _gb(row["memory"]["device_bytes"]),
                f"{row['step_time_s']:.2f} s" if has_time else "-", f"{row['mfu']:.1%}" if has_time else "-",
                *([_gb(row["memory"]["host_bytes_per_node"])] if host else []),
                *([_folded_cell(x)] if folded else []),
            )
        console.print(table)
    else:
        console.print(f"[red]no plan fits in {_gb(result.budget_bytes)}[/]")
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
        console.print(f"note: {note}")


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
        return f"needs {_gb(need)}, over by {_gb(need - result.budget_bytes)}"
    host = row["memory"]["host_bytes_per_node"]
    return (f"needs {_gb(need)} and {_gb(host)} of host memory per node, over the {_gb(result.host_budget_bytes)} of "
            f"--host-mem by {_gb(host - result.host_budget_bytes)}")


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
    budget = f"{_gb(first.budget_bytes)} per GPU" if len(budgets) == 1 else "each GPU's memory as the budget"
    if gpu_given:
        console.print(f"every preset on {first.gpus} {gpus[0]} GPUs (--gpu), {budget}:")
    else:
        console.print(f"every preset on {first.gpus} GPUs, each timed on its own preset's GPU (--gpu NAME sets one "
                      f"for all), {budget}:")
    best = "the least device memory" if first.sort == "memory" else "the fastest"
    console.print(f"best plan: {best} that fits" + (", variants folded" if first.folded else ""))

    def gpu_cell(r: SearchResult) -> str:
        name = r.gpu.name if r.gpu else "-"
        name = name if len(budgets) == 1 else f"{name} {_gb(r.budget_bytes)}"
        return f"{name} (assumed)" if r.model.name in assumed else name

    if narrow and not gpu_given:  # the GPU column would not fit 80 columns: one line per GPU
        for cell in dict.fromkeys(gpu_cell(r) for r in results):
            console.print(f"on {cell}: {', '.join(r.model.name for r in results if gpu_cell(r) == cell)}")
    gpu_col = [] if narrow or gpu_given else [Col("GPU")]
    table = make_table(console, (Col("model", fold=True), *gpu_col, Col("plans", "right"), Col("fit", "right"),
                                 Col("best plan", fold=True), Col("memory", "right"),
                                 Col("step time", "right", short="time"), Col("MFU", "right")))
    for r in results:
        gpu = [gpu_cell(r)] if gpu_col else []
        if r.top:
            row = r.row(r.top[0])
            has_time = "step_time_s" in row
            table.add_row(r.model.name, *gpu, f"{r.candidates:,}", f"{r.feasible:,}",
                          plan_text(row, r.model.num_layers if narrow else None),
                          _gb(row["memory"]["device_bytes"]), f"{row['step_time_s']:.2f} s" if has_time else "-",
                          f"{row['mfu']:.1%}" if has_time else "-")
        else:
            row = r.row(r.nearest_miss)
            table.add_row(r.model.name, *gpu, f"{r.candidates:,}", "[red]0[/]",
                          plan_text(row, r.model.num_layers) if narrow else f"nearest miss: {plan_text(row)}",
                          _gb(row["memory"]["device_bytes"]), "-", "-")
    console.print(table)
    if narrow:
        misses = " fit 0: the plan shown is the nearest miss (the least memory)." if any(
            not r.top for r in results) else ""
        console.print(f"[dim]best plan: {PLAN_LEGEND}.{misses}[/]")
    defaulted = sorted({r.gpu.name for r in results if r.model.name in assumed and r.gpu})
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


def validation_dict(results: list[Any], summary: dict[str, Any]) -> dict[str, Any]:
    return {
        **summary,
        "results": [
            {
                "case": r.case.__dict__,
                "predicted_bytes": r.predicted_total,
                "measured_bytes": r.measured_total,
                "retained_after_forward_bytes": r.retained_after_forward,
                "peak_bytes": r.peak,
                "paper_only_bytes": r.paper_total,
                "error": r.error,
                "passed": r.passed,
                "terms": [{"label": k, "predicted_bytes": p, "measured_bytes": m} for k, p, m in r.term_rows()],
                "notes": r.notes,
            }
            for r in results
        ],
    }


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
                      c.backend, _bytes3(r.measured_total), f"{r.error:.4%}", _bytes3(r.paper_total), verdict)
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


def peak_validation_dict(results: list[Any], summary: dict[str, Any]) -> dict[str, Any]:
    return {**summary, "results": [
        {"case": r.case.__dict__, "predicted_peak_bytes": r.predicted, "measured_peak_bytes": r.measured,
         "predicted_at": r.predicted_at, "predicted_moment": r.predicted_moment, "measured_at": r.measured_at,
         "error": r.error, "passed": r.passed}
        for r in results]}


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
                          str(c.microbatches), c.backend, _bytes3(r.measured), f"{r.error:+.3%}",
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
