"""Pictures: the memory timeline of a training step, the search space, and K22 Figure 7-style bars.

matplotlib is an optional extra (`pip install 'memplan[plot]'`) and is imported only inside the
functions that draw, so `estimate` and `search` without `--plot` never load it. The numbers come
from memplan's own results (Estimate, SearchResult) or functions (`technique_bytes`); this module
only draws them. Axes are in GB (10^9 bytes) and seconds.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from memplan.core.errors import MemplanError
from memplan.core.outfile import check_output, same_outputs, write_bytes
from memplan.core.training import Recompute
from memplan.inventory.activations import layer_bytes
from memplan.inventory.assemble import inventory_for
from memplan.memory.timeline import PART_LABELS, PARTS
from memplan.report.escape import shortened
from memplan.report.text import fragmentation_label, plan_text

if TYPE_CHECKING:
    from memplan.core.specs import Config
    from memplan.plan.estimate import Estimate
    from memplan.plan.search import SearchResult

GB = 1e9
FORMATS = (".png", ".svg")

# (Event.parts key, legend label, colour), bottom to top
PART_COLOURS = {"weights": "#4c72b0", "optimizer": "#8172b3", "gradients": "#dd8452", "saved": "#55a868",
                "transient": "#c44e52"}
PART_STYLE = tuple((key, PART_LABELS[key], PART_COLOURS[key]) for key in PARTS)


def _pyplot() -> Any:
    """matplotlib.pyplot with a file-only backend, or the one-line error the CLI prints."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        # names are data: a model name's $...$ is text, not mathtext (which can also fail to parse or hang)
        matplotlib.rcParams["text.parse_math"] = False
        import matplotlib.pyplot as plt
    except ImportError:
        raise MemplanError("--plot needs matplotlib: pip install 'memplan[plot]'") from None
    return plt


def check_plot_path(path: str, option: str = "--plot") -> Path:
    """The file to write: PNG or SVG by its extension, a path memplan may write (memplan/core/outfile.py)."""
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise MemplanError(f"{option} {str(path)[:200]}: give a .png or .svg file name")
    return check_output(path, option)


def check_plot_paths(paths: dict[str, Optional[str]]) -> None:
    """Every plot option's file ({option: path or None}), and no two the same file: before any work."""
    same_outputs(*paths.items())
    for option, path in paths.items():
        if path:
            check_plot_path(path, option)


def _save(fig: Any, path: str, dpi: int = 110) -> None:
    """Write PNG (quantised to a 256-colour palette: a third of the size) or SVG (text stays text, so
    labels can be searched and read)."""
    import matplotlib
    import matplotlib.pyplot as plt

    p = check_plot_path(path)
    out = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "memplan"}):
        if p.suffix.lower() == ".png":
            from PIL import Image  # a dependency of matplotlib

            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
            Image.open(buffer).convert("RGB").quantize(256).save(out, format="png", optimize=True)
        else:
            fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    write_bytes(p, out.getvalue())


def _where(event: Any) -> str:
    return f"{event.phase}{f' of layer {event.layer}' if event.layer is not None else ''}"


