"""The only module that imports rich: tables for the terminal, plain dicts for JSON."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from memplan.estimate import Estimate
from memplan.specs import Config
from memplan.units import format_bytes, format_bytes_auto


def _gb(n: int) -> str:
    return format_bytes(n, "GB")


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
        "config": config_dict(est.config),
        "inventory": est.inventory.name,
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
                "layers": s.layers,
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
    if est.budget_bytes is not None:
        out["budget_bytes"] = int(est.budget_bytes)
        out["headroom_bytes"] = int(est.headroom_bytes)
        out["fits"] = est.fits
    if est.gpu is not None:
        out["gpu"] = est.gpu.name
    return out


def _cite(source: str) -> str:
    """The short citation of a term's source: 'K22 section 4.1: QKV input 2sbh' -> 'K22 4.1'."""
    return source.split(":")[0].replace(" section ", " ").replace("theoretical_memory_usage.py", "")


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def render_estimate(est: Estimate, console: Console) -> None:
    c, peak = est.config, est.peak
    m, par, tr = c.model, c.parallel, c.training
    console.print(
        f"[bold]{m.name}[/]: L={m.num_layers} h={m.hidden_size} a={m.num_attention_heads} "
        f"s={m.seq_length} v={m.vocab_size}, {est.total_params / 1e9:,.1f} B parameters"
    )
    console.print(
        f"plan: t={par.tp} p={par.pp} d={par.dp} m={par.vpp} SP={'on' if par.sp else 'off'} "
        f"recompute={tr.recompute.label} ZeRO={par.zero} b={tr.micro_batch} "
        f"global batch={c.global_batch} ({c.num_microbatches} micro-batches per step) on {par.gpus} GPUs"
    )
    console.print(
        f"activations per layer per micro-batch on one GPU: {est.per_layer_symbolic} = "
        f"{format_bytes_auto(est.per_layer_bytes)}" + ("  [dim](paper-only view)[/]" if est.paper_only else "")
    )

    table = Table(title=f"Memory of one GPU of stage {est.most_loaded} (the most loaded of {par.pp})")
    table.add_column("component")
    table.add_column("per layer", justify="right")
    table.add_column("copies", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    table.add_column("source", style="dim")
    total = peak.total
    for label, value in (("weights", peak.weights), ("gradients", peak.gradients),
                         ("optimizer (master + moments)", peak.optimizer)):
        table.add_row(label, "", "", _gb(value), f"{value / total:.1%}", "")
    table.add_row("[bold]activations[/]", est.per_layer_symbolic, "", _gb(peak.activations),
                  f"{peak.activations / total:.1%}", "")
    for r in est.rows:
        mark = "" if r.term.in_k22 else " *"
        table.add_row(f"  {r.term.name}{mark}", r.symbolic, str(r.copies), _gb(r.stage_bytes),
                      f"{r.stage_bytes / total:.1%}", _cite(r.term.source))
    table.add_row("[bold]total[/]", "", "", f"[bold]{_gb(total)}[/]", "100.0%", "")
    console.print(table)
    if any(not r.term.in_k22 for r in est.rows):
        console.print("[dim]* not in K22: stored by real implementations; --paper-only leaves them out[/]")
    for note in est.notes:
        console.print(f"note: {note}")
    if est.budget_bytes is not None:
        where = f" ({est.gpu.name})" if est.gpu is not None else ""
        head = est.headroom_bytes
        if head >= 0:
            console.print(f"[green]fits[/] in {_gb(est.budget_bytes)}{where}: {_gb(head)} headroom "
                          f"on stage {est.most_loaded}")
        else:
            console.print(f"[red]does not fit[/] in {_gb(est.budget_bytes)}{where}: over by {_gb(-head)} "
                          f"on stage {est.most_loaded}")


def render_models(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="model presets")
    for col in ("name", "L", "h", "a", "kv heads", "s", "v", "params", "default plan"):
        table.add_column(col, justify="left" if col in ("name", "default plan") else "right")
    for r in rows:
        table.add_row(r["name"], str(r["L"]), str(r["h"]), str(r["a"]), str(r["g"]), str(r["s"]),
                      str(r["v"]), f"{r['params'] / 1e9:,.1f} B", r["plan"])
    console.print(table)
