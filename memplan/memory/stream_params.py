"""The persistent tensors of a run's allocation stream (memplan/memory/stream.py) on one GPU of a stage: the parameter
tensors in registration order and the bytes each is allocated at (whole, or with ZeRO-3 each tensor's shard), each
parameter group's .grad tensors, the optimizer's master copy and moments (per tensor, or one flat shard per state),
and ZeRO-3's unsharded parameters in flight, cut into units of one layer's parameters. Every size is fitted to the
step timeline's count (StageMemory.states, .gathered), so the stream's live bytes are the timeline's; derived from
the inventories and the frameworks' code (registration order, FSDP2's and DeepSpeed stage 3's per-parameter shards),
not measured.
"""

from __future__ import annotations

from collections import OrderedDict
from fractions import Fraction
from typing import Any

from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly
from memplan.core.training import TrainingSpec
from memplan.inventory.lora import LINEARS, targets_of
from memplan.inventory.types import Inventory, Term
from memplan.memory.adapters import ADAPTER_BYTES, nf4_bytes
from memplan.memory.dp_stack import shard_bytes, sharded_weight_bytes
from memplan.memory.parallel import expert_shard, state_shard
from memplan.memory.stage import StageMemory
from memplan.memory.shapes import weight_shapes
from memplan.memory.param_group import stepped
from memplan.memory.states import output_layer_group, param_groups
from memplan.memory.term_bytes import PlanValues, TermBytes, kind_share, whole_layer

_COMM_WORDS = ("gather", "all-to-all", "alltoall", "dispatch")  # a term named so is a communication buffer
STATE_NAMES = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "lion": ("exp_avg",),
               "sgd-nomomentum": ()}


def fit(items: list, target: int) -> list:
    """Make the sizes of `items` ([name, size] lists) add up to `target`: the last ones dropped while the others
    reach it (a GPU's E/ep experts), then the last largest absorbs the rest (a vocabulary padded to t)."""
    total = sum(n for _, n in items)
    while len(items) > 1 and total - items[-1][1] >= target:
        total -= items.pop()[1]
    if items and total != target:
        big = max(range(len(items)), key=lambda i: (items[i][1], i))
        items[big][1] += target - total
    return items


def _fit_groups(rows: list, targets: dict) -> list:
    for name, target in targets.items():
        mine = [r for r in rows if r[0] == name] or ([rows.append([name, name, 0]) or rows[-1]] if target else [])
        fitted = fit([[r[1], r[2]] for r in mine], target)
        for k, r in enumerate(mine):
            r[2] = fitted[k][1] if k < len(fitted) else 0
    return [r for r in rows if r[2] > 0]


