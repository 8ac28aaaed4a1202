"""The `memplan` command line: parse options -> specs -> library call -> report. No arithmetic."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional

import click

from memplan.core.errors import MemplanError

# memplan/core/specs.py OPTIMIZERS (a test checks they agree; specs loads pydantic, which --help does not need)
OPTIMIZERS = ("adamw", "sgd", "sgd-nomomentum", "adafactor", "adam8bit", "muon", "lion")


def _console():
    from rich.console import Console

    console = Console()
    # Piped output (files, CI logs) gets a wide table instead of rich's 80-column default.
    return console if console.is_terminal else Console(width=150)


def _size(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[int]:
    from memplan.core.units import parse_size

    if value is None:
        return None
    size = parse_size(value)
    if size <= 0:
        raise MemplanError(f"{param.opts[0]}: a memory budget must be positive (got {value!r})")
    return size


def _tokens(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[int]:
    from memplan.core.units import parse_tokens

    return None if value is None else parse_tokens(value)


def _mst(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Any:
    if value is None:
        return None
    text = value.strip().lower()
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise MemplanError(f"--mst takes a number of mini-sequences >= 1 or 'auto', not {value!r}")
    return text if text == "auto" else int(text)


def plan_options(func: Callable) -> Callable:
    """Options shared by every command that builds a plan for a model."""
    options = [
        click.option("--model", "model_name", metavar="NAME|FILE.yaml", help="Model preset or YAML file."),
        click.option("--hf-config", "hf_config", metavar="config.json",
                     help="A transformers config.json (GPT-2 or the Llama layout), read as data."),
        click.option("--attention", type=click.Choice(["eager", "flash"]),
                     help="Attention kernel: eager stores the s x s scores; flash does not."),
        click.option("--tp", type=int, help="Tensor-parallel size t."),
        click.option("--pp", type=int, help="Pipeline-parallel size p."),
        click.option("--dp", type=int, help="Data-parallel size d."),
        click.option("--vpp", type=int, help="Interleaved (virtual) stages m per pipeline rank."),
        click.option("--first-stage-layers", type=click.IntRange(1), metavar="N",
                     help="Transformer layers on the first pipeline stage (uneven stages: Megatron-LM "
                          "--decoder-first-pipeline-num-layers; the middle stages split the rest)."),
        click.option("--last-stage-layers", type=click.IntRange(1), metavar="N",
                     help="Transformer layers on the last pipeline stage (Megatron-LM "
                          "--decoder-last-pipeline-num-layers)."),
        click.option("--sp/--no-sp", default=None, help="Sequence parallelism."),
        click.option("--cp", type=click.IntRange(1), help="Context-parallel size: each sequence split over cp GPUs "
                     "(GPUs = t p d cp; needs flash attention and 2 cp | s; memplan/memory/parallel.py). search: tried "
                     "from s >= 16384 on."),
        click.option("--cp-comm-type", type=click.Choice(["p2p", "a2a"]),
                     help="Context-parallel attention: p2p ring (default) or a2a (Ulysses; cp | heads per GPU)."),
        click.option("--ep", type=click.IntRange(1), help="Expert-parallel size (MoE models): E/ep routed experts "
                     "per GPU; ep x etp must divide t x cp x d."),
        click.option("--etp", type=click.IntRange(1), help="Expert tensor-parallel size (MoE models; default t)."),
        click.option("--moe-imbalance", type=click.FloatRange(1.0, 1024.0), metavar="F",
                     help="MoE, --impl megatron*: the busiest GPU's routed tokens relative to the average (1.0 = "
                          "balanced, default); scales the routed-token activations (pinned in search)."),
        click.option("--moe-capacity-factor", type=click.FloatRange(0, 1024.0, min_open=True), metavar="C",
                     help="MoE, --impl megatron*: each expert takes at most C k s b / E tokens, the rest dropped "
                          "(Megatron-LM --moe-expert-capacity-factor): routed terms bounded by min(imbalance, C)."),
        click.option("--moe-pad-to-capacity", is_flag=True, default=None,
                     help="With --moe-capacity-factor: every expert's input padded to its capacity (Megatron-LM "
                          "--moe-pad-expert-input-to-capacity): routed terms x C."),
        click.option("--moe-token-dispatcher", type=click.Choice(["alltoall", "allgather"]),
                     help="MoE: Megatron-LM --moe-token-dispatcher-type (default alltoall)."),
        click.option("--recompute", type=click.Choice(["none", "selective", "full"]), help="Activation recompute."),
        click.option("--recompute-num-layers", type=int,
                     help="With --recompute full: layers per model chunk to recompute (Megatron-LM block method)."),
        click.option("--micro-batch", type=int, help="Micro-batch size b."),
        click.option("--global-batch", type=int, help="Global batch in sequences per step."),
        click.option("--global-batch-tokens", callback=_tokens, metavar="TOKENS",
                     help="Global batch in tokens per step (4M = 4x10^6, 4Mi = 4x2^20), rounded to whole sequences."),
        click.option("--seq-len", type=int,
                     help="Sequence length s (the preset's tokens per step are kept unless the batch is given)."),
        click.option("--gpus", type=int, help="Number of GPUs (sets d = GPUs / (t p); scales the preset's global batch)."),
        click.option("--zero", type=click.IntRange(0, 3),
                     help="0 none; 1 optimizer states sharded over d (= Megatron-LM distributed optimizer); "
                          "2 also gradients; 3 also weights."),
        click.option("--zero-shard", type=int,
                     help="Shard ZeRO states over this many data-parallel ranks (HSDP; default d)."),
        click.option("--distributed-optimizer", is_flag=True, default=None,
                     help="Megatron-LM distributed optimizer (same memory as --zero 1)."),
        click.option("--impl", type=click.Choice(["megatron", "megatron-local", "torch", "hf-eager", "hf-sdpa"]), default="megatron",
                     show_default=True,
                     help="Which code runs the model: what it saves differs (see `memplan impls`)."),
        click.option("--precision", type=click.Choice(["bf16-mixed", "bf16-true", "16-mixed", "32-true"]),
                     help="Byte sizes of weights, gradients, master weights and optimizer states (PyTorch "
                          "Lightning's names; default bf16-mixed: Megatron-LM's 18 bytes per parameter)."),
        click.option("--optimizer", type=click.Choice(OPTIMIZERS),
                     help="Optimizer (pinned: search keeps it): adamw (default; 'adam' in YAML), sgd (momentum), "
                          "sgd-nomomentum, adafactor (factored second moment), adam8bit (bitsandbytes), muon (hidden "
                          "matrices; AdamW on the rest), lion. States and step temporaries: `memplan impls`."),
        click.option("--optimizer-impl", type=click.Choice(["foreach", "fused", "for-loop"]),
                     help="The optimizer's implementation: torch's foreach keeps parameter-sized temporaries in its "
                          "step, fused none, for-loop one tensor's (default: the implementation's where the optimizer "
                          "has it, else the optimizer's own; see `memplan impls`)."),
        click.option("--loss-chunks", type=click.IntRange(1), metavar="N",
                     help="LM head + cross-entropy in N checkpointed sequence chunks (chunked / fused linear "
                          "cross-entropy): the full fp32 logits never exist (pinned in search). Measured for --impl "
                          "hf-* and torch; derived for megatron, which has no such flag (memplan/inventory/chunked_loss.py)."),
        click.option("--fp8", "fp8", type=click.Choice(["delayed", "tensorwise", "blockwise", "mxfp8", "custom"]),
                     metavar="RECIPE",
                     help="FP8 training with Transformer Engine as Megatron-LM runs it (--fp8-recipe: delayed, "
                          "tensorwise or blockwise; pinned in search): FP8 linear inputs, weight caches, scaling "
                          "state, FP8 GEMMs. --impl megatron only; derived from TE's code, not measured (memplan/fp8.py)."),
        click.option("--fp8-format", type=click.Choice(["hybrid", "e4m3"]),
                     help="With --fp8: Megatron-LM --fp8-format (default hybrid: E4M3 forward, E5M2 gradients)."),
        click.option("--fp8-amax-history-len", type=click.IntRange(1), metavar="N",
                     help="With --fp8 delayed: amax values kept per FP8 tensor (default 1, Megatron-LM's)."),
        click.option("--fp8-param-gather", is_flag=True, default=None,
                     help="With --fp8: the linear weights kept only in FP8 (Megatron-LM --fp8-param-gather)."),
        click.option("--mst", callback=_mst, metavar="M|auto",
                     help="Mini-Sequence Transformer (MsT, arXiv 2407.15892; --impl hf-*, Llama layout, with "
                          "--recompute full, b = 1): the MLP and the LM head + loss run on M pieces of the sequence; "
                          "auto: as MsT's code, the MLP in pieces of max(4096/b, 1024) tokens and the head in 64. "
                          "search keeps it for every plan (and b = 1). memplan/inventory/mst.py."),
        click.option("--optimizer-in-backward", is_flag=True, default=None,
                     help="Step each parameter in a post-accumulate-grad hook inside the backward and free its "
                          "gradient (PyTorch's 'optimizer step in backward' recipe, MsT's benchmark loop: a for-loop "
                          "AdamW per parameter, the LM head's step after the embedding's); --impl hf-*, adamw, one "
                          "micro-batch. Measured (validation/step.py loop in-backward)."),
        click.option("--offload", "offload", multiple=True, type=click.Choice(["optimizer", "activations"]),
                     help="Keep in host memory (repeatable; search keeps it for every plan): optimizer = the master "
                          "weights and moments, stepped on the host (Megatron-LM's HybridDeviceOptimizer); activations "
                          "= the decoder layers' saved tensors (torch's save_on_cpu; no recompute). memplan/memory/offload.py."),
        click.option("--offload-fraction", type=click.FloatRange(0, 1, min_open=True), metavar="F",
                     help="With --offload optimizer: the fraction of the optimizer states offloaded (default 1.0; "
                          "Megatron-LM --optimizer-offload-fraction)."),
        click.option("--host-mem", "host_budget", callback=_size, metavar="SIZE",
                     help="Host memory per node for the offload, e.g. 2TB or 2TiB: a plan fits only within it too "
                          "(estimate's verdict, search's filter)."),
        click.option("--frag-margin", type=click.FloatRange(0, 1), metavar="FRACTION",
                     help="Caching-allocator margin above the allocated peak (default: the GPU preset's, 0.10)."),
        click.option("--gpu", "gpu_name", metavar="NAME|FILE.yaml", help="GPU preset (budget, speed)."),
        click.option("--mem", "budget", callback=_size, metavar="SIZE",
                     help="Memory budget per GPU, e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes)."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), func)


def _cp_ep(opts: dict[str, Any]) -> dict[str, Any]:
    """The context- and expert-parallel options as ParallelSpec fields."""
    return dict(cp=opts.get("cp"), cp_comm_type=opts.get("cp_comm_type"), ep=opts.get("ep"), etp=opts.get("etp"))


def _preset(opts: dict[str, Any]):
    """The model the options name: --model (preset or YAML) or --hf-config; None if neither."""
    from memplan.presets.catalog import load_model
    from memplan.presets.hf_config import read_hf_config

    if opts.get("model_name") and opts.get("hf_config"):
        raise MemplanError("give --model or --hf-config, not both")
    if opts.get("hf_config"):
        return read_hf_config(opts["hf_config"])
    return load_model(opts["model_name"]) if opts.get("model_name") else None


def _config_from_options(opts: dict[str, Any]):
    from memplan.presets.batch import make_config

    preset = _preset(opts)
    if preset is None:
        raise MemplanError("--model is required (a preset name or a YAML file; see `memplan models`), "
                           "or --hf-config config.json")
    zero = opts.get("zero")
    if opts.get("distributed_optimizer"):
        if zero not in (None, 1):
            raise MemplanError("--distributed-optimizer is ZeRO stage 1; it conflicts with --zero " + str(zero))
        zero = 1
    config = make_config(
        preset,
        parallel=dict(tp=opts.get("tp"), pp=opts.get("pp"), dp=opts.get("dp"), vpp=opts.get("vpp"),
                      sp=opts.get("sp"), zero=zero, zero_shard=opts.get("zero_shard"), **_cp_ep(opts),
                      first_stage_layers=opts.get("first_stage_layers"), last_stage_layers=opts.get("last_stage_layers")),
        training=dict(micro_batch=opts.get("micro_batch"), global_batch=opts.get("global_batch"),
                      recompute=opts.get("recompute"), recompute_num_layers=opts.get("recompute_num_layers"),
                      **_training_settings(opts)),
        model=dict(seq_length=opts.get("seq_len"), attention=opts.get("attention"), **_moe_routing(opts)),
        gpus=opts.get("gpus"),
        whole_model_per_rank=opts.get("impl", "megatron").startswith("hf-"),
        global_batch_tokens=opts.get("global_batch_tokens"),
    )
    return preset, config


def _moe_routing(opts: dict[str, Any]) -> dict[str, Any]:
    """The MoE routing options as ModelSpec fields (memplan/inventory/moe.py)."""
    return dict(moe_imbalance=opts.get("moe_imbalance"), moe_capacity_factor=opts.get("moe_capacity_factor"),
                moe_pad_to_capacity=opts.get("moe_pad_to_capacity"),
                moe_token_dispatcher=opts.get("moe_token_dispatcher"))


def _routed(preset: Any, opts: dict[str, Any], named: bool) -> Any:
    """A preset with the MoE routing options (search: pinned for every plan; a named dense model refuses them,
    the other presets of an all-presets search ignore them)."""
    import dataclasses

    from pydantic import ValidationError

    from memplan.core.model import ModelSpec
    from memplan.core.spec_base import describe_validation_error

    given = {k: v for k, v in _moe_routing(opts).items() if v is not None}
    if not given or not (named or preset.model.is_moe):
        return preset
    try:
        return dataclasses.replace(preset, model=ModelSpec(**{**preset.model.model_dump(exclude_unset=True), **given}))
    except ValidationError as e:
        raise MemplanError(describe_validation_error(e)) from None


def _batch_note(preset: Any, seq_length: int, global_batch: int, opts: dict[str, Any]) -> list[str]:
    from memplan.presets.batch import batch_note

    note = batch_note(preset, seq_length, global_batch, opts.get("global_batch"), opts.get("global_batch_tokens"),
                      opts.get("gpus"))
    return [note] if note else []


def _training_settings(opts: dict[str, Any]) -> dict[str, Any]:
    """Training settings that are not searched: precision, the optimizer and its implementation, loss chunks,
    offload."""
    offload = opts.get("offload") or ()
    fraction = opts.get("offload_fraction")
    if fraction is not None and "optimizer" not in offload:
        raise MemplanError("--offload-fraction needs --offload optimizer")
    fp8 = opts.get("fp8")
    if fp8 is None and any(opts.get(k) for k in ("fp8_format", "fp8_amax_history_len", "fp8_param_gather")):
        raise MemplanError("--fp8-format, --fp8-amax-history-len and --fp8-param-gather need --fp8 RECIPE")
    if fp8 is not None:
        from memplan.inventory.fp8 import check_fp8

        check_fp8(fp8, opts.get("impl", "megatron"))
    return dict(precision=opts.get("precision"), optimizer=opts.get("optimizer"), optimizer_impl=opts.get("optimizer_impl"),
                loss_chunks=opts.get("loss_chunks"), fp8=fp8, fp8_format=opts.get("fp8_format"),
                fp8_amax_history_len=opts.get("fp8_amax_history_len"), fp8_param_gather=opts.get("fp8_param_gather"),
                mst=opts.get("mst"), optimizer_in_backward=opts.get("optimizer_in_backward"),
                offload_optimizer_fraction=(1.0 if fraction is None else fraction) if "optimizer" in offload else None,
                offload_activations=True if "activations" in offload else None)


def output_options(func: Callable) -> Callable:
    """--format and --plot, shared by estimate and search."""
    options = [
        click.option("--format", "fmt", type=click.Choice(["table", "json", "markdown", "csv"]),
                     help="Output: a terminal table (default), JSON (= --json), a Markdown table (docs, issue "
                          "threads) or CSV (spreadsheets); all from the one JSON schema."),
        click.option("--plot", "plot", metavar="FILE.png|FILE.svg",
                     help="Also draw a picture into FILE (PNG or SVG by the extension; needs memplan[plot])."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), func)


def _output_format(opts: dict[str, Any]) -> str:
    """The output format: --format, with --json as an alias of --format json."""
    fmt = opts.get("fmt")
    if opts.get("as_json"):
        if fmt not in (None, "json"):
            raise MemplanError(f"--json conflicts with --format {fmt}")
        return "json"
    return fmt or "table"


def _check_plots(*paths: Optional[str]) -> None:
    """Refuse a bad --plot file name before any work is done (memplan.plots loads only then)."""
    for path in paths:
        if path:
            from memplan.report.plots import check_plot_path

            check_plot_path(path)


def _gpu(opts: dict[str, Any], preset: Any):
    from memplan.presets.catalog import load_gpu

    name = opts.get("gpu_name") or (preset.gpu if preset is not None else None)
    return load_gpu(name) if name else None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memplan")
def cli() -> None:
    """memplan: will this transformer training run fit in GPU memory, and where do the bytes go?"""


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def models(as_json: bool) -> None:
    """List the model presets."""
    from memplan.memory.states import total_params
    from memplan.presets.catalog import load_model, model_names
    from memplan.report.formats import print_json
    from memplan.report.tables import render_models

    rows = []
    for name in model_names():
        p = load_model(name)
        m = p.model
        plan = " ".join(f"{k}={v}" for k, v in {**p.parallel, **p.training}.items())
        rows.append(dict(name=name, L=m.num_layers, h=m.hidden_size, a=m.num_attention_heads, g=m.g,
                         s=m.seq_length, v=m.vocab_size, params=total_params(m), plan=plan))
    if as_json:
        print_json(rows)
    else:
        render_models(rows, _console())


@cli.command()
def impls() -> None:
    """List the implementations whose saved tensors memplan models, and the optimizers."""
    from memplan.inventory.assemble import IMPLEMENTATIONS
    from memplan.memory.optimizers import OPTIMIZER_INFO

    for name, text in IMPLEMENTATIONS.items():
        click.echo(f"{name:10s} {text}")
    click.echo("\noptimizers (--optimizer; implementations for --optimizer-impl, the default first):")
    for name, info in OPTIMIZER_INFO.items():
        click.echo(f"{name:14s} {info.title} [{', '.join(info.impls)}]: {info.source}")
    from memplan.inventory.chunked_loss import INFO as CHUNKS_INFO
    from memplan.inventory.fp8 import INFO as FP8_INFO
    from memplan.inventory.mst import TECHNIQUES
    from memplan.memory.parallel import IMPLS_TEXT

    click.echo("\ntechniques (how each is known):")
    for text in (IMPLS_TEXT, FP8_INFO, CHUNKS_INFO, *(f"{name}: {text}" for name, text in TECHNIQUES.items())):
        click.echo(text)


@cli.command()
def gpus() -> None:
    """List the GPU presets."""
    from memplan.core.units import format_bytes, format_flops
    from memplan.presets.catalog import gpu_names, load_gpu

    for name in gpu_names():
        g = load_gpu(name)
        click.echo(f"{name:12s} {format_bytes(g.memory_bytes, 'GB')} ({format_bytes(g.memory_bytes, 'GiB')}), "
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
def estimate(**opts: Any) -> None:
    """Memory per GPU of one plan: weights, gradients, optimizer, activations term by term, and the
    peak of a training step."""
    from memplan.plan.estimate import estimate as run
    from memplan.report.formats import estimate_dict, render_output
    from memplan.report.tables import render_estimate, render_limits

    fmt = _output_format(opts)
    _check_plots(opts["plot"], opts["plot_techniques"])
    preset, config = _config_from_options(opts)
    gpu = _gpu(opts, preset)
    result = run(config, budget_bytes=opts.get("budget"), gpu=gpu, paper_only=opts["paper_only"],
                 impl=opts["impl"], fragmentation_margin=opts.get("frag_margin"), host_budget_bytes=opts.get("host_budget"))
    if opts.get("seq_len") is None:
        result.notes.extend(preset.notes)
    result.notes.extend(_batch_note(preset, config.model.seq_length, config.global_batch, opts))
    if opts["require_fit"] and result.budget_bytes is None:
        raise MemplanError("--require-fit needs a budget: give --mem SIZE or --gpu NAME")
    limits: dict[str, Any] = {}
    if opts["max_seq"] or opts["max_micro_batch"]:
        from memplan.plan.limits import max_micro_batch, max_seq_len, need_budget

        budget = need_budget(result.budget_bytes, "--max-seq / --max-micro-batch")
        kw = dict(impl=opts["impl"], gpu=gpu, fragmentation_margin=opts.get("frag_margin"))
        if opts["max_seq"]:
            limits["max_seq_len"] = max_seq_len(config, budget, **kw)
        if opts["max_micro_batch"]:
            limits["max_micro_batch"] = max_micro_batch(config, budget, **kw)
    if fmt == "table":
        console = _console()
        render_estimate(result, console)
        render_limits(limits, result, console)
    else:
        render_output(fmt, "estimate", {**estimate_dict(result), **limits})
    if opts["plot"]:
        from memplan.report.plots import plot_estimate

        plot_estimate(result, opts["plot"])
    if opts["plot_techniques"]:
        from memplan.report.plots import plot_techniques

        plot_techniques(config, opts["plot_techniques"])
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
@click.option("--top", type=click.IntRange(1), default=10, show_default=True, help="Plans (rows) to show.")
@click.option("--sort", "sort", type=click.Choice(["time", "memory"]), default="time", show_default=True,
              help="Order of the plans that fit: estimated step time (then memory), or device memory (then time).")
@click.option("--all-variants", is_flag=True,
              help="List every plan that fits: no folding of ZeRO and recompute variants into rows.")
@click.option("--max-tp", type=click.IntRange(1), help="Largest t to consider (default: GPUs per node).")
@click.option("--uneven-stages", is_flag=True,
              help="Also search uneven pipeline stages: one or two layers fewer on the first and / or the last stage, "
                   "the middle stages splitting the rest (p need not divide L); --first-stage-layers / "
                   "--last-stage-layers pin a split.")
@click.option("--require-fit", is_flag=True, help="Exit 1 when no plan fits (for scripts).")
@click.option("--emit", type=click.Choice(["megatron"]),
              help="Also print the best plan as Megatron-LM arguments and the environment they need (with --json: "
                   "inside the document, as launch).")
@click.option("--emit-only", is_flag=True,
              help="With --emit: print only the launch block (export/unset lines, then the arguments one per line "
                   "with \\ continuations, to paste after `torchrun ... pretrain_gpt.py`); notes go to stderr.")
@click.option("--max-seq", is_flag=True,
              help="Find the longest sequence length (a multiple of 128) some plan fits with, and rank the plans "
                   "that fit at that length.")
def search(**opts: Any) -> None:
    """Every plan for GPUS GPUs that fits the budget, fastest first (--sort memory: least device memory
    first, ties by step time), ZeRO and recompute variants folded into rows as below. Without --model:
    every preset, each timed on its own preset's GPU (its YAML's gpu:; --gpu NAME times them all on
    one), and the presets that could not be searched listed with the reason."""
    from memplan.plan.arrange import arrange
    from memplan.plan.search import search_presets
    from memplan.plan.space import fixed_from
    from memplan.plan.search import search as run
    from memplan.presets.batch import search_inputs
    from memplan.presets.catalog import load_model, model_names
    from memplan.report.formats import render_output, search_dict, skipped_dict
    from memplan.report.search_tables import DelayedProgress, render_search, render_search_all

    fmt = _output_format(opts)
    _check_emit(opts, fmt)
    _check_plots(opts["plot"])
    gpus = opts.get("gpus")
    if gpus is None:
        raise MemplanError("--gpus is required for search")
    zero = 1 if opts.get("distributed_optimizer") else opts.get("zero")
    if opts.get("mst") not in (None, 1) and _preset(opts) is None:
        raise MemplanError("search --mst needs --model (MsT is modelled for the Llama layout)")
    fixed = fixed_from(
        dict(tp=opts.get("tp"), pp=opts.get("pp"), dp=opts.get("dp"), vpp=opts.get("vpp"), sp=opts.get("sp"),
             zero=zero, zero_shard=opts.get("zero_shard"), **_cp_ep(opts), first_stage_layers=opts.get("first_stage_layers"),
             last_stage_layers=opts.get("last_stage_layers"), uneven=opts.get("uneven_stages")),
        dict(micro_batch=opts.get("micro_batch"), recompute=opts.get("recompute"),
             recompute_num_layers=opts.get("recompute_num_layers")),
    )
    one = _preset(opts)
    presets = [one] if one is not None else [load_model(name) for name in model_names()]
    presets = [_routed(p, opts, one is not None) for p in presets]
    if opts["plot"] and len(presets) > 1:
        raise MemplanError("search --plot draws one model's plans: give --model")
    if opts["emit_only"] and len(presets) > 1:
        raise MemplanError("--emit-only prints one launch block: give --model")
    gpu_of = [_search_gpu(opts, p) for p in presets]
    console = _console()
    progress = DelayedProgress(console) if fmt == "table" and not opts["emit_only"] else None
    requests = [(*search_inputs(p, gpus, opts.get("global_batch"), opts.get("seq_len"), opts.get("attention"),
                                _training_settings(opts), opts.get("global_batch_tokens")),
                 gpu, opts["budget"] if opts.get("budget") is not None else gpu.memory_bytes)
                for p, (gpu, _) in zip(presets, gpu_of)]
    kw = dict(fixed=fixed, max_tp=opts.get("max_tp"), top=opts["top"], impl=opts["impl"],
              margin=opts.get("frag_margin"), host_budget_bytes=opts.get("host_budget"))
    skipped = []
    try:
        if len(presets) == 1:
            from memplan.plan.search import search_max_seq

            model, training, gb, gpu, budget = requests[0]
            report = functools.partial(progress, label=model.name) if progress is not None else None
            results = [(search_max_seq if opts["max_seq"] else run)(model, training, gpus, gb, budget, gpu=gpu,
                                                                    progress=report, **kw)]
        else:
            results, skipped = search_presets(requests, gpus, max_seq=opts["max_seq"], progress=progress, **kw)
    finally:
        if progress is not None:
            progress.close()
    results = [arrange(r, opts["sort"], not opts["all_variants"], opts["top"]) for r in results]
    launch = {}
    if opts.get("emit") == "megatron":
        from memplan.launch.megatron import megatron_launch

        launch = {r.model.name: megatron_launch(r.config(r.top[0])) for r in results if r.top}
    by_name = {p.model.name: (p, note) for p, (_, note) in zip(presets, gpu_of)}
    for r in results:
        p, gpu_note = by_name[r.model.name]
        if opts.get("seq_len") is None and len(presets) == 1:
            r.notes.extend(p.notes)
        r.notes.extend(_batch_note(p, r.model.seq_length, r.global_batch, opts) + gpu_note + _optimizer_notes(r))
    if opts["emit_only"]:
        _emit_only(launch)
    elif fmt != "table":
        dicts = [search_dict(r) for r in results] + [skipped_dict(s, gpus) for s in skipped]
        if fmt == "json":  # the launch arguments go inside the one JSON document
            for d in dicts:
                if d["model"] in launch:
                    d["launch"] = launch[d["model"]].as_dict()
        render_output(fmt, "search", dicts[0] if len(presets) == 1 else dicts)
    elif len(presets) == 1:
        render_search(results[0], console)
    else:
        render_search_all(results, skipped, console, gpu_given=bool(opts.get("gpu_name")),
                          assumed=[p.model.name for p, (_, note) in zip(presets, gpu_of) if note])
    if opts["plot"]:
        from memplan.report.plots import plot_search

        plot_search(results[0], opts["plot"])
    if launch and fmt in ("table", "markdown") and not opts["emit_only"]:
        for name, plan in launch.items():
            script = plan.script(f"{name}: best plan as Megatron-LM arguments")
            click.echo(f"```bash\n{script}\n```" if fmt == "markdown" else script)
    if opts["require_fit"] and not any(r.top for r in results):
        sys.exit(1)


def _optimizer_notes(result: Any) -> list[str]:
    """What a search says about its (pinned) optimizer: implementation and the source of its figures."""
    from memplan.inventory.assemble import training_inventory
    from memplan.memory.optimizers import notes
    from memplan.memory.timeline import optimizer_impl

    if result.training.optimizer == "adamw":
        return []
    impl = optimizer_impl(result.training, training_inventory(result.model, result.impl, "cuda", result.training))
    return notes(result.training, impl, pinned=True)


def _search_gpu(opts: dict[str, Any], preset: Any) -> tuple[Any, list[str]]:
    """The GPU a search times a model on: --gpu, else the preset's own, else the A100 (with a note)."""
    gpu = _gpu(opts, preset)
    if gpu is not None:
        return gpu, []
    gpu = _gpu({"gpu_name": "a100-80gb"}, None)
    return gpu, [f"{preset.model.name} names no GPU: timed on {gpu.name} (--gpu NAME sets one)"]


