"""The machine-readable documents and the plain-text outputs, without rich: the `--json` dicts
(estimate_dict, search_dict, skipped_dict, validation_dict, ...), print_json, the Markdown / CSV rows of render_output
and explain's lines. A library user building JSON never loads rich."""

from __future__ import annotations

import csv
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the planner (and numpy) load only when a search runs
    from memplan.plan.estimate import Estimate
    from memplan.plan.search import SearchResult
from memplan.core.specs import Config
from memplan.memory.offload import gpus_on_node
from memplan.memory.optimizers import states_label
from memplan.memory.timeline import optimizer_impl
from memplan.report.escape import md, plain
from memplan.report.text import format_gb


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
        "params": {"total": est.total_params, "active": est.active_params, "most_loaded_gpu": int(peak.params)},
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
    if est.gpu_assumed is not None:
        out["gpu_assumed"] = est.gpu_assumed
    if est.perf is not None:
        out["perf"] = perf_dict(est.perf)
    return out


def peak_dict(est: Estimate) -> dict[str, Any]:
    """The step peak of the GPU whose stage decides the fit (`verdict_stage`: the most loaded unless another
    stage's replay dies first or reserves more; `peak_bytes` is what torch.cuda.max_memory_allocated reports), when
    it happens, the timeline, and what the device needs (`device_bytes`)."""
    step, dev = est.decided_step, est.device
    e = step.peak_event
    return {
        "verdict_stage": est.decided,
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
        # of runtime_bytes: torchtitan's async TP workspace (memplan/inventory/titan_async_tp.py), where there is one
        **({"symm_workspace_bytes": int(dev.symm_workspace_bytes)} if dev.symm_workspace_bytes else {}),
        "device_bytes": int(dev.total),
        **allocator_dict(est),
        "stage_peak_bytes": [int(s.peak_bytes) for s in est.steps],
        "timeline": [{"phase": ev.phase, "layer": ev.layer, "moment": ev.moment, "bytes": int(ev.bytes)}
                     for ev in step.events if ev.bytes],
    }


def allocator_dict(est: Estimate) -> dict[str, Any]:
    """The caching allocator's replay of the deciding stage's run (memory/reserved.py; None where not replayed:
    no budget, or a plan the allocation stream does not model), and `stages_replayed`: every stage's
    (plan/stage_verdict.py; `replayed` false: its allocated peak x 1.5 + runtime within the budget, not replayed;
    `same_as`: the stage whose identical run stands for it)."""
    r = est.reserved
    if r is None:
        return {"allocator": None, "reserved_peak_bytes": None, "inactive_split_bytes": None, "oom_event": None,
                "stages_replayed": []}
    res = r.result
    return {"allocator": r.allocator, "alloc_conf": r.alloc_conf, "first_step_seq_len": r.first_step_seq_len,
            "allocator_capacity_bytes": int(r.capacity_bytes),
            "reserved_peak_bytes": int(res.reserved_peak_bytes), "replayed_allocated_peak_bytes":
            int(res.allocated_peak_bytes), "inactive_split_bytes": int(res.inactive_split_bytes_at_reserved_peak),
            "segments": int(res.segments_at_reserved_peak), "num_alloc_retries": int(res.num_alloc_retries),
            "replayed_stage": r.stage, "replayed_events": r.events, "oom_event": r.oom_event,
            "fragmentation_replayed": bool(est.device.replayed), "expandable_fits": r.expandable_fits,
            "stages_replayed": [{"stage": v.stage, "replayed": v.reserved is not None, "same_as": v.same_as,
                                 "dies": v.dies, "reserved_peak_bytes":
                                 None if v.reserved is None else int(v.reserved.result.reserved_peak_bytes),
                                 "oom_phase": v.reserved.oom_event["phase"] if v.dies else None,
                                 "device_bytes": int(v.device.total)} for v in est.stage_verdicts]}


