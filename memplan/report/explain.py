"""`explain`: every number of an estimate derived step by step, symbol by symbol, with the values
substituted and the source of each term, e.g.

    34sbh/t = 34 x 2048 x 1 x 20480 / 8 = 178,257,920 B

The numbers are `estimate`'s own (memplan/plan/estimate.py) and the symbolic text is the inventory's
Poly (memplan/core/symbolic.py); this module only lays them out as a list of `Step`s (data: the report
renders them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Optional

from memplan.core.specs import Config, GpuSpec
from memplan.core.training import Recompute
from memplan.core.symbolic import Poly, sort_key  # the order Poly.text() writes monomials in
from memplan.inventory.types import Term, display_poly
from memplan.memory.optimizers import states_label
from memplan.memory.pipeline import schedule_in_flight
from memplan.memory.pipeline_multi import rank_chunks
from memplan.memory.states import optimizer_bytes, param_groups
from memplan.memory.term_bytes import PlanValues
from memplan.plan.estimate import Estimate, estimate
from memplan.report.text import fragmentation_label


@dataclass(frozen=True)
class Step:
    section: str
    label: str
    formula: str  # symbolic, e.g. "34sbh/t"
    substituted: str  # the same with the values, e.g. "34 x 2048 x 1 x 20480 / 8"
    value: Any  # int bytes (or a count); None for a line of symbols
    unit: str  # "B", "parameters", "copies", "layers", ...
    source: str = ""
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SECTIONS = {
    "symbols": "the symbols (K22 notation) and their values",
    "layer": "saved activations of one layer, one micro-batch, one GPU",
    "pipeline": "pipeline: copies in flight and the stage's activations",
    "states": "weights, gradients and optimizer states",
    "peak": "the step peak and what the device needs",
}


def substituted(poly: Poly, values: dict[str, Any]) -> str:
    """Each monomial of `poly` with its symbols replaced by their values: '34 x 2048 x 1 x 20480 / 8'."""
    parts = []
    for mono, coef in sorted(poly.terms, key=sort_key):
        num = [str(values[s]) + (f"^{p}" if p > 1 else "") for s, p in mono if p > 0]
        den = [str(values[s]) + (f"^{-p}" if p < -1 else "") for s, p in mono if p < 0]
        n, d = abs(coef.numerator), coef.denominator
        if n != 1 or not num:
            num.insert(0, str(n))
        if d != 1:
            den.insert(0, str(d))
        text = " x ".join(num)
        if den:
            text += " / " + (den[0] if len(den) == 1 else "(" + " x ".join(den) + ")")
        parts.append(("- " if coef < 0 else "+ ") + text)
    return " ".join(parts).removeprefix("+ ") if parts else "0"


def _plus(numbers: list[Any]) -> str:
    return " + ".join(f"{int(n):,}" for n in numbers)


def table2_row(config: Config) -> Optional[str]:
    """The K22 Table 2 row a plan is, when the model is K22's GPT layer."""
    m, par, rec = config.model, config.parallel, config.training.recompute
    if not (m.attention == "eager" and m.mlp == "gelu" and m.norm == "layernorm" and m.dropout
            and m.f == 4 * m.hidden_size and m.g == m.num_attention_heads and m.q == m.hidden_size):
        return None
    if rec == Recompute.FULL:
        return "full recompute" if config.training.recompute_num_layers is None else None
    what = ("no parallelism" if par.tp == 1 else "tensor + sequence parallel" if par.sp else "tensor parallel")
    if rec == Recompute.SELECTIVE:
        return "TP + SP + selective recompute" if par.sp else "TP + selective recompute"
    return what


