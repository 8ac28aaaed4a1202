"""The space of plans `search` looks through, as numpy arrays: every plan a user could launch for a model
on N GPUs, and the dimensions pinned in it (`Fixed`: by the user's options, `fixed_from`; by the training
settings, `training_fixed`).

The space (each plan distinct and launchable with Megatron-LM):
  t  divides a and the key/value heads, at most the GPUs of a node (or `max_tp`);
  p  divides L; d = N / (t p) must be whole and divide the global batch;
  b  divides the global batch / d (M = global batch / (b d) micro-batches per step);
  m  interleaved chunks per rank, dividing L / p (m > 1 needs p > 1 and M divisible by p,
     Megatron-LM's interleaved-schedule requirement);
  SP on / off when t > 1;
  recompute none, selective, or full on N = 1 .. L/(pm) layers per chunk (block method);
  ZeRO 0 .. 3 (1 = Megatron-LM distributed optimizer) when d > 1 (with d = 1 they equal 0: only a pinned one), each
     sharded over k ranks for every divisor k > 1 of d (k < d: HSDP, d/k replicas of each shard).

With impl "torchtitan" (memplan/plan/titan.py narrows it with `Fixed`): SP exactly when t > 1.

The space is a table (`PlanSpace`, `plan_space`): a row is a plan without its ZeRO variant (t, p, d, m,
b, M, SP, recompute, recomputed layers) and the columns are the ZeRO variants of the row's d
(memplan/plan/evaluate.py evaluates it). `enumerate_plans` gives every plan as flat arrays, `plan_config`
one of them as a Config.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.specs import EXPERT_PARALLEL_RULE, Config, ParallelSpec, check_gpus, expert_parallel_modelled
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory import mst
from memplan.inventory.fp8 import MAX_ZERO as FP8_MAX_ZERO
from memplan.inventory.types import HF_IMPLS
from memplan.memory.pipeline_multi import is_multi
from memplan.memory.term_bytes import PlanValues


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
    max_zero: int = 3  # the highest ZeRO stage the training settings allow (FP8: 1, memplan/inventory/fp8.py)
    cp: Optional[int] = None
    ep: Optional[int] = None
    etp: Optional[int] = None
    cp_comm_type: str = "p2p"  # not searched: how every plan's context-parallel attention communicates
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    uneven: bool = False  # also search uneven stages: one or two layers fewer on the first / last stage (_splits)
    expert_parallel: bool = True  # False: ep = 1 and etp = t only (the optimizer / offload has no EP model)
    recompute_layers: Optional[tuple[int, ...]] = None  # the full-recompute layer counts searched (None: 1 .. n)


def _pick(values: list[int] | tuple[int, ...], fixed: Optional[int]) -> list[int]:
    return [v for v in values if fixed is None or v == fixed]


# --- the space as rows x ZeRO columns ----------------------------------------------------------
ROW_FIELDS = ("t", "p", "d", "m", "b", "M", "sp", "rec", "k", "cp", "ep", "etp", "lf", "ll")


def _splits(L: int, p: int, fixed: Fixed) -> list[tuple[int, int]]:
    """The layer splits searched for p stages, as (first stage's layers, last stage's layers), the middle stages
    splitting the rest evenly (memplan/memory/pipeline.py stage_layers): the even split when p divides L; with
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
    """Recompute none, selective and full of k = 1 .. n layers per chunk; transformers (`hf`) has no selective
    recompute and checkpoints every layer or none (memplan/inventory/hf.py check_hf_plan)."""
    recompute = [(int(Recompute.NONE), n)] + ([] if hf else [(int(Recompute.SELECTIVE), n)]) + [
        (int(Recompute.FULL), k) for k in (range(n, n + 1) if hf else range(1, n + 1))]
    if fixed.recompute is not None:
        recompute = [r for r in recompute if r[0] == fixed.recompute]
    if fixed.recompute_num_layers is not None:
        recompute = [r for r in recompute if r[0] == Recompute.FULL and r[1] == fixed.recompute_num_layers]
    if fixed.recompute_layers is not None:  # torchtitan: full AC and its selective per-layer AC (memplan/plan/titan.py)
        recompute = [r for r in recompute if r[0] != Recompute.FULL or r[1] in fixed.recompute_layers]
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
            if impl == "torchtitan":  # TP with sequence parallelism only (memplan/plan/titan.py)
                sps = [x for x in sps if x == int(t > 1)]
            if fixed.sp is not None:
                sps = [x for x in sps if x == int(fixed.sp)]
            zkey = _zero_key(d, t, cp, ep, etp)
            if zkey not in zero_lists:
                # with expert parallelism the d/k distributed-optimizer instances must divide the expert-data-parallel
                # size edp = t cp d / (etp ep) (ParallelSpec; megatron/core/parallel_state.py)
                # d = 1: ZeRO 1-3 shard over one rank, as ZeRO 0 (left out) unless pinned (`estimate` takes the pin)
                stages = [z for z in (0, 1, 2, 3) if z <= fixed.max_zero and (d > 1 or z == 0 or z == fixed.zero)]
                zero_lists[zkey] = [(z, k) for z in _pick(stages, fixed.zero)
                                    for k in ([d] if z == 0 else [k for k in _divisors(d) if (k > 1 or d == 1)
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
    # rows of full recompute whose value follows from the rows of k = 1 and 2 (memplan/plan/evaluate.py)
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
    cp a power of 2 up to MAX_CP with 2 cp | s, flash attention only and s >= CP_MIN_SEQ (memplan/memory/parallel.py);
    for an MoE model ep dividing E and etp in {1, t} dividing f_e, ep etp > 1 with the flex dispatcher
    (memplan/memory/parallel.py; ep etp | t cp d is checked
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
            expert = model.is_moe and not hf and fixed.expert_parallel
            eps = list(_divisors(model.num_experts)) if expert else [1]
            for ep in _pick(eps, fixed.ep):
                etps = sorted({1, t}) if expert else [t]
                for etp in _pick([e for e in etps if model.fe % e == 0
                                  and (ep * e > 1 or model.moe_token_dispatcher != "flex")], fixed.etp):
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


def training_fixed(model: ModelSpec, training: TrainingSpec, fixed: Fixed) -> Fixed:
    """What the training settings pin in a search. FP8 is modelled up to the distributed optimizer
    (memplan/inventory/fp8.py): the search leaves ZeRO 2 / 3 out. Expert parallelism is modelled with some optimizers
    only (memplan/core/specs.py EXPERT_PARALLEL_RULE): with the others the search leaves it out (`space_notes`). MsT is modelled at micro-batch 1 with every layer
    checkpointed (memplan/inventory/mst.py search_pins). Activation offload is modelled without recompute
    (TrainingSpec): the search keeps recompute none; torchtune's with every layer checkpointed: recompute full."""
    if training.fp8 is not None:
        if fixed.zero is not None and fixed.zero > FP8_MAX_ZERO:
            raise MemplanError(f"--fp8 with ZeRO-{fixed.zero} (Megatron-FSDP) is not modelled: search it with --zero "
                               "0 or 1 (or leave --zero out)")
        fixed = dataclasses.replace(fixed, max_zero=FP8_MAX_ZERO)
    if model.is_moe and not expert_parallel_modelled(training):
        if (fixed.ep or 1) > 1 or fixed.etp is not None:
            raise MemplanError(f"{EXPERT_PARALLEL_RULE}: search {training.optimizer}"
                               f"{' with optimizer offload' if training.offload_optimizer_fraction else ''} without "
                               "--ep / --etp")
        fixed = dataclasses.replace(fixed, expert_parallel=False)
    if mst.is_on(training.mst):
        b, k = mst.search_pins(fixed.micro_batch, fixed.recompute, fixed.recompute_num_layers, model.num_layers)
        fixed = dataclasses.replace(fixed, micro_batch=b, recompute=Recompute.FULL, recompute_num_layers=k)
    if not training.offload_activations:
        return fixed
    if training.activation_offloader == "torchtune":  # its recipes offload only with every layer checkpointed
        if fixed.recompute not in (None, Recompute.FULL) or fixed.recompute_num_layers is not None:
            raise MemplanError("torchtune's activation offloading runs with every layer checkpointed: search it with "
                               "--recompute full (or leave --recompute out)")
        return dataclasses.replace(fixed, recompute=Recompute.FULL)
    if fixed.recompute not in (None, Recompute.NONE) or fixed.recompute_num_layers is not None:
        raise MemplanError("activation offload is modelled without recompute: search it with --recompute none "
                           "(or leave --recompute out)")
    return dataclasses.replace(fixed, recompute=Recompute.NONE)


def space_notes(model: ModelSpec, fixed: Fixed) -> list[str]:
    """What the search space leaves out that a user could ask for, as notes (after `training_fixed`)."""
    if model.is_moe and not fixed.expert_parallel:
        return [f"{EXPERT_PARALLEL_RULE}: the search keeps ep = 1 and the expert tensor-parallel size at t "
                "(every GPU holds every expert)"]
    return []


def plan_config(model: ModelSpec, training: TrainingSpec, plans: PlanValues, i: int, global_batch: int) -> Config:
    """One candidate as a Config, for `estimate`, reports and launch flags."""
    x = plans.take(i)
    L, p = model.num_layers, int(x.p)
    # a multi-stage schedule's ranks are torchtitan's split of p m stages (PlanValues.layers), not a first / last split
    uneven = x.first_layers is not None and (int(x.first_layers) * p != L or int(x.last_layers) * p != L) and not (
        is_multi(x.schedule))
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
                              etp=int(x.expert_tp) if model.is_moe and int(x.expert_tp) != int(x.t) else None,
                              pp_schedule=str(x.schedule), **split),
        training=training.model_copy(update=dict(
            micro_batch=int(x.b), global_batch=global_batch, recompute=rec,
            recompute_num_layers=(int(x.recomputed_layers) if rec == Recompute.FULL and x.recomputed_layers < n else None),
        )),
    )


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
