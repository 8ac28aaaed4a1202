"""Plain-text pieces shared by the rich tables, the Markdown / CSV formats and the plots (no rich here):
byte cells (format_gb, bytes3) and the plan summaries of a search row (plan_text, compact_plan and their cells)."""

from __future__ import annotations

from typing import Any, Optional

from memplan.core.units import format_bytes


def format_gb(n: int) -> str:
    return format_bytes(n, "GB")


def bytes3(n: int) -> str:
    """Bytes to 3 significant digits in the largest decimal unit that keeps them >= 1 (the compact
    layout): '524 KB', '1.07 GB', '16.1 GB', '512 B'."""
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= factor * 0.9995:  # what rounds up to 1.00 takes the larger unit
            x = n / factor
            return f"{x:.2f} {unit}" if abs(x) < 9.995 else f"{x:.1f} {unit}" if abs(x) < 99.95 else f"{x:.0f} {unit}"
    return f"{int(n)} B"


# The compact layout's plans: K22's letters t, p, d, m, b, Z for the ZeRO stage, B for the global batch
PLAN_LETTERS = {"tp": "t", "pp": "p", "dp": "d", "micro_batch": "b", "vpp": "m", "zero": "Z", "global_batch": "B",
                "ep": "ep", "cp": "cp", "etp": "etp"}


RECOMPUTE_SHORT = {"none": "none", "selective": "sel", "full": "full"}


PLAN_LEGEND = ("t, p, d tensor, pipeline, data parallel; ep, cp expert, context parallel; b micro-batch; m chunks; "
               "Z ZeRO; B global batch; "
               "p16* uneven stages (first / last stage layers); "
               "t1, m1, Z0, SP off and recompute none left out")


def compact_plan(fields: dict[str, Any]) -> str:
    """A plan {tp: 8, pp: 64, dp: 1, vpp: 1, sp: True, micro_batch: 1, global_batch: 512, recompute:
    'selective'} as 't8 p64 d1 b1 SP B512 sel', in the order given: the defaults (t1, m1, Z0, SP off,
    recompute none) left out; 'zero' may be a '2/8' string (HSDP), 'recompute' a 'rec_cell' text
    ('full 2/32'); a field it does not know stays 'key=value'."""
    words = []
    split = {k: fields[k] for k in ("first_stage_layers", "last_stage_layers") if k in fields}
    for key, value in fields.items():
        text = str(value)
        if key in split:
            continue
        if key == "pp" and split:  # an uneven split (the first and / or the last stage's layers given)
            text += "*"
        if key == "sp":
            words += ["SP"] if text == "True" else []
        elif (key, text) in (("vpp", "1"), ("zero", "0"), ("recompute", "none"), ("tp", "1")):
            continue
        elif key in PLAN_LETTERS:
            words.append(f"{PLAN_LETTERS[key]}{text}")
        elif key == "recompute":
            words.append(RECOMPUTE_SHORT.get(text, text))
        else:
            words.append(f"{key}={text}")
    return " ".join(words)


def plan_text(row: dict[str, Any], num_layers: Optional[int] = None, layers: Optional[int] = None) -> str:
    """'t=8 p=35 d=8 b=1 m=3 SP selective ZeRO-1' style summary of a search row; given the model's
    `num_layers`, the compact layout's 't8 p35 d8 b1 m3 SP sel Z1' (compact_plan)."""
    if "torchtitan" in row:  # search --impl torchtitan (memplan/plan/titan.py titan_dims)
        return titan_text(row["torchtitan"])
    rec = row["recompute"]
    if num_layers is not None:
        cell = rec_cell(row, row_chunk(row, num_layers), short=True)
        return compact_plan({"tp": row["tp"], "pp": p_cell(row, num_layers).replace(" ", ""),
                             **{k: row[k] for k in ("dp", "micro_batch", "vpp", "sp")},
                             "recompute": cell, "zero": zero_cell(row)})
    rec_text = {"none": "no-recompute", "selective": "selective"}.get(rec, f"full x{row['recompute_num_layers']}")
    sp = " SP" if row["sp"] else ""
    cp_ep = "".join(f" {k}={row[k]}" for k in ("cp", "ep") if row.get(k, 1) > 1)
    pp = row["pp"] if layers is None else p_cell(row, layers).replace(" ", "")  # layers: L, to show a split
    return (f"t={row['tp']} p={pp} d={row['dp']}{cp_ep} b={row['micro_batch']} m={row['vpp']}{sp} "
            f"{rec_text} ZeRO-{zero_cell(row)}")