def explain(config: Config, budget_bytes: Optional[int] = None, gpu: Optional[GpuSpec] = None,
            impl: str = "megatron", fragmentation_margin: Optional[float] = None) -> tuple[Estimate, list[Step]]:
    """The estimate of `config` and its derivation, step by step."""
    est = estimate(config, budget_bytes=budget_bytes, gpu=gpu, impl=impl, fragmentation_margin=fragmentation_margin)
    # an MoE layer's routed tokens after the expert-TP all-gather are etp wide (Term.etp_gathered)
    moe = dict(ep=config.parallel.ep, etp=config.parallel.expert_tp) if config.model.is_moe else {}
    # context parallelism: every term holds the rank's s/cp tokens (Term.bytes divides by values' cp); a term with
    # its own cp factor (torchtitan's all-gathered K, V) needs the symbol at cp = 1 too
    cp = config.parallel.cp
    if cp > 1 or any(t.needs_cp or t.without_cp for t in est.inventory.terms):
        moe["cp"] = cp
    values = dict(config.model.symbols(b=config.training.micro_batch, t=config.parallel.tp, **moe))
    return est, (_symbols(est, values) + _layer(est, values) + _pipeline(est) + _states(est, values) + _peak(est))


def _display(poly: Poly, config: Config) -> Poly:
    poly = display_poly(poly, config.model)
    poly = poly.assign("cp", 1) if config.parallel.cp == 1 else poly
    return poly.assign("t", 1) if config.parallel.tp == 1 else poly


def _symbols(est: Estimate, values: dict[str, Any]) -> list[Step]:
    c = est.config
    par, m = c.parallel, c.model
    plan = dict(L=m.num_layers, p=par.pp, m=par.vpp, d=par.dp, M=c.num_microbatches)
    text = ", ".join(f"{k}={v:,}" for k, v in {**values, **plan}.items())
    moe = m.is_moe
    return [Step("symbols", "symbols", "s b h q a f g v" + (" E fe fs" if moe else "") + " t L p m d M", text, None,
                 "", note="s sequence, b micro-batch, h hidden, q attention width (a x head_dim), a heads, f MLP width, "
                      "g key/value heads, v vocabulary, "
                      + ("E experts, fe one expert's MLP width, fs the shared experts' width, " if moe else "")
                      + "t tensor-, p pipeline-, d data-parallel size, m chunks per rank, M micro-batches per step")]


def _layer(est: Estimate, values: dict[str, Any]) -> list[Step]:
    c = est.config
    act, sp, rec = c.training.activation_bytes, c.parallel.sp, c.training.recompute
    split = (sp, c.parallel.cp)  # how a term's polynomial is split on one GPU (Term.split_size)
    layer_terms = [t for t in est.inventory.terms if t.scope == "layer" and t.exists_at_cp(c.parallel.cp)]
    kept = [t for t in layer_terms if t.kept(rec) and t.bytes(values, act, int(sp))]
    unit = est.peak.unit_bytes
    steps = []
    for t in kept:
        poly = _display(t.split_size(act, *split), c)
        exact = t.bytes(values, act, int(sp))
        note = "" if unit[t.id] == exact else f"allocated in {est.inventory.granularity}-byte blocks: {unit[t.id]:,} B"
        steps.append(Step("layer", t.name + ("" if t.in_k22 else " (not in K22)"), poly.text(),
                          substituted(poly, values), exact, "B", t.source, note))
    dropped = [t for t in layer_terms if t.kept(Recompute.NONE) and not t.kept(rec)]
    if dropped:
        poly = _display(_sum(dropped, act, split), c)
        steps.append(Step("layer", f"not kept: {rec.label} recompute re-creates " + ", ".join(t.name for t in dropped),
                          poly.text(), substituted(poly, values), poly.evaluate(values), "B",
                          "K22 section 5" if rec == Recompute.SELECTIVE else "K22 section 4.1, full recompute"))
    k22 = [t for t in kept if t.in_k22]
    row = table2_row(c)
    poly = _display(_sum(k22, act, split), c)
    steps.append(Step("layer", "sum of the K22 terms" + (f" (K22 Table 2 row: {row})" if row else ""),
                      poly.factored(), substituted(poly, values), poly.evaluate(values), "B", "K22 Table 2"))
    if len(k22) < len(kept):
        poly = _display(_sum(kept, act, split), c)
        steps.append(Step("layer", "per layer, with what real code keeps beyond K22", est.per_layer_symbolic,
                          substituted(poly, values), est.per_layer_bytes, "B", est.inventory.name))
    return steps


