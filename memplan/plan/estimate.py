"""`estimate`: the memory of every pipeline stage of one plan, and why.

specs -> inventory -> stage_memory (activations + states) -> this breakdown -> report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from memplan.core.model import ModelSpec
from memplan.core.specs import Config, GpuSpec
from memplan.core.training import Recompute
from memplan.inventory.activations import layer_bytes, layer_poly
from memplan.inventory.assemble import stream_checked, training_inventory
from memplan.inventory.chunked_loss import note as chunk_note
from memplan.inventory.fp8 import check_fp8
from memplan.inventory.fp8 import notes as fp8_notes
from memplan.inventory.titan_float8 import notes as float8_notes
from memplan.inventory.titan_async_tp import notes as async_tp_notes, workspace_bytes
from memplan.inventory.titan import is_dsv3
from memplan.inventory.titan_dsv3 import notes as dsv3_notes
from memplan.inventory.compiled import notes as compile_notes
from memplan.inventory.compiled_moe import notes as moe_compile_notes
from memplan.inventory.compiled_dsv3 import notes as dsv3_compile_notes
from memplan.inventory.liger import notes as liger_notes
from memplan.inventory.hf import check_hf_plan
from memplan.inventory.traced import hybrid_note
from memplan.inventory.step_order import runs_traced
from memplan.inventory.types import HF_IMPLS, Inventory, Term, display_poly
from memplan.memory.offload import HostBytes, host_bytes, per_node
from memplan.memory.adapters import notes as lora_notes
from memplan.memory.dp_stack import notes as stack_notes
from memplan.memory.offload import notes as offload_notes
from memplan.memory.optimizers import notes as optimizer_notes
from memplan.memory.parallel import notes as parallel_notes
from memplan.memory.pipeline import interleaving_factor, schedule_in_flight
from memplan.memory.pipeline_multi import is_multi, multi_note, rank_chunks
from memplan.memory.stage import StageMemory, stage_memory
from memplan.memory.states import active_params, total_params
from memplan.memory.term_bytes import PlanValues, symbol_values
from memplan.memory.reserved import Replay, Reserved
from memplan.memory.stream_lengths import StreamLengths
from memplan.presets.catalog import shipped_trace
from memplan.memory.device import DeviceMemory
from memplan.memory.timeline import StepPeak, most_loaded_stage, optimizer_impl, step_events
from memplan.plan.stage_verdict import StageVerdict, decide, not_replayed
from memplan.timing.step import step_time


@dataclass(frozen=True)
class TermRow:
    """One saved tensor as the report shows it, for the most loaded stage."""

    term: Term
    symbolic: str  # bytes per layer (or per micro-batch outside the layers) on one GPU
    bytes: int  # the same, evaluated
    copies: int  # how many the stage holds at its peak (layers x micro-batches in flight)
    stage_bytes: int  # bytes x copies
    share: float  # of the stage's activation bytes


@dataclass(frozen=True)
class StageRow:
    """One pipeline stage as the per-stage table shows it (one GPU of it)."""

    stage: int
    layers: int  # transformer layers on the stage
    chunks: int  # (micro-batch, model chunk) activation sets in flight at its first backward
    layer_copies: int  # layers' activation sets saved then: chunks x layers per chunk
    states_bytes: int  # weights + gradients + optimizer states
    activations_bytes: int  # saved at its first backward
    peak_bytes: int  # the step's peak
    peak_at: str  # when


def stage_rows(est: "Estimate") -> list[StageRow]:
    """Every stage of the estimate's plan: what it holds and its step peak (the table `estimate` prints)."""
    par, c = est.config.parallel, est.config
    rows = []
    for mem, step in zip(est.stages, est.steps):
        chunks = int(schedule_in_flight(mem.stage, par.pp, par.vpp, c.num_microbatches, par.pp_schedule)[0])
        copies = chunks * int(mem.layers) // par.vpp
        if mem.held is not None:  # a multi-stage schedule: its chunks differ (memplan/memory/pipeline_multi.py)
            sizes = rank_chunks(int(mem.stage), par.pp, par.vpp, c.model.num_layers, par.pp_schedule)
            chunks, copies = int(sum(mem.held)), int(sum(n * k for n, k in zip(sizes, mem.held)))
        e = step.peak_event
        rows.append(StageRow(mem.stage, int(mem.layers), chunks, copies,
                             int(mem.states.total), int(mem.activations), int(step.peak_bytes),
                             f"{e.phase}{f' of layer {e.layer}' if e.layer is not None else ''}"))
    return rows