def _check_emit(opts: dict[str, Any], fmt: str) -> None:
    """Refuse --emit / --emit-only combinations that cannot give a launch block, before any work."""
    if opts.get("emit") and fmt == "csv":
        raise MemplanError("--emit megatron cannot follow CSV rows: use --format json (the arguments go in the "
                           "document) or table / markdown")
    if opts["emit_only"] and not opts.get("emit"):
        raise MemplanError("--emit-only needs --emit megatron")
    if opts["emit_only"] and fmt != "table":
        raise MemplanError(f"--emit-only prints the launch block alone; it conflicts with --format {fmt} "
                           "(with --json the arguments go in the document)")
    if opts.get("emit") and opts.get("mst") not in (None, 1):
        raise MemplanError("--emit megatron cannot express --mst: Megatron-LM has no mini-sequence MLP / LM head "
                           "(MsT is modelled for transformers models, --impl hf-*)")
    if opts.get("emit") and opts["impl"] != "megatron":
        raise MemplanError(f"--emit megatron launches Megatron-LM: plan it with --impl megatron (got --impl "
                           f"{opts['impl']}, whose memory differs)")


def _emit_only(launch: dict[str, Any]) -> None:
    """search --emit-only: the launch block alone on stdout, its notes on stderr; exit 1 if no plan fits."""
    if not launch:
        click.echo("memplan: no plan fits: nothing to launch", err=True)
        sys.exit(1)
    (plan,) = launch.values()
    for note in plan.notes:
        click.echo(f"memplan: note: {note}", err=True)
    click.echo(plan.block())