def perf_dict(perf: Any) -> dict[str, Any]:
    """Every field of a scalar StepTime (seconds, FLOPs, fractions)."""
    return {k: (None if v is None else float(v)) for k, v in perf.__dict__.items()}


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
    ("workspace_bytes", "cuBLAS workspaces of the forward and backward threads (inside PyTorch's pool)"),
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
             ("mfu", "model FLOPs utilisation (attention counted causal: half the square)", "fraction"))


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
            flat = {k: v for k, v in plan.items() if k not in ("memory", "torchtitan")}
            titan = {f"torchtitan_{k}": v for k, v in plan.get("torchtitan", {}).items()}  # search --impl torchtitan
            rows.append({"model": result["model"], "rank": rank, "status": status, **titan, **flat, **plan["memory"]})
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
    return md(value)


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
    return (f"**{md(c['model']['name'])}** ({data['impl']}): t={par['tp']} p={par['pp']} d={par['dp']} m={par['vpp']} "
            f"SP={'on' if par['sp'] else 'off'} recompute={tr['recompute']} ZeRO={par['zero']} b={tr['micro_batch']}, "
            f"global batch {c['global_batch']} sequences, on {c['gpus']} GPUs; stage {data['most_loaded_stage']} "
            "is the most loaded (bytes: B)")


def _search_heading(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return (f"**{md(result['model'])}** on {result['gpus']:,} {md(result['gpu'] or '')} GPUs: skipped, "
                f"{md(result['skipped'])}")
    return (f"**{md(result['model'])}** ({result['impl']}) on {result['gpus']:,} {md(result['gpu'] or '')} GPUs, budget "
            f"{format_gb(result['budget_bytes'])} per GPU, global batch {result['global_batch']:,} sequences: "
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
        writer.writerows({k: plain(v) if isinstance(v, str) else v for k, v in r.items()} for r in rows)
        return
    results = [data] if kind == "estimate" or not isinstance(data, list) else data
    heading = "\n".join(_estimate_heading(r) if kind == "estimate" else _search_heading(r) for r in results)
    notes = [f"- note: {plain(n)}" for r in results for n in r.get("notes", [])]
    print("\n\n".join([heading, markdown_table(rows, columns)] + (["\n".join(notes)] if notes else [])))


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
        lines.append(plain(f"{s.label}: " + " = ".join(chain) + (f"  [{s.source}]" if s.source else "")))
        if s.note:
            lines.append(plain(f"    ({s.note})"))
    return [line for line in lines if line is not None]


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
        **({"gpu_assumed": result.gpu_assumed} if result.gpu_assumed is not None else {}),
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


def peak_validation_dict(results: list[Any], summary: dict[str, Any]) -> dict[str, Any]:
    return {**summary, "results": [
        {"case": r.case.__dict__, "predicted_peak_bytes": r.predicted, "measured_peak_bytes": r.measured,
         "predicted_at": r.predicted_at, "predicted_moment": r.predicted_moment, "measured_at": r.measured_at,
         "error": r.error, "passed": r.passed}
        for r in results]}


def _replayed(x: Any) -> dict[str, int]:
    return {"reserved_peak_bytes": x.reserved_peak_bytes, "allocated_peak_bytes": x.allocated_peak_bytes,
            "requested_peak_bytes": x.requested_peak_bytes, "segments_at_reserved_peak": x.segments_at_reserved_peak,
            "inactive_split_peak_bytes": x.inactive_split_peak_bytes, "segments_peak": x.segments_peak}


def allocator_validation_dict(results: list[Any], max_seq: list[Any], summary: dict[str, Any]) -> dict[str, Any]:
    """`validate --allocator --json`: each recorded run replayed (memplan/check/allocator.py) and, on CUDA, each
    longest-sequence check."""
    return {**summary, "results": [
        {"case": r.case.__dict__, "allocator": r.allocator, "device": r.device, "recorded_events": r.recorded_events,
         "recorded_live_peak_bytes": r.recorded_live_peak, "recorded_replayed": _replayed(r.recorded),
         "memplan_events": r.memplan_events, "memplan_replayed": _replayed(r.memplan), "measured": r.measured,
         "peak_error": r.peak_error, "checks": r.checks, "passed": r.passed} for r in results],
        "max_seq": [{"case": m.case.__dict__, "allocator": m.allocator, "predicted_max_seq_len": m.predicted,
                     "tried_seq_len": m.tried, "trains": m.trains, "next_step_dies": m.next_dies, "passed": m.passed}
                    for m in max_seq]}