def _sum(terms: list[Term], act: int, sp: tuple[bool, int]) -> Poly:
    """(sp: SP on, and cp)"""
    total = Poly(())
    for t in terms:
        total = total + t.split_size(act, *sp)
    return total


def _pipeline(est: Estimate) -> list[Step]:
    c, peak = est.config, est.peak
    par, i, M = c.parallel, est.most_loaded, c.num_microbatches
    chunks = int(schedule_in_flight(i, par.pp, par.vpp, M, par.pp_schedule)[0])
    per_chunk: Any = ("L/(pm)", f"{c.model.num_layers} / ({par.pp} x {par.vpp})", c.layers_per_chunk)
    if peak.held is not None:  # a multi-stage schedule (memplan/memory/pipeline_multi.py): chunks differ in size
        chunks, sizes = int(sum(peak.held)), rank_chunks(i, par.pp, par.vpp, c.model.num_layers, par.pp_schedule)
        formula, text = "the most bytes over torch's order", " + ".join(str(int(k)) for k in peak.held)
        src = f"torch 2.13's {par.pp_schedule} order per rank (its _calculate_single_rank_operations)"
        per_chunk = ("the rank's largest of torchtitan's split", f"max({', '.join(map(str, sizes))})", max(sizes))
    elif par.pp_schedule == "GPipe":
        formula, text, src = "M", f"{M}", "GPipe: torch's ScheduleGPipe runs every forward first"
    elif par.vpp == 1:
        formula, text = "min(p - i, M)", f"min({par.pp} - {i}, {M})"
        src = "1F1B: K22 section 4.2.3, Eq. 5"
    else:
        formula = "min(2(p - i - 1) + (m - 1)p + 1, Mm)"
        text = f"min(2 x ({par.pp} - {i} - 1) + ({par.vpp} - 1) x {par.pp} + 1, {M} x {par.vpp})"
        src = "interleaved 1F1B: Megatron-LM warm-up count; K22 section 4.2.3"
    steps = [
        Step("pipeline", f"model chunks in flight on stage i={i} (the most loaded)", formula, text, chunks, "chunks",
             src),
        Step("pipeline", "layers per model chunk", *per_chunk, "layer(s)"),
    ]
    groups: dict[tuple[str, int], list[Any]] = {}
    for r in est.rows:
        groups.setdefault((r.term.scope, r.copies), []).append(r)
    parts = []
    for (scope, copies), rows in groups.items():
        per = sum(r.bytes for r in rows)
        total = sum(r.stage_bytes for r in rows)
        what = ("layer terms" if scope == "layer" else f"{scope}-stage terms ({', '.join(r.term.name for r in rows)})"
                if scope in ("first", "last") else "per-chunk terms")
        why = ("chunks x kept layers per chunk" if scope == "layer" else
               "micro-batches in flight" if scope in ("first", "last") else "chunks in flight")
        steps.append(Step("pipeline", f"{what}, stored {copies} times ({why})", "bytes per copy x copies",
                          f"{per:,} x {copies}", total, "B"))
        parts.append(total)
    if peak.recompute_working_bytes:
        steps.append(Step("pipeline", "recompute working set: one layer's re-created tensors during its backward",
                          "dropped terms of one layer", "", int(peak.recompute_working_bytes), "B", "memplan"))
        parts.append(peak.recompute_working_bytes)
    steps.append(Step("pipeline", f"saved activations of stage {i} at its first backward", "sum of the above",
                      _plus(parts), int(peak.activations), "B"))
    return steps