@cli.command()
@plan_options
def explain(**opts: Any) -> None:
    """Every number of `estimate` derived step by step: the formulas with the values substituted and the
    source of each term (per-layer activations, pipeline copies, states, the step peak, device memory)."""
    from memplan.report.explain import SECTIONS
    from memplan.report.explain import explain as run
    from memplan.report.formats import explain_lines, print_json

    preset, config = _config_from_options(opts)
    _, steps = run(config, budget_bytes=opts.get("budget"), gpu=_gpu(opts, preset), impl=opts["impl"],
                   fragmentation_margin=opts.get("frag_margin"))
    if opts["as_json"]:
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
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def validate(device: str, tps: tuple[int, ...], recomputes: tuple[str, ...], fake: bool, hf: Optional[bool],
             mcore: Optional[bool], terms: bool, peak: bool, as_json: bool) -> None:
    """Run real torch layers, measure what they save, compare with memplan (exit 1 on a miss). Needs torch."""
    import importlib.util

    from memplan.check.cases import grid, hf_grid
    from memplan.check.validate import run, summary
    from memplan.report.formats import print_json, validation_dict
    from memplan.report.validate_tables import render_validation

    try:
        import torch  # noqa: F401
    except ImportError:
        raise MemplanError("validate needs torch: pip install torch==2.13.0 && pip install -e '.[validate]'") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise MemplanError("--device cuda: no CUDA device is available")
    have_hf = importlib.util.find_spec("transformers") is not None
    if peak:
        from memplan.check.peak import peak_grid, peak_summary, run_peak
        from memplan.report.formats import peak_validation_dict
        from memplan.report.validate_tables import render_peak_validation

        if not have_hf:
            raise MemplanError("--peak needs transformers: pip install -e '.[test]'")
        results = run_peak(peak_grid(fake, device))
        totals = peak_summary(results)
        if as_json:
            print_json(peak_validation_dict(results, totals))
        else:
            render_peak_validation(results, totals, _console())
        if totals["failed"]:
            sys.exit(1)
        return
    if hf and not have_hf:
        raise MemplanError("--hf needs transformers: pip install -e '.[test]'")
    cases = grid(device, tps, recomputes, fake and device == "cpu")
    if (have_hf if hf is None else hf) and device == "cpu":
        cases += hf_grid(fake)
    from memplan.check.cases import mcore_available, mcore_grid

    if mcore and not mcore_available():
        raise MemplanError("--mcore needs megatron-core: pip install -e '.[test]'")
    if (mcore_available() if mcore is None else mcore) and device == "cpu":
        cases += mcore_grid(tuple(t for t in tps if t <= 2), recomputes)
    results = run(cases, device)
    if (have_hf if hf is None else hf) and device == "cpu":
        from memplan.check.cases import traced_grid
        from memplan.check.validate import run_traced

        results += run_traced(traced_grid())  # the traced families against real runs
    totals = summary(results)
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
def trace(hf_config: str, impl: str, kernels: str, out: Optional[str]) -> None:
    """Trace what transformers' own code saves for the backward, symbolic in s and b (FakeTensorMode:
    no memory, no GPU): an inventory file estimate and search can use. Needs torch and transformers."""
    from memplan.inventory.traced_file import trace_to_yaml

    text = trace_to_yaml(hf_config, impl, kernels)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        click.echo(f"wrote {out}", err=True)
    else:
        click.echo(text, nl=False)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: bad input gives one line on stderr and exit code 2, never a traceback."""
    try:
        code = cli.main(args=argv, prog_name="memplan", standalone_mode=False)
    except MemplanError as err:
        click.echo(f"memplan: error: {err}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("memplan: aborted", err=True)
        sys.exit(1)
    except click.ClickException as err:
        click.echo(f"memplan: error: {err.format_message()}", err=True)
        sys.exit(err.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
