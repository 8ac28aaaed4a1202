"""Many plans: `search` (every plan for a number of GPUs that fits the budget, fastest first; one model or every
preset), in two steps the CLI uses apart (`prepare_search` refuses bad input before any work, `.run` searches),
with the typed result whose `.to_dict()` is `memplan search ... --json`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from memplan.api.options import PlanOptions
from memplan.api.values import check_emit, mtp_layers
from memplan.core.errors import MemplanError
from memplan.inventory.assemble import training_inventory
from memplan.launch.bridge import launch_for
from memplan.launch.megatron import MEGATRON_EMITS, launch_refusal
from memplan.memory.optimizers import notes as optimizer_notes
from memplan.memory.timeline import optimizer_impl
from memplan.plan.verdict import replay_listing, replayed_max_seq
from memplan.plan.search import SearchResult, Skipped, search_max_seq, search_presets
from memplan.plan.space import Fixed, fixed_from
from memplan.inventory.titan import titan_model
from memplan.inventory.titan_async_tp import check_async_tp
from memplan.inventory.titan_moe import check_titan_mtp
from memplan.plan.titan import FLOAT8_ANY, TitanPins
from memplan.plan.titan_search import search_titan, search_titan_max_seq
from memplan.plan.search import search as search_plans
from memplan.presets.batch import search_inputs
from memplan.presets.catalog import load_model, model_names
from memplan.presets.files import ModelPreset
from memplan.report.formats import search_dict, skipped_dict


@dataclass
class SearchResults:
    """What `search` finds: one planner SearchResult per model searched (its .top, .row(i), .config(i)), the
    presets it could not search (an all-presets search), and the Megatron-LM launch of each model's best plan
    (emit="megatron")."""

    results: list[SearchResult]
    skipped: list[Skipped]
    gpus: int
    one_model: bool
    launch: dict[str, Any] = field(default_factory=dict)  # model name -> memplan.launch.megatron launch
    assumed_gpu: list[str] = field(default_factory=list)  # the models timed on the A100 for want of a GPU

    @property
    def result(self) -> SearchResult:
        """The one model's result (a search with model or hf_config)."""
        return self.results[0]

    def best(self) -> Optional[Any]:
        """The config of the one model's best plan; None when no plan fits."""
        r = self.result
        return r.config(r.top[0]) if r.top else None

    @property
    def fits(self) -> bool:
        """Whether any plan of any model fits."""
        return any(r.top for r in self.results)

    def to_dict(self, launch: bool = True) -> Union[dict[str, Any], list[dict[str, Any]]]:
        """The document `memplan search ... --json` prints: an object for one model, a list for every preset
        (launch=False: without the launch arguments, as the Markdown and CSV formats have them)."""
        dicts = [search_dict(r) for r in self.results] + [skipped_dict(s, self.gpus) for s in self.skipped]
        for d in dicts:
            if launch and d["model"] in self.launch:
                d["launch"] = self.launch[d["model"]].as_dict()
        return dicts[0] if self.one_model else dicts


def _optimizer_notes(result: SearchResult) -> list[str]:
    """What a search says about its (pinned) optimizer: implementation and the source of its figures."""
    if result.training.optimizer == "adamw":
        return []
    inventory = training_inventory(result.model, result.impl, result.training.device, result.training)
    impl = optimizer_impl(result.training, inventory)
    return optimizer_notes(result.training, impl, pinned=True)