def _states(est: Estimate, values: dict[str, Any]) -> list[Step]:
    c, peak, tr, par = est.config, est.peak, est.config.training, est.config.parallel

    # a hybrid (layer_pattern): "one layer" is its average layer, each block by its share of the layers (derived)
    share = {k: Fraction(n, c.model.num_layers) for k, n in c.model.layer_blocks.items()} if c.model.layer_pattern else {}

    def layer_of(scopes: tuple[str, ...]) -> tuple[Poly, int]:
        poly, n = Poly(()), Fraction(0)
        for g in param_groups(c.model):
            if g.scope in scopes:
                poly = poly + (g.count.divide_by("t") if g.tp_split else g.count) * share.get(g.scope, 1)
                n += int(g.per_gpu(values)) * share.get(g.scope, 1)
        return _display(poly, c), int(n)

    # an MoE model: "one layer" is an MoE layer; its dense first layers (first stage) are counted apart
    layer_poly, per_layer = layer_of(("layer", *share) if share else ("layer", "moe"))
    dense_poly, per_dense = layer_of(("layer", "dense"))
    # a multi-stage schedule's rank: its chunks' layers and dense first layers (PlanValues.dense_layers)
    multi, on_stage = peak.held is not None, int(peak.layers)
    dense = int(PlanValues.from_config(c).dense_layers(c.model, est.most_loaded))
    layers = (on_stage if multi else c.model.num_layers // par.pp) - dense
    other = int(peak.params) - per_layer * layers - per_dense * dense
    what = "one layer (the average of the hybrid's layers)" if share else "one MoE layer" if c.model.is_moe else "one layer"
    steps = [Step("states", f"parameters of {what} on one GPU", layer_poly.text(), substituted(layer_poly, values),
                  per_layer, "parameters", "memplan/memory/states.py param_groups (Megatron-LM's layout)")]
    if dense:
        steps.append(Step("states", "parameters of one dense layer (before the MoE layers) on one GPU",
                          dense_poly.text(), substituted(dense_poly, values), per_dense, "parameters",
                          "memplan/memory/states.py param_groups"))
    count = (f"{on_stage}" if multi else f"{c.model.num_layers} / {par.pp}") + (f" - {dense}" if dense else "")
    steps.append(Step("states", f"parameters on one GPU of stage {est.most_loaded}",
                      (f"({'n' if multi else 'L/p'} - k) x per MoE layer + k x per dense layer" if dense else
                       ("n (its chunks' layers)" if multi else "L/p") + " x per layer")
                      + " + embedding / output layer / final norm on this stage",
                      f"{count} x {per_layer:,}" + (f" + {dense} x {per_dense:,}" if dense else "") + f" + {other:,}",
                      int(peak.params), "parameters"))
    params = int(peak.params)
    shard = par.shard

    def sharded(stage: int) -> str:
        return f" / {shard} (ZeRO-{par.zero}, rounded up)" if par.zero >= stage and shard > 1 else ""

    optimizer_per_param = tr.master_weight_bytes + tr.optimizer_moments * tr.optimizer_state_bytes
    gathered = " + one gathered layer (ZeRO-3)" if par.zero >= 3 else ""
    prec = f"--precision {tr.precision} (byte sizes of the training settings)"
    label = f"optimizer states ({states_label(tr).removeprefix('optimizer (')}"
    # the parameters that get a gradient and states: all but a frozen table's, a no_grad module's (ParamGroup.trained)
    n = params if peak.trained_params is None or tr.lora_rank else int(peak.trained_params)
    what = "parameters" if n == params else "trained parameters (weights only for the others)"
    if peak.tensors is None:  # full-size states: AdamW, SGD (with or without momentum), Lion
        optimizer = Step("states", label, f"{what} x (master + moments x state bytes)",
                         f"{n:,} x ({tr.master_weight_bytes} + {tr.optimizer_moments} x {tr.optimizer_state_bytes})"
                         f" B = {n:,} x {optimizer_per_param} B{sharded(1)}", int(peak.optimizer), "B", prec)
    else:  # states by tensor shape (memplan/memory/optimizers.py)
        states = int(optimizer_bytes(tr, n, peak.tensors)) - n * tr.master_weight_bytes
        optimizer = Step("states", label, f"{what} x master bytes + the optimizer's states by tensor shape",
                         f"{n:,} x {tr.master_weight_bytes} B + {states:,} B{sharded(1)}", int(peak.optimizer),
                         "B", f"memplan/memory/optimizers.py ({tr.optimizer}); {prec}")
    if tr.lora_rank:  # peft LoRA: the base frozen, only the fp32 adapters trained (memplan/memory/adapters.py)
        n, src = int(peak.trained_params), "memplan/memory/adapters.py (peft LoRA)"
        base = "frozen parameters in NF4 (layer linears) and bf16 (the rest)" if tr.qlora else \
            f"{params:,} frozen parameters x {tr.weight_bytes} B"
        return steps + [
            Step("states", "weights", "frozen base + adapters x 4 B (fp32)",
                 f"{base} + {n:,} x 4 B{sharded(3)}", int(peak.weights), "B", src),
            Step("states", "gradients", "adapters x 4 B (fp32; the base has none)", f"{n:,} x 4 B{sharded(2)}",
                 int(peak.gradients), "B", src),
            Step("states", label, "adapters x moments x 4 B (fp32, no master copy)",
                 f"{n:,} x {tr.optimizer_moments} x 4 B{sharded(1)}", int(peak.optimizer), "B", src)]
    steps += [
        Step("states", "weights", "parameters x weight bytes",
             f"{params:,} x {tr.weight_bytes} B{sharded(3)}{gathered}", int(peak.weights), "B", prec),
        Step("states", "gradients", f"{what} x gradient bytes",
             f"{n:,} x {tr.grad_bytes} B{sharded(2)}", int(peak.gradients), "B", prec),
        optimizer,
    ]
    return steps


def _peak(est: Estimate) -> list[Step]:
    step, dev = est.decided_step, est.device  # the stage that decides the fit (plan/stage_verdict.py)
    e = step.peak_event
    where = f"{e.phase}" + (f" of layer {e.layer}" if e.layer is not None else "") + f": {e.moment}"
    names = ("weights", "optimizer", "gradients", "saved", "transient")
    steps = [
        Step("peak", f"step peak of the tensors, at {where}", " + ".join(names), _plus([e.parts[k] for k in names]),
             int(step.peak_bytes), "B", "memplan/memory/timeline.py"),
        Step("peak", "allocated peak (torch.cuda.max_memory_allocated)", "step peak + cuBLAS workspace",
             _plus([step.peak_bytes, dev.workspace_bytes]), int(dev.allocated_peak), "B"),
        Step("peak", *(
            (fragmentation_label(dev),
             "reserved peak of the replay (the capacity + 1 B where the run dies) - allocated peak",
             f"{int(dev.allocated_peak + dev.fragmentation_bytes):,} - {int(dev.allocated_peak):,}",
             int(dev.fragmentation_bytes), "B",
             "memplan/memory/reserved.py") if dev.replayed else
            ("fragmentation margin", "ceil(margin x allocated peak)", f"ceil({dev.margin:g} x {int(dev.allocated_peak):,})",
             int(dev.fragmentation_bytes), "B", "GPU preset" if est.gpu is not None else "--frag-margin"))),
        Step("peak", "CUDA context, kernels, NCCL (outside PyTorch)", "runtime", "",
             int(dev.runtime_bytes - dev.symm_workspace_bytes), "B",
             f"GPU preset {est.gpu.name}" if est.gpu is not None else "no GPU given"),
        *([Step("peak", "async TP symmetric-memory workspace (outside PyTorch's pool)", "2 A s b h / t", "",
                int(dev.symm_workspace_bytes), "B", "memplan/inventory/titan_async_tp.py (derived)")]
          if dev.symm_workspace_bytes else []),
        Step("peak", "device memory needed", "allocated peak + margin + runtime"
             + (" + async TP workspace" if dev.symm_workspace_bytes else ""),
             _plus([dev.allocated_peak, dev.fragmentation_bytes, dev.runtime_bytes - dev.symm_workspace_bytes]
                   + ([dev.symm_workspace_bytes] if dev.symm_workspace_bytes else [])), int(dev.total), "B"),
    ]
    if est.budget_bytes is not None:
        steps.append(Step("peak", "headroom (negative: over the budget)", "budget - device memory needed",
                          f"{int(est.budget_bytes):,} - {int(dev.total):,}", int(est.headroom_bytes), "B"))
    return steps