def peak_reason(est: "Estimate") -> str:
    """Why the most loaded stage is the peak: its activation sets in flight against the other candidates' (1F1B:
    stage i holds p - i micro-batches; uneven stages change the layers of each), and what only it holds."""
    rows = stage_rows(est)
    top = rows[est.most_loaded]
    p = len(rows)
    if p == 1:
        return "one stage: it holds every layer, the embedding and the LM head"
    multi = is_multi(est.config.parallel.pp_schedule)
    why = [f"{top.layer_copies} layer activation sets in flight ({top.chunks} chunk(s) x "
           + (f"their layers, {est.config.parallel.pp_schedule})" if multi else
              f"{top.layers // est.config.parallel.vpp} layer(s))")]
    first, last = PlanValues.from_config(est.config).ends(top.stage)
    if first:
        why.append("the embedding" + ("" if multi else " and the most micro-batches in flight (1F1B warm-up)"))
    if last:
        why.append("the LM head and the loss (logits)")
    others = [r for r in (rows[0], rows[min(1, p - 1)], rows[-1]) if r.stage != top.stage]
    versus = "; ".join(f"stage {r.stage}: {r.layer_copies} sets ({r.chunks} x "
                       + ("chunks" if multi else f"{r.layers // est.config.parallel.vpp}") + "), "
                       f"peak {r.peak_bytes / 1e9:.2f} GB" for r in dict((r.stage, r) for r in others).values())
    return f"stage {top.stage} peaks: " + ", ".join(why) + (f"; against {versus}" if versus else "")


@dataclass(frozen=True)
class Estimate:
    config: Config
    inventory: Inventory
    paper_only: bool
    stages: list[StageMemory]
    steps: list[StepPeak]  # the step peak of one GPU of every stage (the most loaded and the deciding: whole timelines)
    device: DeviceMemory  # what the deciding stage's GPU needs: allocated peak + fragmentation + runtime
    most_loaded: int
    per_layer_bytes: int
    per_layer_symbolic: str
    rows: list[TermRow]
    total_params: int
    budget_bytes: Optional[int] = None
    gpu: Optional[GpuSpec] = None
    perf: Optional[Any] = None  # perf.StepTime when a GPU is known
    notes: list[str] = field(default_factory=list)
    hosts: list[HostBytes] = field(default_factory=list)  # host memory of one GPU of every stage (offload)
    host_budget_bytes: Optional[int] = None  # host memory per node (--host-mem)
    active_params: Optional[int] = None  # parameters one token goes through (MoE: its k experts; else total_params)
    gpu_assumed: Optional[str] = None  # why `gpu` was assumed (none named: memplan/api/options.py), None when named
    reserved: Optional[Reserved] = None  # the deciding stage's run, replayed by the caching allocator (None: not)
    verdict_stage: Optional[int] = None  # the stage that decides the fit (plan/stage_verdict.py; None: the most loaded)
    stage_verdicts: tuple[StageVerdict, ...] = ()  # every stage decided (with a budget: each one's replay)

    @property
    def peak(self) -> StageMemory:
        """The most loaded stage's states and saved activations (retained at its first backward)."""
        return self.stages[self.most_loaded]

    @property
    def step(self) -> StepPeak:
        """The most loaded stage's step timeline and allocated peak."""
        return self.steps[self.most_loaded]

    @property
    def decided(self) -> int:
        """The stage that decides the fit: the first whose run dies in the caching allocator's replay, else the one
        that needs the most (the most loaded, where no replay or none reserves beyond it)."""
        return self.most_loaded if self.verdict_stage is None else self.verdict_stage

    @property
    def decided_step(self) -> StepPeak:
        """The deciding stage's step timeline (what `device` adds to)."""
        return self.steps[self.decided]

    @property
    def flat_total(self) -> int:
        """The bound `search` evaluates for every plan: the most loaded stage's allocated peak + margin + runtime
        (DeviceMemory.flat_total; every other stage's is lower), whichever stage's replay decides."""
        return max((v.device.flat_total for v in self.stage_verdicts), default=self.device.flat_total)

    @property
    def host(self) -> HostBytes:
        """Host memory of the GPU that offloads the most (memplan/memory/offload.py)."""
        return max(self.hosts, key=lambda h: h.total) if self.hosts else HostBytes()

    @property
    def host_bytes_per_node(self) -> int:
        """Host memory a node's GPUs take for their offload: GPUs on a node x the most any GPU takes."""
        gpn = self.gpu.gpus_per_node if self.gpu is not None else None
        return int(per_node(self.host.total, self.config.parallel.gpus, gpn))

    @property
    def fits_host(self) -> Optional[bool]:
        return None if self.host_budget_bytes is None else bool(self.host_bytes_per_node <= self.host_budget_bytes)

    @property
    def fits(self) -> Optional[bool]:
        if self.budget_bytes is None:
            return None
        return bool(self.device.total <= self.budget_bytes) and self.fits_host is not False

    @property
    def headroom_bytes(self) -> Optional[int]:
        return None if self.budget_bytes is None else self.budget_bytes - self.device.total


