"""The `memplan` command line (its shared options in cli/options.py): parse the options -> call the API
(memplan.api) -> render the report. No arithmetic, no model logic. Each command imports only what it uses,
when it runs (`memplan --help` loads no other memplan module; benchmarks/bench_startup.py)."""

from __future__ import annotations

import sys
from typing import Any, Optional

import click

from memplan.cli.options import (AsciiIntRange, check_plots, emit_options, output_format, output_options, plan_options,
                                 refuse)


def _console():
    from rich.console import Console

    console = Console()  # piped output (files, CI logs) gets a wide table instead of rich's 80-column default
    return console if console.is_terminal else Console(width=150)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memplan")
def cli() -> None:
    """memplan: will this transformer training run fit in GPU memory, and where do the bytes go?"""


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def models(as_json: bool) -> None:
    """List the model presets."""
    from memplan.api.catalog import models as model_rows
    from memplan.report.formats import print_json
    from memplan.report.tables import render_models

    rows = model_rows()
    if as_json:
        print_json(rows)
    else:
        render_models(rows, _console())


@cli.command()
def impls() -> None:
    """List the implementations whose saved tensors memplan models, and the optimizers."""
    from memplan.api.catalog import impls_lines

    click.echo("\n".join(impls_lines()))


@cli.command()
def gpus() -> None:
    """List the GPU presets."""
    from memplan.api.catalog import gpus as gpu_presets
    from memplan.core.units import format_bytes, format_flops
    from memplan.report.escape import plain

    for name, g in gpu_presets().items():
        click.echo(f"{plain(name):12s} {format_bytes(g.memory_bytes, 'GB')} ({format_bytes(g.memory_bytes, 'GiB')}), "
                   f"{format_flops(g.peak_bf16_flops)} bf16, {g.gpus_per_node} per node")


@cli.command()
@plan_options
@output_options
@click.option("--plot-techniques", "plot_techniques", metavar="FILE.png|FILE.svg",
              help="Also draw K22 Figure 7-style bars: one layer's activation memory under each technique (no "
                   "parallelism, TP, TP+SP, selective and full recompute) at this plan's s, b and t.")
@click.option("--paper-only", is_flag=True, help="Only the terms K22 counts (no layer-norm statistics, token ids).")
@click.option("--max-seq", is_flag=True, help="Also the longest sequence length this plan fits with.")
@click.option("--max-micro-batch", is_flag=True, help="Also the largest micro-batch this plan fits with.")
@click.option("--require-fit", is_flag=True,
              help="Exit 1 when the plan does not fit its budget (for scripts; needs --mem or a GPU).")
@emit_options("the plan")
def estimate(**opts: Any) -> None:
    """Memory per GPU of one plan: weights, gradients, optimizer, activations term by term, and the
    peak of a training step."""
    from memplan.api.estimating import estimate as run
    from memplan.report.formats import render_output
    from memplan.report.tables import render_estimate, render_limits

    fmt = output_format(opts)
    plot, plot_techniques, emit_only = opts.pop("plot"), opts.pop("plot_techniques"), opts.pop("emit_only")
    _check_emit(opts.get("emit"), emit_only, fmt)
    check_plots({"--plot": plot, "--plot-techniques": plot_techniques})
    result = run(**opts)
    if emit_only:
        _print_launch(result.launch)
    elif fmt == "table":
        console = _console()
        render_estimate(result.estimate, console)
        render_limits(result.limits, result.estimate, console)
    else:
        render_output(fmt, "estimate", result.to_dict())
    if plot:
        from memplan.report.plots import plot_estimate

        plot_estimate(result.estimate, plot)
    if plot_techniques:
        from memplan.report.plots import plot_techniques as draw_techniques

        draw_techniques(result.config, plot_techniques)
    if result.launch and fmt in ("table", "markdown") and not emit_only:
        _echo_script(result.launch.script(f"{result.config.model.name}: the plan as {result.launch.what}"),
                     fmt)
    if opts["require_fit"] and not result.fits:
        sys.exit(1)