def titan_text(dims: dict[str, Any]) -> str:
    """'dp_replicate=1 dp_shard=8 tp=1 local_batch=2 ac=selective-op compile' (the estimate --impl torchtitan flags)."""
    return (f"dp_replicate={dims['dp_replicate']} dp_shard={dims['dp_shard']} tp={dims['tp']} "
            + (f"cp={dims['cp']} " if dims.get("cp", 1) > 1 else "") + (f"ep={dims['ep']} " if dims.get("ep", 1) > 1 else "")
            + (f"pp={dims['pp']} {dims['pipeline_schedule']} micro_batch={dims['pipeline_microbatch_size']} "
               if dims.get("pp", 1) > 1 else "")
            + f"local_batch={dims['local_batch']} ac={dims['ac']}" + (" compile" if dims["compile"] else "")
            + (" async_tp" if dims.get("async_tp") else "")
            + (f" float8={dims['float8']}" if dims.get("float8") else ""))


def zero_cell(row: dict[str, Any]) -> str:
    """'2' when sharded over all d ranks, '2/8' when over a group of 8 (HSDP)."""
    z = row["zero"]
    return f"{z}/{row['zero_shard']}" if z and row["zero_shard"] < row["dp"] else str(z)


def row_chunk(row: dict[str, Any], num_layers: int) -> int:
    """Layers of a search row's largest model chunk (L/(p m), or with uneven stages the largest stage's / m)."""
    first, last, p = row.get("first_stage_layers"), row.get("last_stage_layers"), row["pp"]
    if first is None or first * p == num_layers == last * p:
        return num_layers // (p * row["vpp"])
    middle = (num_layers - first - last) // (p - 2) if p > 2 else 0
    return max(first, middle, last) // row["vpp"]


def p_cell(row: dict[str, Any], num_layers: int) -> str:
    """p, and with uneven stages the layers of the first / each middle / the last stage: '16 (7/8/7)'."""
    first, last, p = row.get("first_stage_layers"), row.get("last_stage_layers"), row["pp"]
    if first is None or first * p == num_layers == last * p:
        return str(p)
    if p == 2:
        return f"2 ({first}/{last})"
    return f"{p} ({first}/{(num_layers - first - last) // (p - 2)}/{last})"


def rec_cell(row: dict[str, Any], layers_per_chunk: int, short: bool = False) -> str:
    """'selective', 'full', 'full 2/32' (2 of the chunk's 32 layers); `short`: 'sel' for selective."""
    if row["recompute"] != "full":
        return RECOMPUTE_SHORT.get(row["recompute"], row["recompute"]) if short else row["recompute"]
    n = row["recompute_num_layers"]
    return "full" if n == layers_per_chunk else f"full {n}/{layers_per_chunk}"


def pinned_techniques(training: Any, lead: str = ",") -> str:
    """The FP8 recipe and loss chunks of a plan (or of every plan of a search), as text; empty without them."""
    parts = []
    if training.fp8 is not None:
        parts.append(f"FP8 {training.fp8} ({training.fp8_format}"
                     + (", FP8 weights" if training.fp8_param_gather else "") + ", derived)")
    if training.loss_chunks > 1:
        parts.append(f"LM head + loss in {training.loss_chunks} chunks")
    return f"{lead} {', '.join(parts)}" if parts else ""


def fragmentation_label(dev: Any) -> str:
    """What a report calls the device memory's fragmentation: the replay's (with no flat margin where the stream is
    checked against the real run's, `Inventory.stream_checked`), or the flat margin."""
    if dev.replayed and not dev.margin:
        return "fragmentation (the caching allocator's replay; no flat margin: the stream checked against the real run)"
    if dev.replayed:
        return "fragmentation (the caching allocator's replay, above the margin)"
    return f"fragmentation margin ({dev.margin:.0%} of the allocated peak)"