def plot_estimate(est: Estimate, path: str) -> None:
    """One GPU's step of the stage that decides the fit (the most loaded unless another stage's replay decides), event
    by event, stacked by kind (plus the cuBLAS workspace and the memory outside PyTorch), against the budget; and
    every pipeline stage's step peak."""
    plt = _pyplot()
    check_plot_path(path)
    step, dev = est.decided_step, est.device
    events = [e for e in step.events if e.bytes]
    peak = step.peak_event
    pp = len(est.steps)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(13, 8), gridspec_kw=dict(height_ratios=(3, 2)))
    x = list(range(len(events) + 1))
    bottom = [0.0] * len(events)
    layers = [(key, label, colour, [e.parts[key] / GB for e in events]) for key, label, colour in PART_STYLE]
    layers.append(("workspace", "cuBLAS workspace (in PyTorch's pool)", "#937860", [dev.workspace_bytes / GB] * len(events)))
    layers.append(("runtime", "CUDA context, kernels, NCCL (outside PyTorch)", "#8c8c8c",
                   [dev.runtime_bytes / GB] * len(events)))
    for _, label, colour, values in layers:
        top = [b + v for b, v in zip(bottom, values)]
        ax.fill_between(x, bottom + bottom[-1:], top + top[-1:], step="post", color=colour, label=label, lw=0)
        bottom = top
    ip = events.index(peak)
    ax.annotate(f"peak {dev.allocated_peak / GB:.2f} GB allocated at {_where(peak)}:\n{peak.moment}",
                xy=(ip + 0.5, (peak.bytes + dev.workspace_bytes) / GB), xytext=(0.02, 0.97),
                textcoords="axes fraction", va="top", fontsize=8,
                arrowprops=dict(arrowstyle="->", color="black"))
    ax.plot([ip + 0.5], [(peak.bytes + dev.workspace_bytes) / GB], "k*", ms=12)
    ax.axhline(dev.total / GB, color="black", ls=":", lw=1,
               label=f"device memory needed at the peak (+ {fragmentation_label(dev)}): {dev.total / GB:.2f} GB")
    if est.budget_bytes is not None:
        ax.axhline(est.budget_bytes / GB, color="red", ls="--", lw=1.5,
                   label=f"budget {est.budget_bytes / GB:.2f} GB" + (f" ({shortened(est.gpu.name)})" if est.gpu else ""))
    starts = [i for i, e in enumerate(events) if i == 0 or e.phase != events[i - 1].phase]
    for i in starts:
        ax.axvline(i, color="white", lw=0.8)
        ax.text(i + 0.05, 0.01, events[i].phase, transform=ax.get_xaxis_transform(), fontsize=7, color="white",
                va="bottom", rotation=90)
    ax.set_xlim(0, len(events))
    ax.set_xlabel("events of one training step, in order (forward, loss, backward, optimizer)")
    ax.set_ylabel("memory (GB)")
    ax.set_title(f"{shortened(est.config.model.name)}: one training step on one GPU of stage {est.decided} "
                 + (f"(the most loaded of {pp})" if est.decided == est.most_loaded else
                    f"(of {pp}: its replay decides the fit; stage {est.most_loaded} is the most loaded)"), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    ax.set_ylim(0, max(dev.total, est.budget_bytes or 0) / GB * 1.3)

    peaks = [s.peak_bytes / GB for s in est.steps]
    colours = ["#c44e52" if i == est.most_loaded else "#4c72b0" for i in range(pp)]
    bx.bar(range(pp), peaks, color=colours, label="step peak of the stage's tensors (red: the most loaded)")
    bx.set_xlabel("pipeline stage")
    bx.set_ylabel("step peak of tensors (GB)")
    bx.set_title("step peak of every pipeline stage (without workspace, margin and runtime)", fontsize=10)
    bx.set_xlim(-0.6, pp - 0.4)
    bx.set_xticks(range(0, pp, max(1, pp // 12)))
    bx.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    fig.subplots_adjust(left=0.07, right=0.7, hspace=0.35, top=0.95, bottom=0.07)
    _save(fig, path)


def pareto_front(memory: Any, time: Any) -> Any:
    """Indices of the plans on the front: taking plans in order of memory, each that is faster
    than every plan with less (or equal) memory. `memory` and `time` are numpy arrays."""
    import numpy as np

    order = np.lexsort((time, memory))
    t = time[order]
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(t)[:-1]))
    return order[t < best_before]


def plot_search(result: SearchResult, path: str) -> None:
    """Device memory against step time of every plan evaluated (a 2-D histogram: 100k+ plans), the
    budget, the plans that fit, their Pareto front and the chosen plan."""
    plt = _pyplot()
    check_plot_path(path)
    import numpy as np

    e = result.evaluated
    if e.step_time_s is None:
        raise MemplanError("--plot needs step times: give --gpu NAME")
    mem, time = e.device_bytes / GB, e.step_time_s
    fits = (e.device_bytes <= result.budget_bytes) & (e.device_bytes > 0)
    fig, ax = plt.subplots(figsize=(10, 6))
    # the view: every plan that fits and the ones up to 3x the budget (the rest are off the top)
    ymax = max(result.budget_bytes / GB * 3, float(mem[fits].max()) * 1.1 if fits.any() else 0)
    xmax = float(np.percentile(time, 99)) * 1.05
    shown = (mem <= ymax) & (time <= xmax)
    if shown.any():
        hb = ax.hexbin(time[shown], mem[shown], gridsize=70, bins="log", cmap="Greys", mincnt=1,
                       extent=(0, xmax, 0, ymax), linewidths=0)
        hb.set_rasterized(True)
        fig.colorbar(hb, ax=ax, label="plans per hexagon (all plans evaluated)")
    if fits.any():
        ax.scatter(time[fits], mem[fits], s=3, color="#55a868", alpha=0.5, lw=0, rasterized=True,
                   label=f"plans that fit: {int(fits.sum()):,} of {result.candidates:,}")
        idx = np.flatnonzero(fits)
        front = idx[pareto_front(e.device_bytes[fits], time[fits])]
        ax.step(time[front], mem[front], where="post", color="#dd8452", lw=1.5, marker="o", ms=3,
                label=f"Pareto front: the fastest plan for each memory level ({len(front)} plans)")
    if result.top:
        best = result.top[0]
        ax.plot([time[best]], [mem[best]], "*", color="#c44e52", ms=16, mec="black",
                label=f"chosen: {plan_text(result.row(best))}, {time[best]:.2f} s, {mem[best]:.2f} GB")
    ax.axhline(result.budget_bytes / GB, color="red", ls="--", lw=1.5,
               label=f"budget {result.budget_bytes / GB:.2f} GB per GPU")
    ax.set_xlim(0, xmax)
    ax.set_ylim(0, ymax)
    ax.set_xlabel("estimated step time (s)")
    ax.set_ylabel("device memory needed per GPU (GB)")
    gpu = f" {shortened(result.gpu.name)}" if result.gpu else ""
    ax.set_title(f"{shortened(result.model.name)}: {result.candidates:,} plans on {result.gpus:,}{gpu} GPUs, global batch "
                 f"{result.global_batch:,} (view: up to 3x the budget, fastest 99% of plans)", fontsize=10)
    ax.legend(loc="upper right", fontsize=7, framealpha=0.9)
    fig.tight_layout()
    _save(fig, path)


@dataclass(frozen=True)
class Technique:
    label: str
    t: int
    sp: bool
    recompute: str  # none | selective | full
    bytes: int  # activation bytes of one layer for one micro-batch on one GPU (K22 terms only)


def technique_bytes(config: Config) -> list[Technique]:
    """K22 Table 2 / Figure 7: one layer's activation bytes on one GPU under each technique, at the
    config's s, b and t, from the inventory's K22 terms (`--paper-only`'s view)."""
    model, t = config.model, config.parallel.tp
    terms = [x for x in inventory_for(model).terms if x.scope == "layer" and x.in_k22]
    act, b = config.training.activation_bytes, config.training.micro_batch
    rows = [("no parallelism", 1, False, "none"), (f"TP (t={t})", t, False, "none"), ("TP + SP", t, True, "none"),
            ("TP + selective recompute", t, False, "selective"), ("TP + SP + selective recompute", t, True, "selective"),
            ("full recompute", t, False, "full")]
    return [Technique(label, tp, sp, rec, int(layer_bytes(terms, model.symbols(b=b, t=tp), act, int(sp),
                                                          Recompute.parse(rec))))
            for label, tp, sp, rec in rows]


def plot_techniques(config: Config, path: str) -> None:
    """K22 Figure 7-style bars: activation memory per layer under each technique."""
    plt = _pyplot()
    check_plot_path(path)
    rows = technique_bytes(config)
    m = config.model
    fig, ax = plt.subplots(figsize=(9, 5))
    values = [r.bytes / GB for r in rows]
    bars = ax.bar(range(len(rows)), values, color=["#8c8c8c", "#4c72b0", "#8172b3", "#dd8452", "#55a868", "#c44e52"])
    for bar, r in zip(bars, rows):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                f"{r.bytes / GB:.3f} GB\n{r.bytes / rows[0].bytes:.1%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [r.label for r in rows], rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("activation memory per layer per micro-batch on one GPU (GB)")
    ax.set_ylim(0, max(values) * 1.2)
    ax.set_title(f"{shortened(m.name)} (s={m.seq_length}, b={config.training.micro_batch}, h={m.hidden_size}, "
                 f"a={m.num_attention_heads}): K22 Table 2 terms per technique (% of no parallelism)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