def estimate(
    config: Config,
    budget_bytes: Optional[int] = None,
    gpu: Optional[GpuSpec] = None,
    paper_only: bool = False,
    impl: str = "megatron",
    device: Optional[str] = None,
    fragmentation_margin: Optional[float] = None,
    host_budget_bytes: Optional[int] = None,
    replay: Replay = Replay(),
) -> Estimate:
    """Memory per GPU for every pipeline stage of `config` run by implementation `impl`: the saved
    activations and states (with `paper_only`, only the tensors K22 counts) and the step's
    allocated peak (always the real-code view). The stage with the highest peak is the most loaded; the plan
    fits when every stage's peak + fragmentation + runtime is within the budget, the fragmentation being the larger
    of the margin (the GPU preset's, or `fragmentation_margin`) and what the caching allocator reserves when the
    stage's run is replayed through it (`replay`: the allocator, its settings, the run's history;
    plan/stage_verdict.py `decide`, which names the stage that decides); with `host_budget_bytes`, also when the
    host memory its offload takes per node is within that."""
    if impl in HF_IMPLS:
        check_hf_plan(config, impl)
    check_fp8(config.training.fp8, impl, config.parallel.zero, gpu)
    device = device or config.training.device
    inventory = training_inventory(traced_default(config, impl, device), impl, device, config.training)
    terms = tuple(t for t in inventory.terms if t.in_k22 or not paper_only)
    plan = PlanValues.from_config(config)
    stages = [stage_memory(config.model, terms, config.training, plan, i, working_set=not paper_only,
                           granularity=inventory.granularity, layout=inventory.weight_layout)
              for i in range(config.parallel.pp)]
    steps = step_peaks(config, inventory, plan, None if paper_only else stages)
    most_loaded = most_loaded_stage(steps, stages)
    steps[most_loaded] = step_peaks(config, inventory, plan, None if paper_only else stages, walk=most_loaded)[0]
    peak = stages[most_loaded]

    values = symbol_values(config.model, plan)
    act = config.training.activation_bytes
    layer_terms = tuple(t for t in terms if t.scope == "layer" and t.in_k22) if paper_only else tuple(
        t for t in terms if t.scope == "layer")
    per_layer = layer_bytes(layer_terms, values, act, plan.sp, plan.recompute)
    shown = tuple(t for t in layer_terms if t.exists_at_cp(config.parallel.cp))
    poly = display_poly(layer_poly(shown, act, config.parallel.sp, config.training.recompute,
                                   config.parallel.cp), config.model)
    if config.parallel.tp == 1:
        poly = poly.assign("t", 1)

    rows = []
    for term in terms + peak.extra_terms:  # extra: a split backward's I -> W gradients (memplan/memory/stage.py)
        n = peak.unit_bytes[term.id]  # one copy as allocated (storages rounded to the allocator block)
        stage_n = peak.term_bytes[term.id]
        if stage_n == 0 and (term.scope != "layer" or not term.kept(plan.recompute) or term not in shown):
            continue
        sym = display_poly(term.split_size(act, config.parallel.sp, config.parallel.cp), config.model)
        if config.parallel.tp == 1:
            sym = sym.assign("t", 1)
        rows.append(TermRow(term, sym.text(), n, stage_n // n if n else 0, stage_n,
                            stage_n / peak.activations if peak.activations else 0.0))

    if budget_bytes is None and gpu is not None:
        budget_bytes = gpu.process_memory_bytes
    verdict = decide(config, inventory, plan, stages, steps, gpu, None if paper_only else budget_bytes,
                     fragmentation_margin, replay)
    if verdict.stage != most_loaded:  # its whole timeline too: the report shows the deciding stage's step
        steps[verdict.stage] = step_peaks(config, inventory, plan, stages, walk=verdict.stage)[0]
    perf = None
    if gpu is not None:
        perf = step_time(config.model, config.training, gpu, plan, config.global_batch, impl=impl)
    notes = _notes(config, peak, terms, values, inventory)
    if budget_bytes is not None and not paper_only and (why := not_replayed(config.training, plan)):
        notes.append(f"not replayed through the caching allocator: its allocation stream does not model {why} "
                     "yet, so the verdict takes the flat fragmentation margin alone")
    return Estimate(
        config=config, inventory=inventory, paper_only=paper_only, stages=stages, steps=steps, device=verdict.device,
        most_loaded=most_loaded,
        per_layer_bytes=per_layer, per_layer_symbolic=poly.factored() if not poly.is_zero else "0",
        rows=rows, total_params=total_params(config.model), active_params=active_params(config.model),
        budget_bytes=budget_bytes, gpu=gpu, perf=perf,
        notes=notes,
        hosts=[host_bytes(config.model, inventory.terms, config.training, plan, s, inventory.weight_layout)
               for s in (stages if not paper_only else _full_stages(config, inventory, plan))],
        host_budget_bytes=host_budget_bytes, reserved=verdict.reserved, verdict_stage=verdict.stage,
        stage_verdicts=verdict.stages,
    )