@dataclass
class PreparedSearch:
    """A search whose input is checked and whose presets are read: `run` does the work."""

    opts: PlanOptions
    fixed: Fixed
    presets: list[ModelPreset]
    one_model: bool
    top: int = 10
    sort: str = "time"
    all_variants: bool = False
    max_tp: Optional[int] = None
    max_seq: bool = False
    emit: Optional[str] = None
    search_float8: bool = False  # --float8 any (torchtitan): bf16 and float8 searched

    def _replayed(self, result: SearchResult, request: tuple, kw: dict[str, Any]) -> SearchResult:
        """The search's listing replayed through the caching allocator (plan/verdict.py); with --max-seq, the longest
        length at which a listed plan's replay completes."""
        opts = self.opts

        def listed(r: SearchResult) -> SearchResult:
            return replay_listing(r, self.sort, not self.all_variants, self.top, opts.replay())

        result = listed(result)
        if not self.max_seq:
            return result
        model, training, gb, gpu, budget = request
        titan = opts.impl == "torchtitan"

        def search_at(s: int) -> SearchResult:
            at = model.model_copy(update={"seq_length": s})
            return listed(search_titan(at, training, opts.gpus, gb, budget, **kw) if titan else
                          search_plans(at, training, opts.gpus, gb, budget, gpu=gpu, **kw))

        return replayed_max_seq(result, search_at)

    def run(self, progress: Optional[Callable[..., None]] = None) -> SearchResults:
        """Search every preset; `progress(done, total, label=...)` hears how far it is."""
        opts = self.opts
        gpu_of = [opts.search_gpu(p) for p in self.presets]
        requests = [(*search_inputs(p, opts.gpus, opts.global_batch, opts.seq_len, opts.attention,
                                    opts.training_settings(), opts.global_batch_tokens),
                     gpu, opts.mem if opts.mem is not None else gpu.process_memory_bytes)
                    for p, (gpu, _) in zip(self.presets, gpu_of)]
        kw = dict(fixed=self.fixed, max_tp=self.max_tp, top=self.top, impl=opts.impl, margin=opts.frag_margin,
                  host_budget_bytes=opts.host_mem)
        skipped: list[Skipped] = []
        if self.one_model and opts.impl == "torchtitan":
            model, training, gb, gpu, budget = requests[0]
            # as estimate builds it (DeepSeek-V3: latents replicated; its MTP layers)
            model = titan_model(model, mtp_layers(opts.mtp, opts.impl))
            requests[0] = (model, training, gb, gpu, budget)
            report = functools.partial(progress, label=model.name) if progress is not None else None
            kw = dict(gpu=gpu, pins=_titan_pins(opts, self.emit, self.search_float8), max_tp=self.max_tp, top=self.top,
                      margin=opts.frag_margin, host_budget_bytes=opts.host_mem)
            results = [(search_titan_max_seq if self.max_seq else search_titan)(model, training, opts.gpus, gb, budget,
                                                                               progress=report, **kw)]
            if opts.mtp:
                results[0].notes.append(f"--mtp {opts.mtp}: pp 1 and cp 1 only (torchtitan 0.3.0 refuses multi-token "
                                        "prediction with pipeline or context parallelism); the MTP layers' kept tensors "
                                        "measured with TP and EP (tests/test_titan_mtp_tp.py), their FLOPs derived")
        elif self.one_model:
            model, training, gb, gpu, budget = requests[0]
            report = functools.partial(progress, label=model.name) if progress is not None else None
            results = [(search_max_seq if self.max_seq else search_plans)(model, training, opts.gpus, gb, budget,
                                                                          gpu=gpu, progress=report, **kw)]
        else:
            results, skipped = search_presets(requests, opts.gpus, max_seq=self.max_seq, progress=progress, **kw)
        by_model = {req[0].name: req for req in requests}
        settled = []
        for r in results:
            try:
                settled.append(self._replayed(r, by_model[r.model.name], kw))
            except MemplanError as err:
                if self.one_model:
                    raise
                gpu = by_model[r.model.name][3]
                skipped.append(Skipped(r.model.name, gpu.name if gpu is not None else None, str(err)))
        results = settled
        launch: dict[str, Any] = {}
        if self.emit:
            for r in results:  # a model no Megatron-LM arguments build gets a note instead of a launch
                refusal = launch_refusal(r.model) if self.emit in MEGATRON_EMITS else None
                if refusal:
                    r.notes.append(refusal)
                elif r.top:
                    launch[r.model.name] = launch_for(r.config(r.top[0]), self.emit, r.impl,
                                                      opts.replay().launch_conf())
        by_name = {p.model.name: (p, note, req[0].seq_length) for p, (_, note), req in zip(self.presets, gpu_of, requests)}
        for r in results:
            p, gpu_note, asked_s = by_name[r.model.name]
            if opts.seq_len is None and self.one_model:
                r.notes.extend(p.notes)
            # --max-seq keeps the batch in sequences made at the s asked for (search_max_seq's note says so)
            seq = asked_s if self.max_seq else r.model.seq_length
            r.notes.extend(opts.batch_notes(p, seq, r.global_batch) + gpu_note + _optimizer_notes(r))
            r.gpu_assumed = opts.assumed_gpu(p)
        assumed = [p.model.name for p, (_, note) in zip(self.presets, gpu_of) if note]
        return SearchResults(results, skipped, opts.gpus, self.one_model, launch, assumed)


def _check_titan(opts: PlanOptions, uneven_stages: bool) -> None:
    """What `search --impl torchtitan` refuses besides `titan_recompute`'s (memplan/plan/titan.py searches the rest)."""
    if opts.preset() is None:
        raise MemplanError("search --impl torchtitan needs --model (torchtitan's Llama 3; every preset is searched "
                           "with Megatron-LM)")
    opts.titan_pipeline(opts.preset(), search=True)  # a pinned --pp / --pipeline-schedule: what estimate refuses
    check_titan_mtp(opts.mtp or 0, (opts.pp or 1) > 1 or opts.pipeline_schedule is not None, opts.cp or 1)
    if opts.pipeline_layers_per_stage is not None:
        raise MemplanError("search --impl torchtitan tries torchtitan's default 2 stages per rank for the multi-stage "
                           "schedules: estimate a plan with --pipeline-layers-per-stage")
    opts.titan_layers(opts.preset())  # --ac selective-layer:N as estimate takes it (not with a pinned --pp)
    if opts.dp is not None or opts.zero_shard is not None or uneven_stages or opts.first_stage_layers is not None \
            or opts.last_stage_layers is not None:
        raise MemplanError("search --impl torchtitan pins its data parallelism with --tp (d = GPUs / tp) and "
                           "--dp-replicate R (HSDP), not --dp, --zero-shard or stage splits")