class _SearchCommand(click.Command):
    """`search`, whose --help ends with the folding rule, read from the planner only when help is shown
    (the planner loads numpy, which no other command's start-up needs)."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from memplan.plan.arrange import FOLDING_RULE

        super().format_help_text(ctx, formatter)
        with formatter.indentation():
            formatter.write_paragraph()
            for line in (FOLDING_RULE + "\n--all-variants lists every plan that fits, unfolded.").splitlines():
                formatter.write(" " * formatter.current_indent + line + "\n")


@cli.command(cls=_SearchCommand)
@plan_options
@output_options
@click.option("--top", type=AsciiIntRange(1), default=10, show_default=True, help="Plans (rows) to show.")
@click.option("--sort", "sort", type=click.Choice(["time", "memory"]), default="time", show_default=True,
              help="Order of the plans that fit: estimated step time (then memory), or device memory (then time).")
@click.option("--all-variants", is_flag=True,
              help="List every plan that fits: no folding of ZeRO and recompute variants into rows.")
@click.option("--max-tp", type=AsciiIntRange(1), help="Largest t to consider (default: GPUs per node).")
@click.option("--uneven-stages", is_flag=True,
              help="Also search uneven pipeline stages: one or two layers fewer on the first and / or the last stage, "
                   "the middle stages splitting the rest (p need not divide L); --first-stage-layers / "
                   "--last-stage-layers pin a split.")
@click.option("--require-fit", is_flag=True, help="Exit 1 when no plan fits (for scripts).")
@emit_options("the best plan")
@click.option("--max-seq", is_flag=True,
              help="Find the longest sequence length (a multiple of 128) some plan fits with, and rank the plans "
                   "that fit at that length.")
def search(**opts: Any) -> None:
    """Every plan for GPUS GPUs that fits the budget, fastest first (--sort memory: least device memory
    first, ties by step time), ZeRO and recompute variants folded into rows as below. Without --model:
    every preset, each timed on its own preset's GPU (its YAML's gpu:; --gpu NAME times them all on
    one), and the presets that could not be searched listed with the reason."""
    from memplan.api.searching import prepare_search
    from memplan.api.values import check_emit
    from memplan.report.formats import render_output
    from memplan.report.search_tables import DelayedProgress, render_search, render_search_all

    fmt = output_format(opts)
    plot, emit_only, require_fit = opts.pop("plot"), opts.pop("emit_only"), opts.pop("require_fit")
    _check_emit(opts.get("emit"), emit_only, fmt)
    check_emit(opts.get("emit"), opts.get("mst"), opts["impl"])
    check_plots({"--plot": plot})
    prepared = prepare_search(**opts)
    if plot and not prepared.one_model:
        refuse("search --plot draws one model's plans: give --model")
    if emit_only and not prepared.one_model:
        refuse("--emit-only prints one launch block: give --model")
    console = _console()
    progress = DelayedProgress(console) if fmt == "table" and not emit_only else None
    try:
        found = prepared.run(progress)
    finally:
        if progress is not None:
            progress.close()
    results, launch = found.results, found.launch
    if emit_only:
        _emit_only(launch)
    elif fmt != "table":
        render_output(fmt, "search", found.to_dict(launch=fmt == "json"))  # JSON: the launch inside the document
    elif found.one_model:
        render_search(results[0], console)
    else:
        render_search_all(results, found.skipped, console, gpu_given=bool(opts.get("gpu")),
                          assumed=found.assumed_gpu)
    if plot:
        from memplan.report.plots import plot_search

        plot_search(results[0], plot)
    if launch and fmt in ("table", "markdown") and not emit_only:
        for name, plan in launch.items():
            _echo_script(plan.script(f"{name}: best plan as {plan.what}"), fmt)
    if require_fit and not found.fits:
        sys.exit(1)


def _check_emit(emit: Optional[str], emit_only: bool, fmt: str) -> None:
    """Refuse --emit / --emit-only with a format that cannot show the launch block, before any work."""
    if emit and fmt == "csv":
        refuse(f"--emit {emit} cannot follow CSV rows: use --format json (the arguments go in the "
               "document) or table / markdown")
    if emit_only and not emit:
        refuse("--emit-only needs --emit megatron|bridge|accelerate|deepspeed|torchtitan")
    if emit_only and fmt != "table":
        refuse(f"--emit-only prints the launch block alone; it conflicts with --format {fmt} "
               "(with --json the arguments go in the document)")


def _emit_only(launch: dict[str, Any]) -> None:
    """search --emit-only: the launch block alone on stdout, its notes on stderr; exit 1 if no plan fits."""
    if not launch:
        click.echo("memplan: no plan fits: nothing to launch", err=True)
        sys.exit(1)
    (plan,) = launch.values()
    _print_launch(plan)


def _print_launch(plan: Any) -> None:
    """--emit-only: the launch block alone on stdout, its notes on stderr."""
    for note in plan.notes:
        click.echo(f"memplan: note: {note}", err=True)
    click.echo(plan.block())


def _echo_script(script: str, fmt: str) -> None:
    """The launch script after the report: as it is (table), or in a bash code block (markdown)."""
    click.echo(f"```bash\n{script}\n```" if fmt == "markdown" else script)


@cli.command()
@plan_options
def explain(**opts: Any) -> None:
    """Every number of `estimate` derived step by step: the formulas with the values substituted and the
    source of each term (per-layer activations, pipeline copies, states, the step peak, device memory)."""
    from memplan.api.explaining import explain as run
    from memplan.report.explain import SECTIONS
    from memplan.report.formats import explain_lines, print_json

    as_json = opts.pop("as_json")
    steps = run(**opts)
    if as_json:
        print_json([s.as_dict() for s in steps])
    else:
        click.echo("\n".join(explain_lines(steps, SECTIONS)))


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def _recompute_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in value.split(","))
    for item in items:
        if item not in ("none", "selective", "full"):
            raise click.BadParameter(f"recompute must be none, selective or full (got {item!r})")
    return items


@cli.command()
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--tp", "tps", default="1,2,4", show_default=True, callback=_int_list,
              help="Tensor-parallel sizes (t > 1 spawns t processes).")
@click.option("--recompute", "recomputes", default="none,selective,full", show_default=True,
              callback=_recompute_list)
@click.option("--fake/--no-fake", default=True, show_default=True,
              help="Also the 175B and 530B layers at t = 8 under FakeTensorMode.")
@click.option("--hf/--no-hf", "hf", default=None,
              help="Also transformers GPT-2 and Llama, eager and sdpa (default: when transformers is installed).")
@click.option("--mcore/--no-mcore", "mcore", default=None,
              help="Also megatron-core's local spec (GPT and Llama-like layers and GPTModels, t = 1, 2; --impl "
                   "megatron-local) on CPU (default: when megatron-core is installed).")
@click.option("--terms", is_flag=True, help="Show every case term by term (failures always are).")
@click.option("--peak", is_flag=True,
              help="Instead: whole training steps (forward, loss, backward, optimizer step: AdamW, SGD, Adafactor, "
                   "Muon), the measured allocated "
                   "peak against memplan's (1% tolerance; --device cuda: torch.cuda.max_memory_allocated).")
@click.option("--allocator", "allocator", is_flag=True,
              help="Instead: the allocation streams of real runs (build, optimizer, two steps of tiny Llama-shaped "
                   "transformers models) replayed through memplan's caching-allocator model beside memplan's own "
                   "streams; --device cuda records torch.cuda.memory._snapshot(), checks the replay against "
                   "max_memory_reserved and memplan's --max-seq of llama3-8b against real runs.")
@click.option("--record", "record_dir", metavar="DIR", default=None,
              help="With --allocator: save each recorded run in DIR as CASE-ALLOCATOR.json.gz (gzip JSON).")
@click.option("--max-seq/--no-max-seq", "max_seq", default=True, show_default=True,
              help="With --allocator --device cuda: also check memplan's longest sequence against real runs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def validate(device: str, tps: tuple[int, ...], recomputes: tuple[str, ...], fake: bool, hf: Optional[bool],
             mcore: Optional[bool], terms: bool, peak: bool, allocator: bool, record_dir: Optional[str], max_seq: bool,
             as_json: bool) -> None:
    """Run real torch layers, measure what they save, compare with memplan (exit 1 on a miss). Needs torch."""
    from memplan.api import checks
    from memplan.report.formats import allocator_validation_dict, peak_validation_dict, print_json, validation_dict
    from memplan.report.validate_tables import (render_allocator_validation, render_peak_validation,
                                                render_validation)

    if allocator:
        results, seqs, totals = checks.validate_allocator(device, record_dir, max_seq)
        if as_json:
            print_json(allocator_validation_dict(results, seqs, totals))
        else:
            render_allocator_validation(results, seqs, totals, _console())
    elif peak:
        results, totals = checks.validate_peak(device, fake)
        if as_json:
            print_json(peak_validation_dict(results, totals))
        else:
            render_peak_validation(results, totals, _console())
    else:
        results, totals = checks.validate(device, tps, recomputes, fake, hf, mcore)
        if as_json:
            print_json(validation_dict(results, totals))
        else:
            render_validation(results, totals, _console(), terms)
    if totals["failed"]:
        sys.exit(1)


@cli.command()
@click.option("--hf-config", "hf_config", required=True, metavar="config.json",
              help="A transformers config.json (read as data; no weights are downloaded).")
@click.option("--impl", type=click.Choice(["hf-sdpa", "hf-eager"]), default="hf-sdpa", show_default=True,
              help="transformers' attention implementation to trace.")
@click.option("--kernels", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="Whose kernels' saved tensors: CUDA's (emulated on this machine) or CPU's.")
@click.option("--out", metavar="FILE.yaml", help="Write the inventory here (default: print it).")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists (never the config.json it reads).")
def trace(hf_config: str, impl: str, kernels: str, out: Optional[str], force: bool) -> None:
    """Trace what transformers' own code saves for the backward, symbolic in s and b (FakeTensorMode:
    no memory, no GPU): an inventory file estimate and search can use. Needs torch and transformers."""
    from memplan.core.outfile import check_output, write_bytes
    from memplan.inventory.traced_file import trace_to_yaml

    path = check_output(out, "--out", overwrite=force, reads=hf_config) if out else None
    text = trace_to_yaml(hf_config, impl, kernels)
    if path:
        write_bytes(path, text.encode("utf-8"))
        click.echo(f"wrote {out}", err=True)
    else:
        click.echo(text, nl=False)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: bad input gives one line on stderr and exit code 2, never a traceback."""
    for stream in (sys.stdout, sys.stderr):  # a non-ASCII name prints (escaped) under an ASCII locale too
        getattr(stream, "reconfigure", lambda **_: None)(errors="backslashreplace")
    try:
        code = cli.main(args=argv, prog_name="memplan", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("memplan: aborted", err=True)
        sys.exit(1)
    except click.ClickException as err:
        message = err.format_message()  # click echoes the value: a 5000-digit --tp must not fill the screen
        click.echo(f"memplan: error: {message if len(message) < 400 else message[:300] + ' ...'}", err=True)
        sys.exit(err.exit_code)
    except ValueError as err:  # MemplanError: memplan.core.errors is loaded by whatever raised it
        errors = sys.modules.get("memplan.core.errors")
        if errors is None or not isinstance(err, errors.MemplanError):
            raise
        click.echo(f"memplan: error: {err}", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)