def _full_stages(config: Config, inventory: Inventory, plan: PlanValues) -> list[StageMemory]:
    """Every stage with all the inventory's terms (the paper-only view leaves some out; the host holds them)."""
    return [stage_memory(config.model, inventory.terms, config.training, plan, i, granularity=inventory.granularity,
                         layout=inventory.weight_layout) for i in range(config.parallel.pp)]


def step_peaks(config: Config, inventory: Inventory, plan: Optional[PlanValues] = None,
               stages: Optional[list[StageMemory]] = None, walk: Optional[int] = None) -> list[StepPeak]:
    """The step peak of one GPU of every pipeline stage, from its critical moments; with `walk`, the
    whole timeline (every layer's events) of that one stage only."""
    plan = plan if plan is not None else PlanValues.from_config(config)
    which = range(config.parallel.pp) if walk is None else [walk]
    return [step_events(config.model, inventory, config.training, plan,
                        stages[i] if stages is not None else
                        stage_memory(config.model, inventory.terms, config.training, plan, i,
                                     granularity=inventory.granularity, layout=inventory.weight_layout), i,
                        critical=walk is None)
            for i in which]


def device_bytes(config: Config, impl: str = "megatron", device: Optional[str] = None, gpu: Optional[GpuSpec] = None,
                 fragmentation_margin: Optional[float] = None, budget_bytes: Optional[int] = None,
                 replay: Replay = Replay(), lengths: Optional[StreamLengths] = None, every_stage: bool = True) -> int:
    """What the plan's GPUs need (what `estimate` decides a fit on, without its report): with a budget, the stages'
    runs replayed by the caching allocator in it (more than the budget when a run dies: plan/stage_verdict.py;
    `lengths`: the plan's streams at other lengths, by stage; `every_stage` False: the most loaded stage's alone, a
    lower bound), else the highest stage peak + margin + runtime."""
    if impl in HF_IMPLS:
        check_hf_plan(config, impl)
    check_fp8(config.training.fp8, impl, config.parallel.zero, gpu)
    device = device or config.training.device
    inventory = training_inventory(traced_default(config, impl, device), impl, device, config.training)
    plan = PlanValues.from_config(config)
    mems = [stage_memory(config.model, inventory.terms, config.training, plan, i, granularity=inventory.granularity,
                         layout=inventory.weight_layout) for i in range(config.parallel.pp)]
    verdict = decide(config, inventory, plan, mems, step_peaks(config, inventory, plan, mems), gpu, budget_bytes,
                     fragmentation_margin, replay, report=False, lengths=lengths, every_stage=every_stage)
    return int(verdict.device.total)