def _titan_pins(opts: PlanOptions, emit: Optional[str], search_float8: bool = False) -> TitanPins:
    """The torchtitan dimensions the options pin (with --emit torchtitan: only AC modes torchtitan 0.3.0 has)."""
    one = 1 if opts.mtp else None  # torchtitan's MTP layers: pp 1 and cp 1 only (a pinned other refused: check_titan_mtp)
    return TitanPins(tp=opts.tp, cp=opts.cp or one, dp_replicate=opts.dp_replicate, ac=opts.ac, compile=opts.compile,
                     micro_batch=opts.micro_batch, pp=opts.pp or one, schedule=opts.pipeline_schedule,
                     launchable=emit == "torchtitan", ep=opts.ep, etp=opts.etp,
                     float8=FLOAT8_ANY if search_float8 else None)


def prepare_search(model: Optional[str] = None, *, top: int = 10, sort: str = "time", all_variants: bool = False,
                   max_tp: Optional[int] = None, uneven_stages: bool = False, max_seq: bool = False,
                   emit: Optional[str] = None, **options: Any) -> PreparedSearch:
    """Check a search's input and read its presets (every preset without model / hf_config); see `search`."""
    search_float8 = options.get("float8") == FLOAT8_ANY
    if search_float8:
        if options.get("impl") != "torchtitan":
            raise MemplanError("--float8 any searches torchtitan's float8 linears: search --impl torchtitan")
        options = {**options, "float8": None}
    opts = PlanOptions(model=model, **options)
    check_emit(emit, opts.mst, opts.impl)
    if opts.gpus is None:
        raise MemplanError("--gpus is required for search")
    if max_seq and opts.global_batch_tokens is not None:
        raise MemplanError("search --max-seq keeps the global batch in sequences (a step's tokens grow with s): give "
                           "--global-batch N, not --global-batch-tokens")
    mtp_layers(opts.mtp, opts.impl)  # --mtp: torchtitan's only
    # --async-tp: torchtitan's, pinned on the compiled tp > 1 plans (refused where a pin leaves none)
    check_async_tp(bool(opts.async_tp), opts.impl, opts.compile is not False, opts.tp or 2)
    # as estimate: what --impl torchtitan does not model and --ac's spelling, or with another impl torchtitan's own
    # options (--ac, --dp-replicate, its schedules) refused
    opts.titan_recompute()
    if opts.impl == "torchtitan":
        _check_titan(opts, uneven_stages)
    if opts.recompute_method is not None:
        raise MemplanError("--recompute-method is one plan's (estimate): search tries full recompute of every layer "
                           "and of N layers per chunk (Megatron-LM's uniform and block methods) itself")
    if opts.mst not in (None, 1) and opts.preset() is None:
        raise MemplanError("search --mst needs --model (MsT is modelled for the Llama layout)")
    fixed = fixed_from(
        dict(tp=opts.tp, pp=opts.pp, dp=opts.dp, vpp=opts.vpp, sp=opts.sp, zero=opts.zero_stage,
             zero_shard=opts.zero_shard, **opts.cp_ep(), first_stage_layers=opts.first_stage_layers,
             last_stage_layers=opts.last_stage_layers, uneven=uneven_stages),
        dict(micro_batch=opts.micro_batch, recompute=opts.recompute, recompute_num_layers=opts.recompute_num_layers),
    )
    one = opts.preset()
    presets = [one] if one is not None else [load_model(name) for name in model_names()]
    presets = [opts.routed(p, one is not None) for p in presets]
    if emit and one is not None and launch_refusal(presets[0].model):
        raise MemplanError(launch_refusal(presets[0].model))
    return PreparedSearch(opts, fixed, presets, one is not None, top=top, sort=sort, all_variants=all_variants,
                          max_tp=max_tp, max_seq=max_seq, emit=emit, search_float8=search_float8)


def search(model: Optional[str] = None, *, gpus: Optional[int] = None, top: int = 10, sort: str = "time",
           all_variants: bool = False, max_tp: Optional[int] = None, uneven_stages: bool = False,
           max_seq: bool = False, emit: Optional[str] = None, progress: Optional[Callable[..., None]] = None,
           **options: Any) -> SearchResults:
    """Every plan for `gpus` GPUs that fits the budget (`memplan search`), fastest first (sort="memory": least
    device memory first), ZeRO and recompute variants folded (all_variants=True: not); the plan options
    (memplan.api.options.PlanOptions) pin what they name. Without model / hf_config: every preset, each on its
    own GPU. max_seq: the longest sequence some plan fits with, and the plans at that length; emit="megatron" /
    "bridge": the best plan's Megatron-LM launch / Megatron-Bridge overrides (SearchResults.launch); impl="torchtitan":
    torchtitan's dimensions (memplan/plan/titan.py; emit="torchtitan" its config)."""
    return prepare_search(model, gpus=gpus, top=top, sort=sort, all_variants=all_variants, max_tp=max_tp,
                          uneven_stages=uneven_stages, max_seq=max_seq, emit=emit, **options).run(progress)
