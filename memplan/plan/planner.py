"""`search`: every plan a user could launch for a model on N GPUs, evaluated as numpy arrays
by the same functions `estimate` uses, filtered by a memory budget and ranked by step time.

The space (each plan distinct and launchable with Megatron-LM):
  t  divides a and the key/value heads, at most the GPUs of a node (or `max_tp`);
  p  divides L; d = N / (t p) must be whole and divide the global batch;
  b  divides the global batch / d (M = global batch / (b d) micro-batches per step);
  m  interleaved chunks per rank, dividing L / p (m > 1 needs p > 1 and M divisible by p,
     Megatron-LM's interleaved-schedule requirement);
  SP on / off when t > 1;
  recompute none, selective, or full on N = 1 .. L/(pm) layers per chunk (block method);
  ZeRO 0 .. 3 (1 = Megatron-LM distributed optimizer) when d > 1 (with d = 1 they equal 0), each
     sharded over k ranks for every divisor k > 1 of d (k < d: HSDP, d/k replicas of each shard).

How every plan is evaluated, exactly and fast (`PlanSpace`, `search`)
---------------------------------------------------------------------
The space is a table: a row is a plan without its ZeRO variant (t, p, d, m, b, M, SP, recompute,
recomputed layers) and the columns are the ZeRO variants of the row's d. Memory and step time are
the functions `estimate` uses (`stage_memory`, `step_events`, `device_memory`, `perf.step_time`),
called on row arrays of shape (rows, 1) broadcast against column arrays of shape (rows, columns).
Integers stay integers and every float32 step time is computed element by element as in a flat
array, so each plan's numbers are the same, bit for bit, as when it is evaluated alone
(`evaluate`; tests/test_planner_exhaustive.py checks every plan of 20 spaces). Three facts make
the memory cheap, each checked while the search runs (a failed check evaluates that part of the
space directly, row by row and column by column):

- Full recompute of k = 1 .. n layers per chunk makes most rows. Every moment of the step timeline
  and the retained bytes are affine in k for 1 <= k <= n - 1 (memplan/timeline.py: the saved
  layers are min(j, k) recomputed + the rest, at the critical layers n, k, k + 1 and 1; the copies
  in flight k x kept + (n - k) x kept-if-not-recomputed), so the rows of 3 <= k <= n - 1 follow
  from k = 1 and 2 as value(1) + (k - 1) x slope, exactly in integers. Per (t, p), one row of
  k = n - 1 is evaluated too and must lie on its line.
- With a gradient buffer (Megatron-LM, the torch loop) the ZeRO variant changes a moment only
  through the states, which depend on t, p and the variant: bytes(row, variant) = bytes(row, first
  variant) + bytes(r, variant) - bytes(r, first variant) for a row r of the same (t, p). Three more
  rows per (t, p), evaluated with every variant, must agree. (transformers' .grad tensors mix the
  two: their spaces, t = p = 1, are evaluated whole.)
- The device memory grows with the step peak, so a plan fits exactly when its peak lies between two
  thresholds per (t, p), found by bisection on `device_memory` itself; for the derived rows, the k
  that fit are an interval computed from the moments' lines.

With p = 1 the first stage is the last: one stage is evaluated. Every plan's fit is decided and
counted, and every plan's step time computed (the ranking and the fastest plan over the budget).
`SearchResult.evaluated` (every plan's numbers, for plots) is filled on first use. With
`search(..., reference=True)` every plan is evaluated as flat arrays in chunks and sorted: the
oracle the tests compare with.

What a user reads (`arrange`): the plans that fit, ordered by step time or by device memory, with
the variants of a plan folded into one row (`FOLDING_RULE`, also in `memplan search --help`),
decided on every plan's numbers (`SearchResult.evaluated`, the same as `evaluate` gives); the
plans shown are evaluated on their own, as the search's top list is.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Optional

import numpy as np

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, GpuSpec, ParallelSpec, check_gpus
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory import mst
from memplan.inventory.assemble import training_inventory
from memplan.inventory.fp8 import MAX_ZERO as FP8_MAX_ZERO
from memplan.inventory.fp8 import check_fp8
from memplan.inventory.types import HF_IMPLS, Inventory
from memplan.memory.offload import host_bytes, offloads, per_node
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues
from memplan.memory.timeline import device_memory, step_events
from memplan.plan.estimate import device_bytes
from memplan.plan.limits import SEQ_LIMIT, largest
from memplan.timing.perf import step_time


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0] if n > 0 else []
    return tuple(small + [n // i for i in reversed(small) if i * i != n])


def divisors(n: int) -> list[int]:
    return list(_divisors(n))


@dataclass(frozen=True)
class Fixed:
    """Dimensions the user pinned (None = search it)."""

    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    vpp: Optional[int] = None
    sp: Optional[bool] = None
    recompute: Optional[Recompute] = None
    recompute_num_layers: Optional[int] = None
    micro_batch: Optional[int] = None
    zero: Optional[int] = None
    zero_shard: Optional[int] = None
    max_zero: int = 3  # the highest ZeRO stage the training settings allow (FP8: 1, memplan/fp8.py)
    cp: Optional[int] = None
    ep: Optional[int] = None
    etp: Optional[int] = None
    cp_comm_type: str = "p2p"  # not searched: how every plan's context-parallel attention communicates
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    uneven: bool = False  # also search uneven stages: one or two layers fewer on the first / last stage (_splits)


def _pick(values: list[int] | tuple[int, ...], fixed: Optional[int]) -> list[int]:
    return [v for v in values if fixed is None or v == fixed]


# --- the space as rows x ZeRO columns ----------------------------------------------------------
ROW_FIELDS = ("t", "p", "d", "m", "b", "M", "sp", "rec", "k", "cp", "ep", "etp", "lf", "ll")


def _splits(L: int, p: int, fixed: Fixed) -> list[tuple[int, int]]:
    """The layer splits searched for p stages, as (first stage's layers, last stage's layers), the middle stages
    splitting the rest evenly (memplan/pipeline.py stage_layers): the even split when p divides L; with
    `fixed.uneven` also those with one or two layers fewer on the first and / or the last stage (the first holds
    the most micro-batches in flight, the last the LM head: Llama 3, arXiv 2407.21783 section 3.3.2), with p = 2
    the first or the last one or two layers short; the pinned split only, when pinned (Config's rules)."""
    if p == 1:
        return [(L, L)] if fixed.first_stage_layers is None and fixed.last_stage_layers is None else []
    if fixed.first_stage_layers is not None or fixed.last_stage_layers is not None:
        f, l = fixed.first_stage_layers, fixed.last_stage_layers
        left = p - (f is not None) - (l is not None)
        rest = L - (f or 0) - (l or 0)
        if rest < 0 or bool(rest) != bool(left) or (left and rest % left):
            return []
        even = rest // left if left else 0
        return [(f if f is not None else even, l if l is not None else even)]
    out = [(L // p, L // p)] if L % p == 0 else []
    if fixed.uneven:
        if p == 2:
            out += [(f, L - f) for f in range(max(1, (L - 2 + 1) // 2), (L + 2) // 2 + 1)
                    if f != L - f and 1 <= L - f and abs(2 * f - L) <= 2]
        else:
            for df in (0, 1, 2):
                for dl in (0, 1, 2):
                    if (df or dl) and (L + df + dl) % p == 0 and (L + df + dl) // p - max(df, dl) >= 1:
                        mid = (L + df + dl) // p
                        out.append((mid - df, mid - dl))
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class PlanSpace:
    """Every valid plan, as a table: rows (t, p, d, m, b, M, SP, recompute, recomputed layers: 1-D
    int64 arrays) x the ZeRO variants (stage, shard group) of the row's d. Plan numbers (indices)
    follow `enumerate_plans`' order: for t, p, b, m (a "group"), then SP, ZeRO variant, recompute
    variant, so the plan in row r, column c is number base[r] + c * stride[r]."""

    rows: dict[str, np.ndarray]  # ROW_FIELDS, one element per row
    dix: np.ndarray  # per row: index of its d in the ZeRO tables
    zero_table: np.ndarray  # (distinct d, most variants): ZeRO stage of each column (padded with column 0)
    shard_table: np.ndarray  # the same for the shard group
    zcount: np.ndarray  # (distinct d,): variants of each d
    base: np.ndarray  # per row: plan number of column 0
    stride: np.ndarray  # per row: plan numbers from one column to the next (the group's recompute variants)
    block: np.ndarray  # per row: its (t, p) block
    block_row: np.ndarray  # per block: its first row
    group_offset: np.ndarray  # per group: plan number of its first plan
    group_row: np.ndarray  # per group: its first row
    group_z: np.ndarray  # per group: ZeRO variants
    group_r: np.ndarray  # per group: recompute variants
    k1_row: np.ndarray  # per row: the row of full recompute of 1 layer in its (group, SP) set, -1 if none
    derivable: np.ndarray  # per row: full recompute of 3 <= k <= n - 1 layers in a set with k = 1 .. n
    chunk_layers: np.ndarray  # per row: n = L/(pm), layers per model chunk (uneven stages: the largest chunk)
    count: int  # plans
    cp_comm: str = "p2p"  # context-parallel attention's communication (not searched)
    uneven: bool = False  # some row splits the layers unevenly over the stages (rows lf, ll)

    @property
    def row_count(self) -> int:
        return len(self.base)

    @property
    def max_micro_batch(self) -> int:
        return int(self.rows["b"].max())

    def columns(self, rows: np.ndarray) -> np.ndarray:
        """Number of ZeRO variants of each row."""
        return self.zcount[self.dix[rows]]

    def plans2d(self, rows: np.ndarray, width: int) -> PlanValues:
        """The plans of `rows` (first `width` columns) as arrays of shape (rows, 1) for what the
        row decides and (rows, width) for the ZeRO stage and shard group."""
        r = {name: self.rows[name][rows][:, None] for name in ROW_FIELDS}
        zero = self.zero_table[self.dix[rows], :width]
        shard = self.shard_table[self.dix[rows], :width]
        return PlanValues(t=r["t"], p=r["p"], d=r["d"], m=r["m"], sp=r["sp"], zero=zero, shard=shard, b=r["b"],
                          recompute=r["rec"], recomputed_layers=r["k"], microbatches=r["M"], **self._cp_ep(r), **self._split(r))

    def _cp_ep(self, r: dict[str, np.ndarray]) -> dict[str, Any]:
        return dict(cp=r["cp"], ep=r["ep"], etp=r["etp"], cp_comm=self.cp_comm)

    def row_plans(self, rows: np.ndarray) -> PlanValues:
        """The rows as 1-D plans (ZeRO stage 0 over d: for what depends on t, p and d only)."""
        r = {name: self.rows[name][rows] for name in ROW_FIELDS}
        return PlanValues(t=r["t"], p=r["p"], d=r["d"], m=r["m"], sp=r["sp"], zero=0 * r["d"], shard=r["d"],
                          b=r["b"], recompute=r["rec"], recomputed_layers=r["k"], microbatches=r["M"], **self._cp_ep(r),
                          **self._split(r))

    def _split(self, r: dict[str, np.ndarray]) -> dict[str, Any]:
        """The rows' first / last stage layers when the space has uneven splits; None (the even split, evaluated as
        before) when it has none."""
        return dict(first_layers=r["lf"], last_layers=r["ll"]) if self.uneven else {}

    def locate(self, index: Any) -> tuple[np.ndarray, np.ndarray]:
        """(row, column) of plan numbers."""
        index = np.asarray(index, dtype=np.int64)
        g = np.searchsorted(self.group_offset, index, side="right") - 1
        q = index - self.group_offset[g]
        R, Z = self.group_r[g], self.group_z[g]
        r_i = q % R
        rest = q // R
        col = rest % Z
        return self.group_row[g] + (rest // Z) * R + r_i, col

    def take(self, index: Any) -> PlanValues:
        """Plans by number, as 1-D arrays (the flat form `evaluate` takes)."""
        row, col = self.locate(index)
        r = {name: self.rows[name][row] for name in ROW_FIELDS}
        d = self.dix[row]
        return PlanValues(t=r["t"], p=r["p"], d=r["d"], m=r["m"], sp=r["sp"], zero=self.zero_table[d, col],
                          shard=self.shard_table[d, col], b=r["b"], recompute=r["rec"], recomputed_layers=r["k"],
                          microbatches=r["M"], **self._cp_ep(r), **self._split(r))

    def flat(self) -> PlanValues:
        """Every plan as 1-D arrays, in plan-number order."""
        return self.take(np.arange(self.count, dtype=np.int64))

    def numbers(self, rows: np.ndarray, width: int) -> np.ndarray:
        """Plan numbers of the first `width` columns of `rows` (columns past a row's variants: -1)."""
        cols = np.arange(width, dtype=np.int64)
        out = self.base[rows][:, None] + cols * self.stride[rows][:, None]
        return np.where(cols < self.columns(rows)[:, None], out, -1)


def _recompute_variants(n: int, hf: bool, fixed: Fixed) -> list[tuple[int, int]]:
    recompute = [(int(Recompute.NONE), n)] + ([] if hf else [(int(Recompute.SELECTIVE), n)]) + [
        (int(Recompute.FULL), k) for k in range(1, n + 1)]
    if fixed.recompute is not None:
        recompute = [r for r in recompute if r[0] == fixed.recompute]
    if fixed.recompute_num_layers is not None:
        recompute = [r for r in recompute if r[0] == Recompute.FULL and r[1] == fixed.recompute_num_layers]
    return recompute


def plan_space(model: ModelSpec, gpus: int, global_batch: int, fixed: Fixed = Fixed(), max_tp: int = 8,
               impl: str = "megatron") -> PlanSpace:
    """All valid plans (see the module docstring) as a `PlanSpace`. transformers (`hf-*`) runs a
    model whole on each data-parallel rank: t = p = 1 and no selective recompute."""
    check_gpus(gpus)
    a, L, s = model.num_attention_heads, model.num_layers, model.seq_length
    fixed_cp = fixed.cp or 1
    if fixed.tp is not None and fixed.pp is not None and gpus % (fixed.tp * fixed.pp * fixed_cp):
        raise MemplanError(f"GPU count {gpus} is not divisible by t*p*cp = {fixed.tp}*{fixed.pp}*{fixed_cp} = "
                           f"{fixed.tp * fixed.pp * fixed_cp}")
    hf = impl in HF_IMPLS
    groups: list[tuple[int, ...]] = []  # t, p, d, b, M, m, n, first SP value, SP variants, cp, ep, etp
    zero_lists: dict[int, list[tuple[int, int]]] = {}
    rec_lists: dict[int, list[tuple[int, int]]] = {}
    for t, cp, ep, etp, p in _model_parallel(model, gpus, fixed, max_tp, hf):
            splits = _splits(L, p, fixed)
            if not splits:
                continue
            d = gpus // (t * p * cp)
            if (fixed.dp is not None and d != fixed.dp) or global_batch % d or (t * cp * d) % (ep * etp):
                continue
            sps = [0] if t == 1 else [x for x in (0, 1) if (x == 0 and not model.is_moe) or (x == 1 and s % (t * cp) == 0)]
            if fixed.sp is not None:
                sps = [x for x in sps if x == int(fixed.sp)]
            zkey = _zero_key(d, t, cp, ep, etp)
            if zkey not in zero_lists:
                # with expert parallelism the d/k distributed-optimizer instances must divide the expert-data-parallel
                # size edp = t cp d / (etp ep) (ParallelSpec; megatron/core/parallel_state.py)
                zero_lists[zkey] = [(z, k) for z in _pick([z for z in (0, 1, 2, 3) if z <= fixed.max_zero] if d > 1
                                                          else [0], fixed.zero)
                                    for k in ([d] if z == 0 else [k for k in _divisors(d) if k > 1
                                                                  and (zkey[1] == 0 or zkey[1] % (d // k) == 0)])
                                    if fixed.zero_shard is None or (z > 0 and k == fixed.zero_shard)]
            if not (sps and zero_lists[zkey]):
                continue
            for lf, ll in splits:
                stage_counts = [x for x in (lf, ll, (L - lf - ll) // (p - 2) if p > 2 else 0) if x]
                chunk_counts = functools.reduce(math.gcd, stage_counts)
                for b in _pick(_divisors(global_batch // d), fixed.micro_batch):
                    M = global_batch // (d * b)
                    for m in _pick(_divisors(chunk_counts) if p > 1 else (1,), fixed.vpp):
                        if m > 1 and M % p:
                            continue
                        n = max(stage_counts) // m
                        if n not in rec_lists:
                            rec_lists[n] = _recompute_variants(n, hf, fixed)
                        if rec_lists[n]:
                            groups.append((t, p, d, b, M, m, n, sps[0], len(sps), cp, ep, etp, lf, ll))
    if not groups:
        raise MemplanError(
            f"no plan of {model.name} divides {gpus} GPUs with global batch {global_batch}"
            + (" and the pinned dimensions" if any(v is not None for v in fixed.__dict__.values()) else "")
            + f" (t must divide a={a}, at most {max_tp}; p must divide L={L}"
            + (" or split it unevenly" if fixed.uneven else "") + "; d = GPUs/(t p cp) must divide the batch)"
        )
    gt, gp, gd, gb, gM, gm, gn, gsp0, gS, gcp, gep, getp, glf, gll = (np.array(col, dtype=np.int64) for col in zip(*groups))
    gsplit = (glf * gp != L) | (gll * gp != L)  # an uneven split (even: L/p on every stage)

    # ZeRO variants of each d (and expert-data-parallel size) that has plans, padded with the first variant
    ds = list(dict.fromkeys(_zero_key(*x) for x in zip(gd.tolist(), gt.tolist(), gcp.tolist(), gep.tolist(),
                                                        getp.tolist())))
    width = max(len(zero_lists[d]) for d in ds)
    zero_table = np.array([[z for z, _ in zero_lists[d]] + [zero_lists[d][0][0]] * (width - len(zero_lists[d]))
                           for d in ds], dtype=np.int64)
    shard_table = np.array([[k for _, k in zero_lists[d]] + [zero_lists[d][0][1]] * (width - len(zero_lists[d]))
                            for d in ds], dtype=np.int64)
    zcount = np.array([len(zero_lists[d]) for d in ds], dtype=np.int64)
    d_index = {d: i for i, d in enumerate(ds)}
    gdix = np.array([d_index[_zero_key(*x)] for x in zip(gd.tolist(), gt.tolist(), gcp.tolist(), gep.tolist(),
                                                         getp.tolist())], dtype=np.int64)
    gZ = zcount[gdix]

    # recompute variants per n, concatenated; where full recompute covers k = 1 .. n in order
    rec_offset: dict[int, int] = {}
    codes: list[int] = []
    ks: list[int] = []
    for n, variants in rec_lists.items():
        rec_offset[n] = len(codes)
        codes += [c for c, _ in variants]
        ks += [k for _, k in variants]
    rec_codes, rec_ks = np.array(codes, dtype=np.int64), np.array(ks, dtype=np.int64)
    full_first = {n: _full_first(v, n) for n, v in rec_lists.items()}
    gR = np.array([len(rec_lists[n]) for n in gn.tolist()], dtype=np.int64)
    groff = np.array([rec_offset[n] for n in gn.tolist()], dtype=np.int64)
    gfull = np.array([full_first[n] for n in gn.tolist()], dtype=np.int64)

    # a block: rows of one (t, p, cp, ep, etp, split), whose states are the same (the separable moments' and limits' unit)
    gblock = np.concatenate(([0], np.cumsum((gt[1:] != gt[:-1]) | (gp[1:] != gp[:-1]) | (gcp[1:] != gcp[:-1])
                                            | (gep[1:] != gep[:-1]) | (getp[1:] != getp[:-1]) | (glf[1:] != glf[:-1])
                                            | (gll[1:] != gll[:-1])))).astype(np.int64)
    per_group_rows = gS * gR
    group_row = np.concatenate(([0], np.cumsum(per_group_rows)[:-1])).astype(np.int64)
    per_group_plans = per_group_rows * gZ
    group_offset = np.concatenate(([0], np.cumsum(per_group_plans)[:-1])).astype(np.int64)
    nrows = int(per_group_rows.sum())

    gi = np.repeat(np.arange(len(groups), dtype=np.int64), per_group_rows)
    q = np.arange(nrows, dtype=np.int64) - group_row[gi]
    R = gR[gi]
    sp_i = q // R
    r_i = q - sp_i * R
    rec = rec_codes[groff[gi] + r_i]
    k = rec_ks[groff[gi] + r_i]
    n_row = gn[gi]
    # rows of full recompute whose value follows from the rows of k = 1 and 2 (module docstring)
    in_set = (gfull[gi] >= 0) & ~gsplit[gi]  # uneven stages' chunks differ: their k are evaluated directly
    k1_row = np.where(in_set, np.arange(nrows, dtype=np.int64) - r_i + gfull[gi], -1)
    derivable = in_set & (rec == Recompute.FULL) & (k >= 3) & (k <= n_row - 1)
    rows = dict(t=gt[gi], p=gp[gi], d=gd[gi], m=gm[gi], b=gb[gi], M=gM[gi], sp=gsp0[gi] + sp_i, rec=rec, k=k,
                cp=gcp[gi], ep=gep[gi], etp=getp[gi], lf=glf[gi], ll=gll[gi])
    return PlanSpace(
        rows=rows, dix=gdix[gi], zero_table=zero_table, shard_table=shard_table, zcount=zcount,
        base=group_offset[gi] + sp_i * gZ[gi] * R + r_i, stride=R, block=gblock[gi],
        block_row=group_row[np.searchsorted(gblock, np.arange(gblock[-1] + 1))], group_offset=group_offset,
        group_row=group_row, group_z=gZ, group_r=gR, k1_row=k1_row, derivable=derivable,
        chunk_layers=n_row, count=int(per_group_plans.sum()), cp_comm=fixed.cp_comm_type, uneven=bool(gsplit.any()),
    )


# context parallelism is searched from this sequence length on (shorter ones, the 8K of today's pre-training
# presets included: cp = 1 unless --cp pins it): below it t, d and recompute already cover the plans
CP_MIN_SEQ = 16384
MAX_CP = 32  # the largest cp searched (powers of 2; Llama 3 405B's 128K-token stage used 16)


def _model_parallel(model: ModelSpec, gpus: int, fixed: Fixed, max_tp: int, hf: bool) -> Iterator[tuple[int, ...]]:
    """(t, cp, ep, etp, p) of every plan whose t p cp divides the GPU count: t dividing a and g (at most max_tp);
    cp a power of 2 up to MAX_CP with 2 cp | s, flash attention only and s >= CP_MIN_SEQ (memplan/parallel.py);
    for an MoE model ep dividing E and etp in {1, t} dividing f_e (memplan/parallel.py; ep etp | t cp d is checked
    with d); p dividing L (any p with uneven splits: _splits). transformers (hf-*): t = p = cp = ep = 1."""
    a, g, L, s = model.num_attention_heads, model.g, model.num_layers, model.seq_length
    # p dividing L, or any p when uneven splits are searched or pinned (_splits then decides)
    pipelines = (range(1, L + 1) if fixed.uneven or fixed.first_stage_layers is not None
                 or fixed.last_stage_layers is not None else _divisors(L))
    for t in _pick([t for t in _divisors(a) if g % t == 0 and t <= max_tp and (t == 1 or not hf)], fixed.tp):
        cps = [1]
        if not hf and model.attention == "flash" and (s >= CP_MIN_SEQ or fixed.cp is not None):
            cps = [c for c in _divisors(s) if c & (c - 1) == 0 and c <= MAX_CP and s % (2 * c) == 0
                   and (fixed.cp_comm_type != "a2a" or ((a // t) % c == 0 and (g // t) % c == 0))]
        for cp in _pick(cps, fixed.cp):
            eps = [1]
            if model.is_moe and not hf:
                eps = [e for e in _divisors(model.num_experts)]
            for ep in _pick(eps, fixed.ep):
                etps = sorted({1, t}) if model.is_moe and not hf else [t]
                for etp in _pick([e for e in etps if model.fe % e == 0], fixed.etp):
                    for p in _pick([p for p in pipelines if p == 1 or not hf], fixed.pp):
                        if gpus % (t * p * cp) == 0:
                            yield t, cp, ep, etp, p


def _zero_key(d: int, t: int, cp: int, ep: int, etp: int) -> tuple[int, int]:
    """What a plan's ZeRO variants depend on: d, and with expert parallelism (ep etp > 1) the expert-data-parallel
    size (0 without)."""
    return d, (t * cp * d // (ep * etp) if ep * etp > 1 else 0)


def _full_first(variants: list[tuple[int, int]], n: int) -> int:
    """Position of full recompute of 1 layer when the variants hold full recompute of k = 1 .. n
    in order and n >= 4 (so that some k lie strictly between 2 and n); else -1."""
    if n < 4:
        return -1
    for i, (code, k) in enumerate(variants):
        if code == Recompute.FULL and k == 1:
            run = variants[i:i + n]
            return i if run == [(int(Recompute.FULL), j) for j in range(1, n + 1)] else -1
    return -1


def enumerate_plans(model: ModelSpec, gpus: int, global_batch: int, fixed: Fixed = Fixed(),
                    max_tp: int = 8, impl: str = "megatron") -> PlanValues:
    """All valid plans as int64 arrays (one element per plan). transformers (`hf-*`) runs a model
    whole on each data-parallel rank: t = p = 1 and no selective recompute."""
    return plan_space(model, gpus, global_batch, fixed, max_tp, impl).flat()


@dataclass(frozen=True)
class Evaluated:
    plans: PlanValues
    device_bytes: np.ndarray  # what the most loaded GPU needs: peak + fragmentation margin + runtime
    peak_bytes: np.ndarray  # allocated peak of a step on the most loaded GPU (max of first and last stage)
    first_stage_peak_bytes: np.ndarray
    last_stage_peak_bytes: np.ndarray
    retained_bytes: np.ndarray  # states + saved activations at the first backward (most loaded stage)
    step_time_s: Optional[np.ndarray]
    mfu: Optional[np.ndarray]
    tokens_per_s: Optional[np.ndarray]
    host_bytes_per_node: Optional[np.ndarray] = None  # host memory of a node's GPUs for their offload (0: none)


def evaluate(model: ModelSpec, training: TrainingSpec, plans: PlanValues, gpu: Optional[GpuSpec],
             global_batch: int, impl: str = "megatron", margin: Optional[float] = None,
             with_time: bool = True) -> Evaluated:
    """Memory (and step time, when a GPU is known) of every plan, vectorised, with the functions
    `estimate` uses: the step peak at the timeline's critical moments (memplan/timeline.py; a test
    checks them against the walk over every layer) and what the device adds.

    Only the first and the last stage can be the most loaded when the layers are split evenly: every
    middle stage holds no more activations than the first (fewer micro-batches in flight) and the same
    layers' states without the embedding; with uneven stages the second stage too (the most loaded middle
    stage: the most micro-batches in flight of those with the middle stages' layers). A test checks this
    against `estimate`'s all-stage maximum.
    """
    inventory = training_inventory(model, impl, "cuda", training)
    peaks, retained = [], []
    for stage in candidate_stages(plans):
        mem = stage_memory(model, inventory.terms, training, plans, stage, granularity=inventory.granularity,
                           layout=inventory.weight_layout)
        peaks.append(step_events(model, inventory, training, plans, mem, stage, critical=True).peak_bytes)
        retained.append(mem.total)
    peak = functools.reduce(np.maximum, peaks)
    device = device_memory(peak, plans, inventory, gpu, margin).total
    host = host_per_node(model, training, inventory, gpu, plans, device)
    step = mfu = tps = None
    if gpu is not None and with_time:
        perf = step_time(model, training, gpu, plans, global_batch, breakdown=False, impl=impl)
        step, mfu, tps = perf.step_time_s, perf.mfu, perf.tokens_per_s
    return Evaluated(plans, device, peak, peaks[0], peaks[1], functools.reduce(np.maximum, retained), step, mfu, tps,
                     host)


def candidate_stages(plans: PlanValues) -> tuple[Any, ...]:
    """The stages that can be the most loaded (`evaluate`): the first and the last, and with uneven stages the
    second (the most loaded middle one; the last when p = 2, the first when p = 1)."""
    last = plans.p - 1
    if plans.first_layers is None:
        return (0 * last, last)
    return (0 * last, last, last - (last > 1) * (last - 1))


def host_per_node(model: ModelSpec, training: TrainingSpec, inventory: Inventory, gpu: Optional[GpuSpec],
                  plans: PlanValues, like: Any) -> np.ndarray:
    """Host memory a node's GPUs take for their offload (memplan/offload.py), for every plan, shaped as `like`:
    the GPUs of a node x the most one GPU of the first or the last stage takes (a middle stage takes no more than
    the first: fewer micro-batches in flight, no embedding), as `estimate` gives it."""
    if not offloads(training):
        return np.zeros(np.shape(like), dtype=np.int64)
    most: Any = 0
    for stage in candidate_stages(plans):
        mem = stage_memory(model, inventory.terms, training, plans, stage, granularity=inventory.granularity,
                           layout=inventory.weight_layout)
        h = host_bytes(model, inventory.terms, training, plans, mem, inventory.weight_layout).total
        most = np.maximum(most, h)
    gpus = plans.gpus
    node = per_node(most, gpus, gpu.gpus_per_node if gpu is not None else None)
    return np.broadcast_to(np.asarray(node, dtype=np.int64), np.broadcast_shapes(np.shape(node), np.shape(like)))


def _training_fixed(model: ModelSpec, training: TrainingSpec, fixed: Fixed) -> Fixed:
    """What the training settings pin in a search. FP8 is modelled up to the distributed optimizer
    (memplan/fp8.py): the search leaves ZeRO 2 / 3 out. MsT is modelled at micro-batch 1 with every layer
    checkpointed (memplan/mst.py search_pins). Activation offload is modelled without recompute
    (TrainingSpec): the search keeps recompute none."""
    if training.fp8 is not None:
        if fixed.zero is not None and fixed.zero > FP8_MAX_ZERO:
            raise MemplanError(f"--fp8 with ZeRO-{fixed.zero} (Megatron-FSDP) is not modelled: search it with --zero "
                               "0 or 1 (or leave --zero out)")
        fixed = dataclasses.replace(fixed, max_zero=FP8_MAX_ZERO)
    if mst.is_on(training.mst):
        b, k = mst.search_pins(fixed.micro_batch, fixed.recompute, fixed.recompute_num_layers, model.num_layers)
        fixed = dataclasses.replace(fixed, micro_batch=b, recompute=Recompute.FULL, recompute_num_layers=k)
    if not training.offload_activations:
        return fixed
    if fixed.recompute not in (None, Recompute.NONE) or fixed.recompute_num_layers is not None:
        raise MemplanError("activation offload is modelled without recompute: search it with --recompute none "
                           "(or leave --recompute out)")
    return dataclasses.replace(fixed, recompute=Recompute.NONE)


# --- memory of the whole space ------------------------------------------------------------------
MEMORY_FIELDS = ("device_bytes", "peak_bytes", "first_stage_peak_bytes", "last_stage_peak_bytes", "retained_bytes",
                 "host_bytes_per_node")
TIME_FIELDS = ("step_time_s", "mfu", "tokens_per_s")


@dataclass
class _Part:
    """Rows of the space evaluated together, `width` columns wide (the most ZeRO variants of their
    d's). Its direct rows are evaluated by `stage_memory` and `step_events`; a derived row (full
    recompute of 3 <= k <= n - 1 layers) takes the moments of its set's rows of k = 1 ("line") and
    k = 2 as value(1) + (k - 1) x slope."""

    rows: np.ndarray  # row numbers of the space, ascending
    width: int
    direct: np.ndarray  # row numbers evaluated directly
    src: np.ndarray  # per row: position in `direct` of itself, or of its k = 1 row when derived
    delta: np.ndarray  # per row: k - 1 when derived, else 0
    derived: np.ndarray  # per row
    line_of: np.ndarray  # per direct row: its line number when it is the k = 1 row of a set with derived rows, else -1
    lines: np.ndarray  # per line: position in `direct` of the rows of k = 1
    seconds: np.ndarray  # per line: position in `direct` of the rows of k = 2
    check: np.ndarray  # positions in `direct` of rows of k = n - 1 evaluated to check the shortcut (one per block)
    # filled by _part_memory (per stage: first, last)
    peaks: list[np.ndarray] = field(default_factory=list)  # direct rows x columns: the stage's step peak
    retained: list[np.ndarray] = field(default_factory=list)  # direct rows x columns: the stage's retained bytes
    moments: list[list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)  # per stage, per moment:
    # (value at k = 1, slope) of each line x columns
    retained_lines: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    limits: tuple[np.ndarray, ...] = ()  # per direct row x column: the range of delta that fits (lo, hi[, lo0, hi0])


# Relative costs of evaluating a part (measured on a 2-core machine): the calls themselves, and each
# element of the direct rows' memory (table: every moment on every element; separable: a few
# additions) and of every row's step time. The units (one d, p = 1 or not) are merged into one
# part, their rows padded to the widest, while that costs less than calling again.
PART_CALL_NS = 2_000_000
MEMORY_ELEMENT_NS = {"table": 250, "separable": 15}
TIME_ELEMENT_NS = 25
PART_ELEMENTS = 1 << 21  # rows x columns of a part: bounds the memory a part's arrays take


def _parts(space: PlanSpace, separable: bool) -> list[_Part]:
    """The rows in parts: those of one d always together, widest first (see PART_CALL_NS); rows of
    p = 1 apart from the others (their first stage is the last: one stage to evaluate)."""
    memory_ns = MEMORY_ELEMENT_NS["separable" if separable else "table"]
    alone = space.rows["p"] == 1
    unit_of = 2 * space.dix + alone
    units, unit_rows = np.unique(unit_of, return_counts=True)
    unit_width = space.zcount[units // 2]
    unit_direct = unit_rows - np.bincount(unit_of, weights=space.derivable, minlength=2 * len(space.zcount))[units]
    groups: list[list[int]] = []
    for kind in (1, 0):
        width = rows = 0
        start = len(groups)
        for u in np.argsort(-unit_width, kind="stable"):
            if units[u] % 2 != kind:
                continue
            w, r, dr = int(unit_width[u]), int(unit_rows[u]), float(unit_direct[u])
            padding_ns = (width - w) * (memory_ns * dr + TIME_ELEMENT_NS * r)
            if len(groups) > start and padding_ns < PART_CALL_NS and (rows + r) * width <= PART_ELEMENTS:
                groups[-1].append(int(units[u]))
                rows += r
            else:
                groups.append([int(units[u])])
                width, rows = w, r
    return [_make_part(space, np.flatnonzero(np.isin(unit_of, us)), int(space.zcount[np.array(us) // 2].max()),
                       collapse=True) for us in groups]


def _make_part(space: PlanSpace, rows: np.ndarray, width: int, collapse: bool) -> _Part:
    derived = space.derivable[rows].copy() if collapse else np.zeros(len(rows), dtype=bool)
    k, n = space.rows["k"][rows], space.chunk_layers[rows]
    # in each (t, p) block, one row of k = n - 1 (of the largest n) is evaluated directly as well, to
    # check the shortcut against
    last = np.flatnonzero(derived & (k == n - 1))
    last = last[np.lexsort((-n[last], space.block[rows[last]]))]
    pick = last[np.unique(space.block[rows[last]], return_index=True)[1]]
    derived[pick] = False
    check_rows = rows[pick]
    direct = rows[~derived]
    pos = np.full(space.row_count, -1, dtype=np.int64)
    pos[direct] = np.arange(len(direct), dtype=np.int64)
    k1 = space.k1_row[rows]
    src = np.where(derived, pos[np.maximum(k1, 0)], pos[rows])
    line_rows = np.unique(k1[derived], return_index=True)[0]  # (a plain np.unique imports numpy.ma)
    line_of = np.full(len(direct), -1, dtype=np.int64)
    line_of[pos[line_rows]] = np.arange(len(line_rows), dtype=np.int64)
    return _Part(rows, width, direct, src, np.where(derived, k - 1, 0), derived, line_of, pos[line_rows],
                 pos[line_rows + 1], pos[check_rows])


def _part_memory(part: _Part, space: PlanSpace, model: ModelSpec, training: TrainingSpec,
                 inventory: Inventory) -> bool:
    """Evaluate the part's direct rows: the step peak and the retained bytes of both stages (one
    when every row has p = 1: the first stage is the last), and every moment of the lines. False
    when the check of the affine shortcut fails."""
    single = bool(np.all(space.rows["p"][part.direct] == 1))
    moments = None
    if inventory.grad_lifetime == "buffer":
        moments = _separable_moments(part, space, model, training, inventory, single)
    if moments is None:
        moments = _cross_moments(part, space, model, training, inventory, single)
    part.peaks, part.retained, part.moments, part.retained_lines = [], [], [], []
    holds = True
    check = part.check
    if len(check):
        k1 = space.k1_row[part.direct[check]]
        one = np.searchsorted(part.direct, k1)
        two = np.searchsorted(part.direct, k1 + 1)
        steps = (space.rows["k"][part.direct[check]] - 1)[:, None]
    for events, retained in moments:
        lines = []
        for v in events + [retained]:
            if len(check) and holds:
                first = v.at(one)
                holds = np.array_equal(v.at(check), first + (v.at(two) - first) * steps)
            lines.append(v.line(part))
        part.moments.append(lines[:-1])
        part.retained_lines.append(lines[-1])
        part.peaks.append(_Values.peak(events))
        part.retained.append(retained.full())
    if single:  # the one stage is the first and the last
        part.peaks, part.retained = part.peaks * 2, part.retained * 2
        part.moments, part.retained_lines = part.moments * 2, part.retained_lines * 2
    return holds


class _Values:
    """A moment's bytes for a part's direct rows x columns: `full` (rows x columns) or, when
    separable, row values (rows x 1) + per-block column values gathered by the rows' blocks."""

    def __init__(self, full: Optional[np.ndarray] = None, rows: Optional[np.ndarray] = None,
                 blocks: Optional[np.ndarray] = None, block_of: Optional[np.ndarray] = None,
                 peak: Optional[np.ndarray] = None) -> None:
        self._full, self.rows, self.blocks, self.block_of, self._peak = full, rows, blocks, block_of, peak

    def at(self, index: np.ndarray) -> np.ndarray:
        if self._full is not None:
            return self._full[index]
        return self.rows[index] + self.blocks[self.block_of[index]]

    def full(self) -> np.ndarray:
        return self._full if self._full is not None else self.at(np.arange(len(self.rows)))

    def line(self, part: _Part) -> tuple[np.ndarray, np.ndarray]:
        """(value at k = 1, slope per layer) of each line (per block, the row values' difference)."""
        first = self.at(part.lines)
        if self._full is not None:
            return first, self._full[part.seconds] - first
        return first, self.rows[part.seconds] - self.rows[part.lines]

    @staticmethod
    def peak(events: list["_Values"]) -> np.ndarray:
        """The largest moment of each row and column. Separable moments with equal block values are
        combined first: max(a + d, b + d) = max(a, b) + d."""
        if events[0]._peak is not None:
            return events[0]._peak
        if events[0]._full is not None:
            out = events[0]._full
            for v in events[1:]:
                out = np.maximum(out, v._full)
            return out
        groups: list[tuple[np.ndarray, np.ndarray]] = []  # (block values, largest row values)
        for v in events:
            for i, (blocks, rows) in enumerate(groups):
                if np.array_equal(blocks, v.blocks):
                    groups[i] = (blocks, np.maximum(rows, v.rows))
                    break
            else:
                groups.append((v.blocks, v.rows))
        block_of = events[0].block_of
        out = None
        for blocks, rows in groups:
            x = rows + blocks[block_of]
            out = x if out is None else np.maximum(out, x)
        return out


def _stages(plans: PlanValues, single: bool) -> tuple[Any, int]:
    """The stages evaluated, as one argument: the first (= the last when every row has p = 1), or
    the first and the last (and with uneven stages the second: `candidate_stages`) stacked on a leading
    axis, so that one call evaluates them all."""
    if single:
        return 0, 1
    stages = candidate_stages(plans)
    return np.stack(np.broadcast_arrays(*stages)), len(stages)


def _by_stage(value: Any, count: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    """A result of a call with `_stages`, one array of `shape` per stage."""
    return list(np.broadcast_to(value, (count,) + shape))


def _cross_moments(part: _Part, space: PlanSpace, model: ModelSpec, training: TrainingSpec,
                   inventory: Inventory, single: bool) -> list[tuple[list[_Values], _Values]]:
    """Every moment for every direct row x column (`step_events` on the whole table)."""
    plans = space.plans2d(part.direct, part.width)
    shape = (len(part.direct), part.width)
    stage, count = _stages(plans, single)
    mem = stage_memory(model, inventory.terms, training, plans, stage, granularity=inventory.granularity,
                       layout=inventory.weight_layout)
    steps = step_events(model, inventory, training, plans, mem, stage, critical=True)
    events = list(zip(*(_by_stage(e.bytes, count, shape) for e in steps.events)))
    out = []
    for s, (peak, total) in enumerate(zip(_by_stage(steps.peak_bytes, count, shape),
                                         _by_stage(mem.total, count, shape))):
        values = [_Values(v) for v in events[s]]
        values[0]._peak = peak
        out.append((values, _Values(total)))
    return out


def _separable_moments(part: _Part, space: PlanSpace, model: ModelSpec, training: TrainingSpec,
                       inventory: Inventory, single: bool) -> Optional[list[tuple[list[_Values], _Values]]]:
    """With a gradient buffer, the ZeRO variant changes a moment's bytes only through the states
    (weights, gradients, optimizer and its temporaries), which depend on t, p and the variant, not
    on the rest of the row: bytes(row, variant) = bytes(row, column 0) + [bytes(r, variant) -
    bytes(r, column 0)] for any row r of the same (t, p) block. So `step_events` runs on the rows
    with column 0, and on one row per block with every column; three more rows per block (spread
    over its micro-batches, chunks and recompute modes), evaluated with every column too, check the
    split (None when it does not hold: evaluate the whole table)."""
    blocks, block_of = np.unique(space.block[part.direct], return_inverse=True)
    # rows are numbered block by block, so each block's direct rows are consecutive
    r0 = np.searchsorted(block_of, np.arange(len(blocks)), side="left")
    r1 = np.searchsorted(block_of, np.arange(len(blocks)), side="right") - 1
    checks = np.concatenate([r0 + (r1 - r0) * i // 3 for i in (1, 2, 3)])
    nb = len(blocks)
    rows = space.plans2d(part.direct, 1)
    probe = space.plans2d(part.direct[np.concatenate((r0, checks))], part.width)
    results = []
    for plans in (rows, probe):
        stage, count = _stages(plans, single)
        mem = stage_memory(model, inventory.terms, training, plans, stage, granularity=inventory.granularity,
                           layout=inventory.weight_layout)
        steps = step_events(model, inventory, training, plans, mem, stage, critical=True)
        results.append([e.bytes for e in steps.events] + [mem.total])
    if len(results[0]) != len(results[1]):
        return None
    out: list[list[_Values]] = [[] for _ in range(count)]
    for x, y in zip(*results):
        xs = _by_stage(x, count, (len(part.direct), 1))
        ys = _by_stage(y, count, (4 * nb, part.width))
        for s in range(count):
            step = ys[s][:nb] - ys[s][:nb, :1]
            if not (np.array_equal(ys[s][:nb, :1], xs[s][r0])
                    and np.array_equal(ys[s][nb:], xs[s][checks] + np.tile(step, (3, 1)))):
                return None
            out[s].append(_Values(rows=xs[s], blocks=step, block_of=block_of))
    return [(values[:-1], values[-1]) for values in out]


def _memory_ready(part: _Part, space: PlanSpace, model: ModelSpec, training: TrainingSpec,
                  inventory: Inventory) -> _Part:
    """The part with its memory evaluated (every row directly where the check of the shortcut fails)."""
    if not _part_memory(part, space, model, training, inventory):
        part = _make_part(space, part.rows, part.width, collapse=False)
        _part_memory(part, space, model, training, inventory)
    return part


def _peak_limits(rows: PlanValues, inventory: Inventory, gpu: Optional[GpuSpec], margin: Optional[float],
                 budget_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row (its t, p and d): the lowest step peak whose device memory is positive and the highest
    whose device memory is within the budget (-1 if none): the two ends of `_fits`, found by
    bisection on `device_memory`, which grows with the peak."""

    def device(peak: np.ndarray) -> np.ndarray:
        return np.asarray(device_memory(peak, rows, inventory, gpu, margin).total, dtype=np.int64) + 0 * peak

    shape = np.shape(rows.t)
    limit = np.int64(1 << 62)
    lo = np.full(shape, -1, dtype=np.int64)  # device(lo) <= budget, or -1
    hi = np.full(shape, max(int(budget_bytes), 1), dtype=np.int64)  # device(hi) > budget, once widened
    while True:
        low = device(hi) <= budget_bytes
        if not low.any():
            break
        if np.any(low & (hi >= limit)):
            raise MemplanError("the budget is beyond the search's 64-bit arithmetic")
        lo, hi = np.where(low, hi, lo), np.where(low, np.minimum(hi * 2, limit), hi)
    highest, _ = _bisect(lambda x: device(x) <= budget_bytes, lo, hi)
    positive_at_zero = device(np.zeros(shape, dtype=np.int64)) > 0
    _, lowest = _bisect(lambda x: device(x) <= 0, np.full(shape, -1, dtype=np.int64),
                        np.where(positive_at_zero, 0, limit))
    return lowest, highest


def _bisect(low: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Narrow lo < hi (low(lo) true or lo = -1; low(hi) false) to hi = lo + 1."""
    while np.any(hi - lo > 1):
        mid = lo + (hi - lo) // 2
        ok = low(mid)
        wide = hi - lo > 1
        lo, hi = np.where(wide & ok, mid, lo), np.where(wide & ~ok, mid, hi)
    return lo, hi


def _delta_range(lines: list[tuple[np.ndarray, np.ndarray]], limit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each line and column, the delta >= 0 for which every moment, value + slope x delta, is at
    most `limit` (per line): [lo, hi], empty when lo > hi."""
    shape = np.broadcast_shapes(lines[0][0].shape, limit.shape)
    lo = np.zeros(shape, dtype=np.int64)
    hi = np.full(shape, np.iinfo(np.int64).max, dtype=np.int64)
    for value, slope in lines:
        room = limit - value
        up, down = slope > 0, slope < 0
        safe = np.where(up | down, slope, 1)
        hi = np.where(up, np.minimum(hi, room // safe), hi)
        lo = np.where(down, np.maximum(lo, -((-room) // safe)), lo)
        hi = np.where((room < 0) & ~up & ~down, -1, hi)
    return lo, hi


def _block_limits(space: PlanSpace, inventory: Inventory, gpu: Optional[GpuSpec], margin: Optional[float],
                  budget_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """`_peak_limits` of every (t, p) block of the space."""
    return _peak_limits(space.row_plans(space.block_row), inventory, gpu, margin, budget_bytes)


def _part_limits(part: _Part, space: PlanSpace, limits: tuple[np.ndarray, np.ndarray]) -> None:
    """Per direct row and column, the range of delta that fits: [0, max] or empty for a row on its
    own, the interval of its derived rows for a line."""
    block = space.block[part.direct]
    lowest, highest = limits[0][block], limits[1][block]
    peak = functools.reduce(np.maximum, part.peaks)
    fits = (peak <= highest[:, None]) & (peak >= lowest[:, None])
    lo = np.zeros(peak.shape, dtype=np.int64)
    hi = np.where(fits, np.iinfo(np.int64).max, -1)
    lines = [line for i, moments in enumerate(part.moments) if all(moments is not m for m in part.moments[:i])
             for line in moments]
    if len(part.lines):
        lo[part.lines], hi[part.lines] = _delta_range(lines, highest[part.lines][:, None])
    part.limits = (lo, hi)
    if len(part.lines) and np.any(lowest[part.lines] > 0):  # peaks too small for a positive device figure
        lo0 = np.ones(peak.shape, dtype=np.int64)
        hi0 = np.zeros(peak.shape, dtype=np.int64)
        lo0[part.lines], hi0[part.lines] = _delta_range(lines, (lowest[part.lines] - 1)[:, None])
        part.limits += (lo0, hi0)


def _fit_mask(part: _Part, at: Any, valid: np.ndarray) -> np.ndarray:
    """Which plans of the part's rows `at` fit."""
    src, delta = part.src[at], part.delta[at][:, None]
    lo, hi = part.limits[0][src], part.limits[1][src]
    fits = valid & (delta >= lo) & (delta <= hi)
    if len(part.limits) > 2:
        fits &= ~((delta >= part.limits[2][src]) & (delta <= part.limits[3][src]))
    return fits


def _expand(part: _Part, at: Any) -> tuple[list[np.ndarray], np.ndarray]:
    """Step peak of each stage evaluated (the first, the last[, the second]: `_stages`), and the retained bytes,
    of the part's rows `at`."""
    src = part.src[at]
    peaks = [p[src] for p in part.peaks]
    retained = functools.reduce(np.maximum, (r[src] for r in part.retained))
    which = np.flatnonzero(part.derived[at])
    if len(which):
        line = part.line_of[src[which]]
        delta = part.delta[at][which][:, None]
        peaks = [p.copy() for p in peaks]
        for out, moments in zip(peaks, part.moments):
            peak = None
            for value, slope in moments:
                x = value[line] + slope[line] * delta
                peak = x if peak is None else np.maximum(peak, x)
            out[which] = peak
        retained = retained.copy()
        retained[which] = functools.reduce(np.maximum, (value[line] + slope[line] * delta
                                                         for value, slope in part.retained_lines))
    return peaks, retained


def _row_slices(part: _Part, chunk: int) -> Iterator[slice]:
    """Consecutive rows of the part with at most `chunk` elements (at least one row)."""
    step = max(1, chunk // max(part.width, 1))
    for lo in range(0, len(part.rows), step):
        yield slice(lo, min(lo + step, len(part.rows)))


# --- search -----------------------------------------------------------------------------------
def plan_config(model: ModelSpec, training: TrainingSpec, plans: PlanValues, i: int, global_batch: int) -> Config:
    """One candidate as a Config, for `estimate`, reports and launch flags."""
    x = plans.take(i)
    L, p = model.num_layers, int(x.p)
    uneven = x.first_layers is not None and (int(x.first_layers) * p != L or int(x.last_layers) * p != L)
    stages = (int(x.first_layers), int(x.last_layers), (L - int(x.first_layers) - int(x.last_layers)) // max(p - 2, 1)
              ) if uneven else (L // p,)
    n = max(stages) // int(x.m)
    rec = Recompute(int(x.recompute))
    split = dict(first_stage_layers=int(x.first_layers), last_stage_layers=int(x.last_layers)) if uneven else {}
    return Config(
        model=model,
        parallel=ParallelSpec(tp=int(x.t), pp=int(x.p), dp=int(x.d), vpp=int(x.m), sp=bool(x.sp), zero=int(x.zero),
                              zero_shard=int(x.shard) if x.shard < x.d else None, cp=int(x.cp),
                              cp_comm_type=x.cp_comm, ep=int(x.ep),
                              etp=int(x.expert_tp) if model.is_moe and int(x.expert_tp) != int(x.t) else None, **split),
        training=training.model_copy(update=dict(
            micro_batch=int(x.b), global_batch=global_batch, recompute=rec,
            recompute_num_layers=(int(x.recomputed_layers) if rec == Recompute.FULL and x.recomputed_layers < n else None),
        )),
    )


@dataclass
class SearchResult:
    model: ModelSpec
    gpus: int
    global_batch: int
    budget_bytes: int
    gpu: Optional[GpuSpec]
    candidates: int
    feasible: int
    seconds: float
    top: list[int]  # indices of the best feasible plans, fastest first
    nearest_miss: Optional[int]  # the least memory of all plans, when none fits
    fastest_miss: Optional[int]  # the fastest plan over the budget (if faster than the best fit)
    evaluated: Any  # Evaluated or LazyEvaluated: every plan's numbers
    training: TrainingSpec
    impl: str = "megatron"
    notes: list[str] = field(default_factory=list)
    max_seq_len: Optional[int] = None  # search --max-seq: the longest s some plan fits with
    space: Optional[PlanSpace] = None
    margin: Optional[float] = None
    exact: dict[int, dict[str, Any]] = field(default_factory=dict)  # plan number -> its `evaluate` numbers
    sort: str = "time"  # the listing's order (`arrange`): "time" (the search's ranking) or "memory"
    folded: bool = False  # whether `arrange` folded the listing's variants
    listing: Optional[list["Listed"]] = None  # set by `arrange`; else the plans of `top`, nothing folded
    distinct_fit: Optional[int] = None  # with `folded`: the rows that fit once variants are folded
    host_budget_bytes: Optional[int] = None  # host memory per node the plans' offload must fit in (--host-mem)

    def listed(self) -> list["Listed"]:
        """The plans to show, best first, each with the plans folded into it."""
        return self.listing if self.listing is not None else [Listed(i) for i in self.top]

    def config(self, i: int) -> Config:
        plans = self.space.take([i]) if self.space is not None else self.evaluated.plans.take([i])
        return plan_config(self.model, self.training, plans, 0, self.global_batch)

    def numbers(self, i: int) -> dict[str, Any]:
        """Plan i's memory and time fields, from `evaluate` on that plan (kept for the plans shown)."""
        if i not in self.exact:
            self.exact.update(self._evaluate_plans([i]))
        return self.exact[i]

    def _evaluate_plans(self, index: list[int]) -> dict[int, dict[str, Any]]:
        if self.space is None:
            e = self.evaluated
            return {i: {name: getattr(e, name)[i] if getattr(e, name) is not None else None
                        for name in MEMORY_FIELDS + TIME_FIELDS} for i in index}
        e = evaluate(self.model, self.training, self.space.take(index), self.gpu, self.global_batch, self.impl,
                     self.margin)
        return {i: {name: getattr(e, name)[j] if getattr(e, name) is not None else None
                    for name in MEMORY_FIELDS + TIME_FIELDS} for j, i in enumerate(index)}

    def row(self, i: int) -> dict[str, Any]:
        e = self.numbers(i)
        out = {
            **self.config(i).plan_summary(),
            "memory": {"device_bytes": int(e["device_bytes"]), "peak_bytes": int(e["peak_bytes"]),
                       "first_stage_peak_bytes": int(e["first_stage_peak_bytes"]),
                       "last_stage_peak_bytes": int(e["last_stage_peak_bytes"]),
                       "retained_bytes": int(e["retained_bytes"]),
                       "host_bytes_per_node": int(e["host_bytes_per_node"])},
        }
        if e["step_time_s"] is not None:
            out.update(step_time_s=float(e["step_time_s"]), mfu=float(e["mfu"]),
                       tokens_per_s=float(e["tokens_per_s"]))
        return out


def search(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
           gpu: Optional[GpuSpec] = None, fixed: Fixed = Fixed(), max_tp: Optional[int] = None, top: int = 10,
           chunk: int = 1 << 18, progress: Optional[Callable[[int, int], None]] = None,
           impl: str = "megatron", margin: Optional[float] = None, reference: bool = False,
           host_budget_bytes: Optional[int] = None) -> SearchResult:
    """Evaluate every plan (reporting progress), filter by the budget, rank by step time (by memory
    when no GPU is known): the `top` fastest plans that fit, fastest first (ties: less memory, then
    the lower plan number), the fastest plan over the budget when it is faster than the best, and
    the plan that needs the least memory when none fits. See the module docstring for how; with
    `reference`, every plan is evaluated as flat arrays in chunks (slower, the same result). With
    `host_budget_bytes`, a plan fits only when its offload's host memory per node is within it too."""
    fixed = _training_fixed(model, training, fixed)
    check_fp8(training.fp8, impl, 0, gpu)
    if reference:
        return _search_reference(model, training, gpus, global_batch, budget_bytes, gpu, fixed, max_tp, top, chunk,
                                 progress, impl, margin, host_budget_bytes)
    start = time.perf_counter()
    space = plan_space(model, gpus, global_batch, fixed, _tp_limit(max_tp, gpu), impl)
    check_int64(model, training, space.max_micro_batch, impl)
    inventory = training_inventory(model, impl, "cuda", training)
    limits = _block_limits(space, inventory, gpu, margin, budget_bytes)
    best, miss = _Best(top), _Best(1)
    feasible = done = 0
    parts: list[_Part] = []
    times: list[tuple[np.ndarray, np.ndarray]] = []  # (plan numbers, step times) of each block of rows
    for part in _parts(space, inventory.grad_lifetime == "buffer"):
        part = _memory_ready(part, space, model, training, inventory)
        _part_limits(part, space, limits)
        for sel in _row_slices(part, chunk):
            rows = part.rows[sel]
            numbers = space.numbers(rows, part.width)
            valid = numbers >= 0
            fits = _fit_mask(part, sel, valid)
            plans = space.plans2d(rows, part.width)
            if host_budget_bytes is not None:
                fits &= host_per_node(model, training, inventory, gpu, plans, fits) <= host_budget_bytes
            if gpu is not None:
                key = step_time(model, training, gpu, plans, global_batch, breakdown=False, impl=impl).step_time_s
                times.append((numbers, key))
            else:
                peaks, _ = _expand(part, sel)
                key = device_memory(functools.reduce(np.maximum, peaks), plans, inventory, gpu, margin).total
            feasible += int(np.count_nonzero(fits))
            best.offer(key, numbers, fits)
            miss.offer(key, numbers, valid & ~fits)
            done += int(np.count_nonzero(valid))
            if progress is not None:
                progress(done, space.count)
        part.limits = ()
        parts.append(part)
    result = SearchResult(model, gpus, global_batch, budget_bytes, gpu, space.count, feasible, 0.0, [], None, None,
                          None, training, impl, space=space, margin=margin, host_budget_bytes=host_budget_bytes)
    found = _Found(space, parts, model, training, inventory, gpu, global_batch, margin, impl)
    # ties of the key go to the plan that needs less memory, then to the lower plan number
    result.exact.update(found.numbers(best.numbers() + miss.numbers()))
    device = {i: int(v["device_bytes"]) for i, v in result.exact.items()}
    result.top = best.ranked(device)[:max(top, 0)]
    over = miss.ranked(device)
    if over and (not result.top or miss.key_of(over[0]) < best.key_of(result.top[0])):
        result.fastest_miss = over[0]
    if not result.top:
        result.nearest_miss = found.least_memory(chunk)
        result.exact.update(found.numbers([result.nearest_miss]))
    result.evaluated = LazyEvaluated(functools.partial(found.evaluated, times, chunk))
    result.seconds = time.perf_counter() - start
    return result


class _Best:
    """The `size` smallest keys offered (with every plan tied with the last of them), by plan number."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.keys = np.zeros(0)
        self.index = np.zeros(0, dtype=np.int64)

    def offer(self, key: np.ndarray, numbers: np.ndarray, mask: np.ndarray) -> None:
        if self.size <= 0:
            return
        k = key[mask]
        if not k.size:
            return
        if k.size > self.size:
            pick = mask & (key <= np.partition(k, self.size - 1)[self.size - 1])
            k, i = key[pick], numbers[pick]
        else:
            i = numbers[mask]
        keys = np.concatenate((self.keys, k)) if self.keys.size else k
        index = np.concatenate((self.index, i)) if self.index.size else i
        if keys.size > self.size:
            keep = keys <= np.partition(keys, self.size - 1)[self.size - 1]
            keys, index = keys[keep], index[keep]
        self.keys, self.index = keys, index

    def numbers(self) -> list[int]:
        return [int(i) for i in self.index]

    def key_of(self, i: int) -> Any:
        return self.keys[int(np.flatnonzero(self.index == i)[0])]

    def ranked(self, device: dict[int, int]) -> list[int]:
        """The plans in the order of (key, device memory, plan number)."""
        if not self.index.size:
            return []
        dev = np.array([device[int(i)] for i in self.index], dtype=np.int64)
        return [int(self.index[j]) for j in np.lexsort((self.index, dev, self.keys))]


@dataclass
class _Found:
    """What a search evaluated, for the numbers of single plans and of all of them afterwards."""

    space: PlanSpace
    parts: list[_Part]
    model: ModelSpec
    training: TrainingSpec
    inventory: Inventory
    gpu: Optional[GpuSpec]
    global_batch: int
    margin: Optional[float]
    impl: str

    def memory(self, part: _Part, at: Any, plans: PlanValues) -> dict[str, np.ndarray]:
        peaks, retained = _expand(part, at)
        first, last, peak = peaks[0], peaks[1], functools.reduce(np.maximum, peaks)
        device = device_memory(peak, plans, self.inventory, self.gpu, self.margin).total
        host = host_per_node(self.model, self.training, self.inventory, self.gpu, plans, device)
        return dict(zip(MEMORY_FIELDS, (device, peak, first, last, retained, host)))

    def numbers(self, index: list[int]) -> dict[int, dict[str, Any]]:
        """Memory and time fields of the plans `index` (as `evaluate` gives them)."""
        index = sorted(set(int(i) for i in index))
        if not index:
            return {}
        row, col = self.space.locate(index)
        plans = self.space.take(index)
        out: dict[str, np.ndarray] = {f: np.zeros(len(index), dtype=np.int64) for f in MEMORY_FIELDS}
        for part in self.parts:
            which = np.flatnonzero(np.isin(row, part.rows))
            if not len(which):
                continue
            at = np.searchsorted(part.rows, row[which])
            values = self.memory(part, at, self.space.plans2d(row[which], part.width))
            for f, v in values.items():
                out[f][which] = np.broadcast_to(v, (len(which), part.width))[np.arange(len(which)), col[which]]
        times: dict[str, Any] = dict.fromkeys(TIME_FIELDS)
        if self.gpu is not None:
            perf = step_time(self.model, self.training, self.gpu, plans, self.global_batch, breakdown=False,
                             impl=self.impl)
            times = {f: getattr(perf, f) for f in TIME_FIELDS}
        return {i: {**{f: out[f][j] for f in MEMORY_FIELDS},
                    **{f: (None if v is None else v[j]) for f, v in times.items()}} for j, i in enumerate(index)}

    def least_memory(self, chunk: int) -> int:
        """The plan whose device memory is the least (the lowest plan number among equals)."""
        least = _Best(1)
        for part in self.parts:
            for sel in _row_slices(part, chunk):
                rows = part.rows[sel]
                numbers = self.space.numbers(rows, part.width)
                device = self.memory(part, sel, self.space.plans2d(rows, part.width))["device_bytes"]
                least.offer(device, numbers, numbers >= 0)
        return int(least.index[least.keys == least.keys.min()].min())

    def evaluated(self, times: list[tuple[np.ndarray, np.ndarray]], chunk: int, name: str) -> Any:
        """A field of `SearchResult.evaluated`, for every plan in plan-number order."""
        n = self.space.count
        if name == "plans":
            return self.space.flat()
        if name in TIME_FIELDS and self.gpu is None:
            return None
        if name == "step_time_s":
            out = np.empty(n, dtype=times[0][1].dtype)
            for numbers, key in times:
                valid = numbers >= 0
                out[numbers[valid]] = key[valid]
            return out
        arrays: dict[str, np.ndarray] = {}
        for part in self.parts:
            for sel in _row_slices(part, chunk):
                rows = part.rows[sel]
                numbers = self.space.numbers(rows, part.width)
                valid = numbers >= 0
                plans = self.space.plans2d(rows, part.width)
                if name in TIME_FIELDS:
                    perf = step_time(self.model, self.training, self.gpu, plans, self.global_batch, breakdown=False,
                                     impl=self.impl)
                    values = {f: getattr(perf, f) for f in TIME_FIELDS if f != "step_time_s"}
                else:
                    values = self.memory(part, sel, plans)
                for f, v in values.items():
                    if f not in arrays:
                        arrays[f] = np.empty(n, dtype=v.dtype)
                    arrays[f][numbers[valid]] = np.broadcast_to(v, numbers.shape)[valid]
        return arrays[name]


class LazyEvaluated:
    """`Evaluated` for every plan of a search, each field computed on first use from what the
    search kept (step times: a scatter into plan order; memory: the kept moments expanded), for
    plots and tests: the search itself does not need them."""

    def __init__(self, fill: Callable[[str], Any]) -> None:
        self._fill = fill

    def __getattr__(self, name: str) -> Any:
        if name not in {f.name for f in fields(Evaluated)}:
            raise AttributeError(name)
        value = self._fill(name)
        setattr(self, name, value)
        return value


def _search_reference(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
                      gpu: Optional[GpuSpec], fixed: Fixed, max_tp: Optional[int], top: int, chunk: int,
                      progress: Optional[Callable[[int, int], None]], impl: str,
                      margin: Optional[float], host_budget_bytes: Optional[int] = None) -> SearchResult:
    """Every plan as flat arrays, evaluated in chunks, sorted: the oracle of `search`."""
    start = time.perf_counter()
    plans = enumerate_plans(model, gpus, global_batch, fixed, _tp_limit(max_tp, gpu), impl)
    check_int64(model, training, int(plans.b.max()), impl)
    n = len(plans.t)
    parts = []
    for lo in range(0, n, chunk):
        parts.append(evaluate(model, training, plans.take(slice(lo, lo + chunk)), gpu, global_batch, impl, margin))
        if progress is not None:
            progress(min(lo + chunk, n), n)
    evaluated = parts[0] if len(parts) == 1 else _concat(plans, parts)
    fits = _fits(evaluated, budget_bytes, host_budget_bytes)
    key = evaluated.step_time_s if evaluated.step_time_s is not None else evaluated.device_bytes
    order = np.lexsort((evaluated.device_bytes, key))
    ranked = order[fits[order]]
    best = [int(i) for i in ranked[:top]]
    nearest = None if best else int(np.argmin(evaluated.device_bytes))
    fastest_miss = None
    over = order[~fits[order]]
    if len(over) and (not best or key[over[0]] < key[best[0]]):
        fastest_miss = int(over[0])
    return SearchResult(model, gpus, global_batch, budget_bytes, gpu, n, int(fits.sum()),
                        time.perf_counter() - start, best, nearest, fastest_miss, evaluated, training, impl,
                        margin=margin, host_budget_bytes=host_budget_bytes)


def _tp_limit(max_tp: Optional[int], gpu: Optional[GpuSpec]) -> int:
    """The largest t searched: --max-tp, else the GPUs of a node."""
    return max_tp if max_tp is not None else (gpu.gpus_per_node if gpu is not None else 8)


def _fits(evaluated: Any, budget_bytes: int, host_budget_bytes: Optional[int] = None) -> np.ndarray:
    """The plans whose device memory is within the budget (never a non-positive figure) and, with a host
    budget, whose offload's host memory per node is within that."""
    device = np.asarray(evaluated.device_bytes)
    fits = (device <= budget_bytes) & (device > 0)
    if host_budget_bytes is not None:
        fits &= np.asarray(evaluated.host_bytes_per_node) <= host_budget_bytes
    return fits


INT64_SAFE = 1 << 53  # bytes per GPU the vectorised int64 arithmetic holds with room for its products


def check_int64(model: ModelSpec, training: TrainingSpec, max_micro_batch: int, impl: str) -> None:
    """Refuse a space whose memory the planner's int64 arrays cannot hold (they would wrap around
    to negative bytes that "fit"). Every candidate needs at most twice what one GPU holding the
    whole model with the largest micro-batch needs (pipelines keep at most L layers' worth in
    flight, 1 + (p - 1)/(pm) < 2 with interleaving): that bound is computed in Python integers."""
    one_gpu = Config(model=model, training=training.model_copy(update=dict(
        micro_batch=max_micro_batch, global_batch=max_micro_batch, recompute=Recompute.NONE,
        recompute_num_layers=None, mst=1)))  # MsT off: it needs recompute, and only lowers the bound
    need = 2 * device_bytes(one_gpu, impl)
    if need > INT64_SAFE:
        raise MemplanError(f"{model.name} at s={model.seq_length:,}, v={model.vocab_size:,}: up to {need:.2e} bytes per "
                           f"GPU, beyond what the search's 64-bit arithmetic holds ({INT64_SAFE:.1e}); use estimate "
                           "for one plan, or smaller sizes")


def any_fits(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
             gpu: Optional[GpuSpec] = None, fixed: Fixed = Fixed(), max_tp: Optional[int] = None,
             impl: str = "megatron", margin: Optional[float] = None, chunk: int = 1 << 18,
             host_budget_bytes: Optional[int] = None) -> bool:
    """Whether some plan fits (memory only; False when no plan divides the GPUs or the sizes are
    beyond the int64 arithmetic, which fits no budget)."""
    try:
        fixed = _training_fixed(model, training, fixed)
        space = plan_space(model, gpus, global_batch, fixed, _tp_limit(max_tp, gpu), impl)
        check_int64(model, training, space.max_micro_batch, impl)
    except MemplanError:
        return False
    inventory = training_inventory(model, impl, "cuda", training)
    limits = _block_limits(space, inventory, gpu, margin, budget_bytes)
    for part in _parts(space, inventory.grad_lifetime == "buffer"):
        part = _memory_ready(part, space, model, training, inventory)
        _part_limits(part, space, limits)
        for sel in _row_slices(part, chunk):
            fits = _fit_mask(part, sel, space.numbers(part.rows[sel], part.width) >= 0)
            if host_budget_bytes is not None and np.any(fits):
                plans = space.plans2d(part.rows[sel], part.width)
                fits &= host_per_node(model, training, inventory, gpu, plans, fits) <= host_budget_bytes
            if np.any(fits):
                return True
    return False


def search_max_seq(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
                   step: int = 128, **kwargs: Any) -> SearchResult:
    """The longest sequence (a multiple of `step`) that some plan fits with, and `search` at that
    length: the plans that fit there, fastest first. Memory grows with s for every plan, so the
    question "does any plan fit?" is monotone in s and a bisection answers it."""
    options = {k: kwargs[k] for k in ("gpu", "fixed", "max_tp", "impl", "margin", "chunk", "host_budget_bytes")
               if k in kwargs}

    def fits_at(s: int) -> bool:
        return any_fits(model.model_copy(update={"seq_length": s}), training, gpus, global_batch, budget_bytes,
                        **options)

    longest = largest(fits_at, step, SEQ_LIMIT)
    if longest is None:
        raise MemplanError(f"no plan of {model.name} fits in {budget_bytes:,} bytes per GPU even at s = {step}")
    result = search(model.model_copy(update={"seq_length": longest}), training, gpus, global_batch, budget_bytes,
                    **kwargs)
    result.notes.append(f"the longest sequence any plan fits with: s = {longest:,} tokens (searched in multiples "
                        f"of {step}, global batch {global_batch} sequences); the plans below fit at that length")
    result.max_seq_len = longest
    return result


def _concat(plans: PlanValues, parts: list[Evaluated]) -> Evaluated:
    def cat(name: str) -> Any:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else np.concatenate(values)

    return Evaluated(plans, *(cat(f.name) for f in fields(Evaluated) if f.name != "plans"))


def fixed_from(parallel: dict[str, Any], training: dict[str, Any]) -> Fixed:
    """The pinned dimensions from option values (None = search it)."""
    rec = training.get("recompute")
    return Fixed(
        tp=parallel.get("tp"), pp=parallel.get("pp"), dp=parallel.get("dp"), vpp=parallel.get("vpp"),
        sp=parallel.get("sp"), zero=parallel.get("zero"), zero_shard=parallel.get("zero_shard"),
        cp=parallel.get("cp"), ep=parallel.get("ep"), etp=parallel.get("etp"),
        cp_comm_type=parallel.get("cp_comm_type") or "p2p",
        micro_batch=training.get("micro_batch"),
        recompute=Recompute.parse(rec) if rec is not None else None,
        recompute_num_layers=training.get("recompute_num_layers"),
        first_stage_layers=parallel.get("first_stage_layers"), last_stage_layers=parallel.get("last_stage_layers"),
        uneven=bool(parallel.get("uneven")),
    )


@dataclass(frozen=True)
class Skipped:
    """A preset `search_presets` could not search, and why (the search's own error)."""

    model: str
    gpu: Optional[str]
    reason: str


def search_presets(requests: list[tuple[ModelSpec, TrainingSpec, int, Optional[GpuSpec], int]], gpus: int,
                   max_seq: bool = False, progress: Optional[Callable[..., None]] = None,
                   **kwargs: Any) -> tuple[list[SearchResult], list[Skipped]]:
    """`search` (`search_max_seq` with `max_seq`) for several models, the "what can I train on this
    machine?" question: each request is (model, training, global batch, GPU, budget), so that each
    model is timed on its own GPU. A model the search refuses (no plan divides the GPUs, sizes
    beyond the int64 arithmetic, nothing fits at any sequence length) is returned in the skipped
    list with the search's reason. `progress` is called as progress(done, total, label=...), the
    label naming the model and its GPU."""
    results, skipped = [], []
    for model, training, global_batch, gpu, budget_bytes in requests:
        label = model.name + (f" on {gpu.name}" if gpu is not None else "")
        report = functools.partial(progress, label=label) if progress is not None else None
        run = search_max_seq if max_seq else search
        try:
            results.append(run(model, training, gpus, global_batch, budget_bytes, gpu=gpu, progress=report, **kwargs))
        except MemplanError as err:
            skipped.append(Skipped(model.name, gpu.name if gpu is not None else None, str(err)))
    if not results:
        raise MemplanError(f"no preset could be searched on {gpus} GPUs; the first, {skipped[0].model}: "
                           f"{skipped[0].reason}")
    return results, skipped


# --- the listing: order and fold ----------------------------------------------------------------
SORTS = ("time", "memory")
FOLDING_RULE = """\
Folding: a row is a plan (t, p, d, b, m, SP, recompute) shown with the
best-ranked of its ZeRO variants that fit. Folded into the row are
  +n ZeRO  the same plan with another ZeRO stage or shard group (ZeRO 1 =
           the distributed optimizer, 2/8 = sharded over groups of 8)
           that fits and ranks lower (and is not folded as below);
  +n rec   plans that differ from one of the row's plans only in the
           recompute choice (none, selective, full on k layers) and are
           no faster and need no less device memory, both exactly as
           estimated: nothing to gain from them (only with step times).
Every other difference makes a row of its own."""


@dataclass(frozen=True)
class Listed:
    """A row of a search's listing: a plan and the plans that fit folded into it (`FOLDING_RULE`),
    each list in the listing's order."""

    plan: int
    zero_variants: tuple[int, ...] = ()
    recompute_variants: tuple[int, ...] = ()


def arrange(result: SearchResult, sort: str = "time", fold: bool = True, top: int = 10) -> SearchResult:
    """Order the plans that fit (`sort` "time": by step time, then device memory, then plan number,
    the search's own ranking; "memory": by device memory, then step time, then plan number), fold
    their variants into rows (`FOLDING_RULE`) unless `fold` is False, and keep the first `top` rows:
    `result.listing`, with `result.top` its plans. Without step times both orders are by memory.
    Reads every plan's numbers (`result.evaluated`) unless the search's own top list is asked for."""
    if sort not in SORTS:
        raise MemplanError(f"sort must be one of {', '.join(SORTS)} (got {sort!r})")
    start = time.perf_counter()
    result.sort, result.folded = sort if result.gpu is not None else "memory", fold
    if not fold and (sort == "time" or result.gpu is None) and len(result.top) >= min(top, result.feasible):
        result.top = result.top[:max(top, 0)]
        result.listing = [Listed(i) for i in result.top]
        return result
    e = result.evaluated
    device = np.asarray(e.device_bytes)
    idx = np.flatnonzero(_fits(e, result.budget_bytes, result.host_budget_bytes))
    dev = device[idx]
    step = None if e.step_time_s is None else np.asarray(e.step_time_s)[idx]
    by_time = None if step is None else np.lexsort((idx, dev, step))
    if step is None:
        order = np.lexsort((idx, dev))
    else:
        order = by_time if sort == "time" else np.lexsort((idx, step, dev))
    if not fold:
        listing = [Listed(int(idx[j])) for j in order[:max(top, 0)]]
    else:
        listing, result.distinct_fit = _fold(result, idx, dev, by_time, order, top)
    result.listing = listing
    result.top = [x.plan for x in listing]
    missing = [i for i in result.top if i not in result.exact]
    if missing:  # the rows' numbers, as `evaluate` gives them, in one call
        result.exact.update(result._evaluate_plans(missing))
    result.seconds += time.perf_counter() - start
    return result


def _fold(result: SearchResult, idx: np.ndarray, dev: np.ndarray, by_time: Optional[np.ndarray],
          order: np.ndarray, top: int) -> tuple[list[Listed], int]:
    """The first `top` rows of `FOLDING_RULE` over the plans `idx` that fit (device memory `dev`;
    positions in idx in the order of (time, memory, number) `by_time`, None without step times, and
    in the listing's `order`), and how many rows there are."""
    n = len(idx)
    if not n:
        return [], 0
    row, sib = _variant_keys(result, idx)
    dominator = np.arange(n)  # per plan: itself, or the kept plan it is folded into as a recompute variant
    if by_time is not None:
        # Recompute siblings (the same plan and ZeRO variant) in the order of (time, memory, number):
        # a plan is dominated when an earlier sibling needs no more memory, and folds into the earliest
        # of the least memory before it (which no earlier sibling dominates). r ranks by (memory,
        # position in o); a running minimum of r per set finds it: subtracting set x n makes every
        # earlier set's values larger.
        o = by_time[np.argsort(sib[by_time], kind="stable")]
        s_o = sib[o]
        seg = np.cumsum(np.concatenate(([0], s_o[1:] != s_o[:-1])))
        by_memory = o[np.argsort(dev[o], kind="stable")]
        r = np.empty(n, dtype=np.int64)
        r[by_memory] = np.arange(n)
        least = np.minimum.accumulate(r[o] - seg * n) + seg * n
        dominator[o] = by_memory[least]
    kept = dominator == np.arange(n)
    family = row[dominator]
    ranked_kept = order[kept[order]]
    _, first = np.unique(row[ranked_kept], return_index=True)  # (return_index: no numpy.ma import)
    shown = ranked_kept[np.sort(first)][:max(top, 0)]  # each row's best kept plan, in listing order
    by_family = order[np.argsort(family[order], kind="stable")]  # each family together, in listing order
    sorted_family = family[by_family]
    lo = np.searchsorted(sorted_family, row[shown], side="left")
    hi = np.searchsorted(sorted_family, row[shown], side="right")
    listing = []
    for j, a, b in zip(shown, lo, hi):
        members = by_family[a:b]
        listing.append(Listed(int(idx[j]),
                              tuple(int(idx[i]) for i in members if kept[i] and i != j),
                              tuple(int(idx[i]) for i in members if not kept[i])))
    return listing, len(first)


def _variant_keys(result: SearchResult, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per plan: a number shared by its ZeRO variants (the plan without its ZeRO variant: its row of
    the space) and one shared by its recompute siblings (the plan without its recompute choice: in
    the space, consecutive plan numbers, keyed by the first)."""
    if result.space is not None:
        space = result.space
        row, _ = space.locate(idx)
        g = np.searchsorted(space.group_offset, idx, side="right") - 1
        return row, idx - (idx - space.group_offset[g]) % space.group_r[g]
    x = result.evaluated.plans.take(idx)
    shape = [np.asarray(v) for v in (x.t, x.p, x.d, x.m, x.b, x.sp, x.cp, x.ep, x.expert_tp, x.first_layers,
                                     x.last_layers) if v is not None]
    return (_group_ids(shape + [np.asarray(x.recompute), np.asarray(x.recomputed_layers)]),
            _group_ids(shape + [np.asarray(x.zero), np.asarray(x.shard)]))


def _group_ids(columns: list[np.ndarray]) -> np.ndarray:
    """Per element, a number shared by exactly the elements equal in every column."""
    n = len(columns[0])
    order = np.lexsort(columns[::-1])
    new = np.zeros(n, dtype=bool)
    new[:1] = True
    for c in columns:
        c = c[order]
        new[1:] |= c[1:] != c[:-1]
    ids = np.empty(n, dtype=np.int64)
    ids[order] = np.cumsum(new) - 1
    return ids