def traced_default(config: Config, impl: str, device: str) -> ModelSpec:
    """The model whose inventory `config` is planned with: its preset's shipped traced inventory
    (memplan/presets/catalog.py `shipped_trace`: llama3-8b with --impl hf-sdpa on cuda) when the plan runs the code traced, its stream then the traced step's order
    (memplan/memory/stream_traced.py): a plan whose stream memplan checks against recordings with its hand-written
    inventory (memplan/inventory/assemble.py `stream_checked`: torch AdamW, no training setting changed) and which
    the traced order keeps (bf16-true; one GPU, one micro-batch, no or full recompute: step_order.runs_traced).
    Any other plan, implementation or device keeps its inventory, as does a model naming one (--inventory). The
    config itself is left as given (its JSON names no file the user did not)."""
    path = shipped_trace(config.model, impl, device)
    if path is None or not stream_checked(config.model, impl, device, config.training):
        return config.model
    traced = config.model.model_copy(update={"inventory": str(path)})
    order = training_inventory(traced, impl, device, config.training).step_order
    if not order or not runs_traced(order, PlanValues.from_config(config)):
        return config.model
    return traced


def _notes(config: Config, peak: StageMemory, terms: tuple[Term, ...], values: dict[str, Any],
           inventory: Inventory) -> list[str]:
    par, tr = config.parallel, config.training
    notes = []
    if inventory.origin:
        notes.append(f"saved tensors {inventory.origin}" + ("" if "transients traced" in inventory.origin else
                     "; the backward's transient tensors are derived from the measured Llama layout, not traced"))
        if inventory.step_order and runs_traced(inventory.step_order, PlanValues.from_config(config)):
            notes.append("allocation stream: the traced step's allocations and frees in the code's order "
                         "(memplan/memory/stream_traced.py); derived: the model's build, AdamW's states, zero_grad "
                         "and cuBLAS's workspaces; left out: the kernels' own buffers (cuDNN attention's backward "
                         "workspace, reductions' staging)")
        plan_values = {"s": config.model.seq_length, "b": tr.micro_batch}
        for sym, least in inventory.traced_from:
            if plan_values[sym] < least and least > 2:  # a fitted trace (validation/trace_fit.py): its least s
                why = ("the least s its saves were fitted from" if "fitted:" in inventory.origin else "the side of a "
                       "guard on s the trace took, e.g. an indexer's top-k of min(index_topk, s) keys")
                notes.append(f"{sym} = {plan_values[sym]} is outside the trace ({sym} >= {least}: {why}): its "
                             "polynomials are used there, not checked against a run")
            elif plan_values[sym] < least:
                notes.append(f"{sym} = {plan_values[sym]} is outside the trace ({sym} >= {least}; torch traces size 1 "
                             "apart): its sizes are used, which real CPU runs at b = 1 match within 8 bytes (the "
                             "loss's padded label id; tests/test_traced.py)")
        for sym, m in inventory.traced_multiple:
            if plan_values[sym] % m and config.model.ssm_dt_rank is not None:  # Mamba-1: validation/trace_mamba1.py
                notes.append(f"{sym} = {plan_values[sym]:,} is not a multiple of {m} (the trace's condition): "
                             f"mamba-ssm's scan keeps its states for {-(-plan_values[sym] // m):,} chunks of {m} tokens; "
                             f"the sizes at {sym} = {plan_values[sym]:,} are used (those states under-estimated)")
            elif plan_values[sym] % m:
                notes.append(f"{sym} = {plan_values[sym]:,} is not a multiple of {m} (the trace's condition: a chunk of "
                             f"Mamba-2's scan or of the gated delta rule): transformers pads it to "
                             f"{-(-plan_values[sym] // m) * m:,} inside the scan; "
                             f"the sizes at {sym} = {plan_values[sym]:,} are used (the scan's tensors under-estimated)")
    m = config.model
    if m.layer_pattern:
        notes.append(hybrid_note(m))
    if m.is_moe:
        notes.append(f"mixture of experts: {m.num_experts} experts of f_e = {m.fe:,} in {m.moe_layers} of "
                     f"{m.num_layers} layers, top-{m.moe_top_k}; {active_params(m) / 1e9:,.2f} B of "
                     f"{total_params(m) / 1e9:,.2f} B parameters active per token (the model FLOPs count those)"
                     + _expert_split(config))
    notes += parallel_notes(config)
    # torchtitan's own note below says which of its moments are measured and which derived
    if inventory.moments and not inventory.moments[0].source.startswith(("measured", "traced")) and \
            not inventory.name.startswith("torchtitan"):
        notes.append("the step's transient tensors of this implementation are derived from its code, not measured")
    if inventory.name.startswith("torchtitan"):
        ids = {m.id for m in inventory.moments if m.scope == "layer"}
        notes.append(("torchtitan: the decoder layers' backward moments measured on CPU from its DeepSeek-V3 blocks "
                      "(balanced routing; an MoE layer's combine, experts and ffn_norm with the shared experts', a "
                      "dense first layer's SwiGLU and ffn_norm: memplan/inventory/titan_dsv3_moments.py; the MLA "
                      "attention's backward derived from FlexAttention's, with an MoE layer's weight gradients in "
                      "every layer; TP, EP, CP, CUDA kernels and FSDP2's reduce-scatter derived), the loss's derived")
                     if ids and is_dsv3(config.model) else
                     ("torchtitan: the decoder layers' backward moments measured on CPU from its Qwen3 MoE block "
                      "(balanced routing; the combine's fp32 score multiply, the experts' grouped GEMMs, the norms and "
                      "the attention, under full / selective-op AC the recomputed forward's combine: "
                      "memplan/inventory/titan_moments.py; EP and CP measured on 2 ranks over gloo; TP, CUDA kernels "
                      "and FSDP2's reduce-scatter derived), the loss's derived") if "moe_combine_backward" in ids else
                     "torchtitan: the compiled blocks' backward moments measured on CPU from Inductor's generated "
                     "backward (memplan/inventory/compiled_moments.py; TP, CUDA's triton kernels and FSDP2's "
                     "reduce-scatter derived), the loss's derived" if "compiled_swiglu" in ids else
                     "torchtitan: the compiled Qwen3 MoE blocks' backward moments at their experts measured on CPU "
                     "from Inductor's generated backward (memplan/inventory/compiled_moe_moments.py; CUDA's triton "
                     "kernels and FSDP2's reduce-scatter derived), the loss's derived"
                     if any(i.startswith("compiled_moe_") for i in ids) else
                     "torchtitan: the decoder layers' backward moments traced on CPU from its dense block, and "
                     "measured per rank on 2 gloo ranks under TP 2 and CP 2 (TP with CP, CUDA kernels and FSDP2's "
                     "reduce-scatter derived), the loss's derived" if ids else
                     "torchtitan: the decoder layers' backward transients are not modelled for this plan (compiled "
                     "blocks; the loss's are, derived): the peak is a lower bound")
        notes += dsv3_notes(config.model)
        if par.pp > 1 and is_multi(par.pp_schedule):
            notes += multi_note(par.pp_schedule, par.pp, par.vpp, config.model.num_layers,
                                config.model.moe_first_dense_layers)
        elif par.pp > 1:
            notes.append(f"torchtitan pipeline_parallel_schedule {par.pp_schedule} (torch.distributed.pipelining "
                         + ("ScheduleGPipe: every forward before the first backward, all micro-batches in flight on "
                            "every stage" if par.pp_schedule == "GPipe" else
                            "Schedule1F1B: stage i runs min(M, p - i) forwards before its first backward")
                         + "); the stage's received inputs and kept outputs per micro-batch are not counted")
    notes += optimizer_notes(tr, optimizer_impl(tr, inventory))
    notes += fp8_notes(tr)
    notes += float8_notes(tr.float8, tr.compile, par.tp)
    notes += async_tp_notes(tr.async_tp, workspace_bytes(inventory.symm_workspace_bytes, tr.micro_batch, par.tp))
    notes += lora_notes(tr)
    notes += liger_notes(tr)
    notes += ((dsv3_compile_notes(par.pp) if tr.compile else []) if m.is_moe and m.is_mla else
              moe_compile_notes(m, tr, par.pp) if m.is_moe else
              compile_notes(tr, inventory.name.split("/")[0], par.tp, m, par.pp))
    notes += stack_notes(tr, config.parallel.zero, config.parallel.dp, config.parallel.shard, config.parallel.pp)
    if tr.loss_chunks > 1 and not inventory.name.startswith("hf-"):
        notes.append(chunk_note(tr.loss_chunks, inventory.name.split("/")[0]))
    notes += offload_notes(tr, inventory.name.split("/")[0])
    chunks = schedule_in_flight(peak.stage, par.pp, par.vpp, config.num_microbatches, par.pp_schedule)[0]
    if config.uneven:
        first, middle, last = config.split
        titan = ("torchtitan's split: the embedding and the output each count as a layer (pipeline_parallel.py "
                 "_generate_llm_fqn_per_model_part)" if tr.dp_stack == "torchtitan" else
                 "Megatron-LM --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
        notes.append(f"uneven pipeline stages: {first} layer(s) on the first stage, {middle} on each of the {par.pp - 2} "
                     f"middle one(s), {last} on the last ({titan})" if par.pp > 2 else
                     f"uneven pipeline stages: {first} layer(s) on the first stage, {last} on the last")
    if peak.held is not None:
        sizes = rank_chunks(int(peak.stage), par.pp, par.vpp, config.model.num_layers, par.pp_schedule)
        notes.append(f"stage {peak.stage} holds, at its peak, " + ", ".join(
            f"{int(k)} micro-batch(es) of its chunk {i + 1} ({n} layers)"
            for i, (n, k) in enumerate(zip(sizes, peak.held)))
            + f" (torch's {par.pp_schedule} order, memplan/memory/pipeline_multi.py)")
    else:
        notes.append(
        f"stage {peak.stage} holds {chunks} model chunk(s) of {peak.layers // par.vpp} layer(s) in flight"
        + (f" (interleaving factor 1 + (p-1)/(pm) = {interleaving_factor(par.pp, par.vpp):.4f} on stage 0)"
           if par.vpp > 1 else "")
        )
    if config.num_microbatches < par.pp:
        notes.append(
            f"only {config.num_microbatches} micro-batch(es) per step for p={par.pp} stages: "
            "the pipeline never fills, so fewer activations are stored (and the bubble is large)"
        )
    if tr.recompute == Recompute.FULL and tr.recompute_num_layers is not None:
        notes.append(
            f"full recompute of {tr.recompute_num_layers} of {config.layers_per_chunk} layers per model chunk "
            + ("(torchtitan's selective per-layer AC: every N-th layer checkpointed; the kept bytes are the same "
               "wherever they sit)" if inventory.name.startswith("torchtitan") else
               "(Megatron-LM --recompute-method block)")
        )
    if tr.recompute == Recompute.SELECTIVE:
        dropped = sum(t.bytes(values, tr.activation_bytes, int(par.sp)) for t in terms
                      if t.scope == "layer" and t.dropped_by_selective)
        kept = sum(t.bytes(values, tr.activation_bytes, int(par.sp)) for t in terms if t.scope == "layer")
        if config.model.attention == "flash" and not inventory.name.startswith("torchtitan"):
            notes.append(
                f"flash attention stores no s x s tensor: selective recompute drops only the log-sum-exp, "
                f"{dropped:,} of {kept:,} bytes per layer ({dropped / kept:.2%}); it saves almost nothing"
            )
    return notes


def _expert_split(config: Config) -> str:
    """How the experts are split over the GPUs, for the mixture-of-experts note (torchtitan's sharding of their states
    is its own note: memplan/memory/parallel.py)."""
    par, m = config.parallel, config.model
    if par.ep * par.expert_tp == 1:
        return "; ep = 1: every GPU holds every expert"
    split = f"; ep = {par.ep}, etp = {par.expert_tp}: {m.num_experts // par.ep} experts per GPU"
    if config.training.dp_stack == "torchtitan":
        return split
    return split + (f", their states sharded over the {par.edp} expert-data-parallel ranks" if par.edp > 1
                    else ", their states not sharded (one expert-data-parallel rank)")