def titan_layer_rows(rows: list) -> list:
    """A dense torchtitan Llama 3 layer's parameter tensors as its TransformerBlock registers them: attention (wqkv,
    wo), feed_forward (w1, w2, w3: the fused layout's "MLP input" row is w1 and w3, half each), attention_norm,
    ffn_norm (recorded: tests/test_titan_alloc.py); any other layer's rows as they are."""
    by = {}
    for r in rows:
        by.setdefault(r[1], []).append(r)
    if sorted(by) != ["MLP input", "MLP output", "QKV", "norm weight", "output projection"] or len(by["norm weight"]) != 2 \
            or any(len(v) != 1 for k, v in by.items() if k != "norm weight") or by["MLP input"][0][2] % 2:
        return rows
    (w13,), (w2,) = by["MLP input"], by["MLP output"]
    half = [w13[0], "w1", w13[2] // 2], [w13[0], "w3", w13[2] // 2]
    return by["QKV"] + by["output projection"] + [half[0], w2, half[1]] + by["norm weight"]


class Persistent:
    """The parameter tables of one GPU (scope -> [group, name, params] in registration order), where each group sits
    (`site_of`), the GPU's sites (the embedding "first", layers 1..n, "last", the untied "head"), each group's .grad
    rows per table, and the sizes of the weights, optimizer states and gathered units."""

    def __init__(self, model: ModelSpec, inv: Inventory, training: TrainingSpec, plan: PlanValues, mem: StageMemory,
                 n: int, is_first: bool, is_last: bool) -> None:
        self.tr, self.plan, self.mem, self.n = training, plan, mem, n
        self.dense_here = model.moe_first_dense_layers * is_first
        values = plan.symbols(model)
        count = TermBytes(model, plan, training.activation_bytes).group
        self.groups = {g.name: g for g in param_groups(model)}
        head = output_layer_group(model)
        self.untied_head = (not model.tied_embeddings) or plan.p > 1
        shapes = weight_shapes(model, inv.weight_layout)
        wanted = {"first": ("first",), "layer": ("layer", "moe" if model.is_moe else "layer"),
                  "dense_layer": ("layer", "dense"), "last": ("last",)}
        # a hybrid (layer_pattern): every layer holds its average share of each block (derived)
        share = {k: n / model.num_layers for k, n in model.layer_blocks.items()} if model.layer_pattern else {}
        wanted["layer"] = ("layer", *share) if share else wanted["layer"]
        self.tables: dict[str, list] = {}
        for key, scopes in wanted.items():
            rows = [[w.group, w.name, int(w.on_gpu(values, key in ("layer", "dense_layer")).numel)]
                    for w in shapes[key] for _ in range(w.count)]
            targets = {g.name: int(count(g) * share.get(g.scope, 1)) for g in self.groups.values() if g.scope in scopes}
            self.tables[key] = _fit_groups(rows, targets)
        self.tables["head"] = _fit_groups([[head.name, "output layer", 0]], {head.name: int(count(head))})
        if training.dp_stack == "torchtitan" and inv.weight_layout == "fused":
            self.tables["layer"] = titan_layer_rows(self.tables["layer"])
        self.site_of = {g.name: "last" for g in self.groups.values() if g.scope == "last"}
        self.site_of.update({g.name: "first" for g in self.groups.values() if g.scope == "first"}, **{head.name: "head"})
        self.sites = (["first"] if is_first else []) + [j for j in range(1, n + 1)] + (
            (["last"] + (["head"] if self.untied_head else [])) if is_last else [])
        # LoRA (peft's get_peft_model after the base is on the GPU): one layer's adapters, lora_A (r x n_in) then
        # lora_B (n_out x r) per target linear in module order, fp32; only they get gradients and states
        self.lora, self.adapters = bool(training.lora_rank), []
        for name in (n for n in LINEARS if n in targets_of(training.lora_targets)) if self.lora else ():
            n_in, n_out, group = (int(Poly.parse(x).evaluate(values)) if k < 2 else x for k, x in enumerate(LINEARS[name]))
            self.adapters += [[group, f"{name} lora_A", training.lora_rank * n_in],
                              [group, f"{name} lora_B", n_out * training.lora_rank]]
        self.linear_groups = {g for *_, g in LINEARS.values()} if training.qlora else set()
        gb = ADAPTER_BYTES if self.lora else training.grad_bytes
        self.grad_rows: dict[tuple, list] = {}
        for key, rows in ({"layer": self.adapters} if self.lora else self.tables).items():
            for name in dict.fromkeys(r[0] for r in rows if self._trained(r[0])):  # no .grad of an untrained group
                n_bytes = sum(r[2] for r in rows if r[0] == name) * gb
                kept = shard_bytes(n_bytes, self._shard(name), plan.zero >= 2)
                self.grad_rows[key, name] = [r for r in fit([[r[1], r[2] * gb] for r in rows if r[0] == name], kept)
                                             if r[1] > 0]

    def _trained(self, group: str) -> bool:
        """Whether a group gets gradients and optimizer states (ParamGroup.trained; the output layer does)."""
        g = self.groups.get(group)
        return g is None or stepped(g, self.tr.dp_stack)

    def _shard(self, group: str) -> Any:
        g = self.groups.get(group)
        return expert_shard(self.plan) if g is not None and g.expert else state_shard(self.plan)

    def table(self, site: Any) -> str:
        return site if isinstance(site, str) else ("dense_layer" if site <= self.dense_here else "layer")

    def tensors(self) -> list:
        """(site, group, name, params) of every parameter tensor of the GPU, in registration order."""
        return [(site, g, name, n) for site in self.sites for g, name, n in self.tables[self.table(site)]]

    def trained(self) -> list:
        """(site, group, name, params) of the tensors the optimizer steps: LoRA's adapters, else every trained one."""
        if not self.lora:
            return [t for t in self.tensors() if self._trained(t[1])]
        return [(j, g, name, n) for j in self.sites if isinstance(j, int) for g, name, n in self.adapters]

    def new_grad(self, group: str, site: Any) -> int:
        """A group's gradient as autograd makes it (one layer's, or the head's): in the weights' dtype, LoRA's in
        the adapters' fp32."""
        if self.lora:
            return sum(n for g, _, n in self.adapters if g == group) * ADAPTER_BYTES
        n = sum(r[2] for r in self.tables[self.table(site)] if r[0] == group) * self._trained(group)
        return n * self.tr.weight_bytes if site != "head" or self.untied_head else 0

    def _base_bytes(self, site: Any, group: str, n: int) -> int:
        """A parameter tensor's bytes: QLoRA's layer linears in NF4 (memplan/memory/adapters.py nf4_bytes)."""
        return nf4_bytes(n) if isinstance(site, int) and group in self.linear_groups else n * self.tr.weight_bytes

    def weights(self) -> list[tuple[str, int]]:
        """(name, bytes) of the parameter allocations at model build: each tensor (with ZeRO-3 its shard, rounded down,
        the largest taking the rounding), then one block of what else the timeline counts with the weights (MTP
        modules, FP8 weight caches, a stack's buckets), less the gathered parameters the first forward makes."""
        z3 = self.plan.zero >= 3
        tensors = self.tensors() + [(j, g, name, n * ADAPTER_BYTES) for j, g, name, n in self.trained()] * self.lora
        sizes = [self._base_bytes(site, g, n) for site, g, _, n in tensors[:len(tensors) - len(self.trained()) * self.lora]]
        sizes += [n for *_, n in tensors[len(sizes):]]
        if z3:  # each tensor's shard (FSDP2, DeepSpeed stage 3: per parameter), rounded down
            swb = sharded_weight_bytes(self.tr) / self.tr.weight_bytes
            sizes = [int(n * swb) // self._shard(g) for n, (_, g, _, _) in zip(sizes, tensors)]
        rest = self.mem.states.weights - sum(sizes) - int(self.mem.gathered)
        if z3 and 0 < rest <= len(sizes):
            sizes[max(range(len(sizes)), key=sizes.__getitem__)] += rest
            rest = 0
        out = [(f"{name}{' shard' * z3} ({'layer ' * isinstance(site, int)}{site})", n)
               for (site, _, name, _), n in zip(tensors, sizes) if n > 0]
        return out + [("other parameters and weight caches", rest)] * (rest > 0)

    def optimizer_rows(self) -> tuple[list, list]:
        """(master copy rows, moment rows): per tensor with ZeRO 0 (states of parameter size), else one flat shard
        per state; each a list of [name, bytes] lists."""
        tr, total = self.tr, self.mem.states.optimizer
        names = STATE_NAMES.get(tr.optimizer)
        mb, sb = (0, ADAPTER_BYTES) if self.lora else (tr.master_weight_bytes, tr.optimizer_state_bytes)
        weights = [("optimizer states", 1)] if names is None else (
            [("master weights (fp32)", mb)] * (mb > 0) + [(s, sb) for s in names])
        parts = [[label, total * w // (sum(w for _, w in weights) or 1)] for label, w in weights]
        if parts:
            parts[0][1] += total - sum(n for _, n in parts)
        master: list = []
        lazy: list = []
        flat = " (flat shard)" * (self.plan.zero > 0)
        # torchtitan's FSDP2 shards each parameter (dim 0 over the shard group; its fp32 shard is what AdamW steps):
        # its states are per tensor as without ZeRO, each a shard (tests/test_titan_alloc.py: recorded)
        per_dtensor = self.tr.dp_stack == "torchtitan" and self.plan.p == 1
        for label, n in (part for part in parts if part[1] > 0):
            rows = (fit([[f"{label} of {name}" + " (shard)" * per_dtensor,
                          -(-p // (self._shard(g) if per_dtensor else 1)) * dict(weights)[label]]
                         for _, g, name, p in self.trained()], n)
                    if (self.plan.zero == 0 or per_dtensor) and names is not None else [[label + flat, n]])
            (master if label.startswith("master") else lazy).append(rows)
        return master, lazy

    def fsdp_grad_units(self, total: int) -> list[tuple[str, int]]:
        """torchtitan's FSDP2 sharded fp32 gradients (`total` bytes) as it keeps them: each unit's (the input
        embedding, every decoder layer, the final norm + LM head) reduce-scatter output, one tensor its parameters'
        gradients are views of (tests/test_titan_alloc.py: recorded)."""
        rows = [[f"FSDP2's sharded fp32 gradients of {'layer ' * isinstance(site, int)}{site}",
                 sum(-(-p // self._shard(g)) for s2, g, _, p in self.trained() if s2 == site) * 4]
                for site in self.sites if site != "head"]
        head = sum(-(-p // self._shard(g)) for s2, g, _, p in self.trained() if s2 == "head") * 4
        if rows and head:  # the LM head: in the final norm's unit
            rows[-1][1] += head
        return [(name, n) for name, n in fit(rows, total) if n > 0]

    def gathered_units(self) -> tuple[int, int, int]:
        """(unit bytes, units, rest bytes) of ZeRO-3's unsharded parameters in flight (StageMemory.gathered): units
        of one layer's parameters (FSDP2's all-gather output of one layer), the rest of the count (a tail unit, a
        stack's prefetch bucket) one block."""
        gathered = int(self.mem.gathered)
        unit = sum(r[2] for r in self.tables["layer"]) * self.tr.weight_bytes if self.n else 0
        units = gathered // unit if 0 < unit <= gathered else 0
        return unit, units, gathered - units * unit


_SHARED: "OrderedDict[tuple, dict]" = OrderedDict()  # `Sizes`' entries by what they depend on (`_shared`)


def _shared(model: ModelSpec, plan: PlanValues, activation_bytes: int, granularity: int) -> dict:
    """The entries of every `Sizes` of one plan of scalars and length, whatever the stage (the streams of a plan's
    stages, made one after another by memplan/plan/stage_verdict.py): an entry depends on the model (its length
    included), b, t, SP, cp, ep, etp (the symbols' values and the counted bytes: memory/term_bytes.py
    term_bytes_for), the activation bytes, the granularity, and, for a dense / MoE layer term, the stage's share of
    its kind (`kind_share`, in the entry's key)."""
    plan_key = (plan.b, plan.t, plan.sp, plan.cp, plan.ep, plan.expert_tp)
    if any(hasattr(x, "shape") for x in plan_key):
        return {}
    key = (model, *(int(x) for x in plan_key), activation_bytes, granularity)
    entries = _SHARED.get(key)
    if entries is None:
        entries = _SHARED[key] = {}
        if len(_SHARED) > 16:
            _SHARED.popitem(last=False)
    else:
        _SHARED.move_to_end(key)
    return entries


class Sizes:
    """Requested and counted bytes of terms for one sequence length (memplan/memory/stream.py's events)."""

    def __init__(self, model: ModelSpec, inventory: Inventory, training: TrainingSpec, plan: PlanValues,
                 stage: int = 0) -> None:
        self.values, self.act, self.sp = plan.symbols(model), training.activation_bytes, plan.sp
        self.model, self.plan, self.stage = model, plan, stage
        self.counted = TermBytes(model, plan, training.activation_bytes, inventory.granularity)
        self.cache: dict[tuple, tuple] = {}
        self.shared = _shared(model, plan, training.activation_bytes, inventory.granularity)

    def __call__(self, term: Term, kind: str) -> tuple:
        """(requested bytes of one storage, counted bytes of one storage, storages (0: none), poly of one
        storage in s and b, kind)."""
        hit = self.cache.get((id(term), kind))
        if hit is not None:
            return hit[1]
        num, den, one = 1, 1, term  # a dense / MoE layer's term: one layer's tensor x the stage's share of its kind
        if term.layer_kind:
            (num, den), one = kind_share(self.model, term, self.plan, self.stage), whole_layer(self.model, term)
        key = (id(term), kind, int(num), int(den))
        shared = self.shared.get(key)
        if shared is not None:  # another stage's of this plan and length (`_shared`)
            self.cache[id(term), kind] = shared
            return shared[1]
        n, st = one.bytes(self.values, self.act, self.sp) * num // den, term.storages
        poly = one.split_size(self.act, bool(self.sp)) * Fraction(int(num), st * int(den))
        for sym in {x for mono, _ in poly.terms for x, _ in mono} - {"s", "b"}:
            poly = poly.assign(sym, self.values[sym])
        comm = any(w in term.name.lower() for w in _COMM_WORDS)
        # the term kept in the entry: its id() stays its own while cached
        sizes = (-(-n // st), self.counted(one) * num // den // st, st * (n > 0), poly,
                 "communication" if comm else kind)
        self.cache[id(term), kind] = self.shared[key] = (term, sizes)
        if len(self.shared) > 4096:  # (an inventory has some hundred terms)
            self.shared.clear()
        return sizes
