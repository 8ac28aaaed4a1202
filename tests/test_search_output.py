"""What `memplan search` lists: variants folded into rows (and --all-variants unfolding them), the
--sort order, and the search over every preset (each on its own GPU, the skipped ones named).

Every expected value is derived here from the unfolded listing (--all-variants, every plan that
fits), from the library's numbers of every plan, or from the presets' YAML files: never from the
folded output under test."""

import functools
import io
import json
import re
from unittest import mock

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

import memplan.api.searching as searching
import memplan.cli
from memplan.plan.arrange import arrange
from memplan.plan.search import search, search_presets
from memplan.presets.batch import search_inputs
from memplan.presets.catalog import load_gpu, load_model, model_names
from memplan.report.search_tables import DelayedProgress

SHAPE = ("tp", "pp", "dp", "vpp", "micro_batch", "sp")
EVERY = "1000000"  # --top larger than any space here: every plan (row) that fits
SMALL = {  # spaces small enough to list every plan that fits; both have ZeRO (also HSDP) and recompute variants
    "gpt-22b on 8": ("search", "--model", "gpt-22b", "--gpus", "8", "--mem", "80GB"),
    "gpt3-175b on 64": ("search", "--model", "gpt3-175b", "--gpus", "64", "--mem", "80GB"),
}
BIG = ("search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB")
pytestmark = pytest.mark.usefixtures("one_run_per_search")  # tests/conftest.py: a table and a JSON, one search


@functools.lru_cache(maxsize=None)
def cli_json(*args):
    code, out = invoke(150, *args, "--json")
    assert code == 0, out
    return json.loads(out)


@functools.lru_cache(maxsize=None)
def invoke(width, *args):
    """`memplan ARGS` on a console `width` columns wide: (exit code, output)."""
    with mock.patch.object(memplan.cli, "_console", lambda: Console(width=width)):
        result = CliRunner().invoke(memplan.cli.cli, list(args))
    return result.exit_code, result.output


def device(plan):
    return plan["memory"]["device_bytes"]


def row_key(plan):
    """A plan without its ZeRO variant."""
    return tuple(plan[k] for k in SHAPE + ("recompute", "recompute_num_layers"))


def sibling_key(plan):
    """A plan without its recompute choice."""
    return tuple(plan[k] for k in SHAPE + ("zero", "zero_shard"))


def plan_fields(plan):
    return {k: v for k, v in plan.items() if not k.startswith("folded_")}


def expected_rows(plans):
    """The folding rule applied by hand to the unfolded listing `plans` (every plan that fits, best
    first): the rows in listing order as (row key, first plan's position, ZeRO variants, recompute
    variants)."""
    # Y dominates X: the same plan but for the recompute choice, no slower and no larger (a perfect
    # tie goes to the one listed first). X folds into its least-memory dominator, the first listed
    # among equals.
    into = {}
    by_sibling = {}
    for i, x in enumerate(plans):
        by_sibling.setdefault(sibling_key(x), []).append(i)
    for members in by_sibling.values():
        for i in members:
            x = plans[i]
            dominators = [j for j in members if j != i and plans[j]["step_time_s"] <= x["step_time_s"]
                          and device(plans[j]) <= device(x)
                          and not (plans[j]["step_time_s"] == x["step_time_s"] and device(plans[j]) == device(x)
                                   and j > i)]
            if dominators:
                into[i] = min(dominators, key=lambda j: (device(plans[j]), j))
    rows = {}
    for i, x in enumerate(plans):
        if i not in into:
            rows.setdefault(row_key(x), []).append(i)
    recompute = {}
    for i, j in into.items():
        recompute[row_key(plans[j])] = recompute.get(row_key(plans[j]), 0) + 1
    out = [(key, kept[0], len(kept) - 1, recompute.get(key, 0)) for key, kept in rows.items()]
    return sorted(out, key=lambda r: r[1])


@pytest.fixture
def unreplayed(monkeypatch):
    """The search's own listing, arranged and folded, without the caching allocator's replay of the listed plans
    (which takes dead plans out: tests/test_verdict_agreement.py): with --top every plan, every plan would be replayed
    (minutes), and folding does not depend on it."""
    monkeypatch.setattr(searching, "replay_listing", lambda r, sort, fold, top, replay: arrange(r, sort, fold, top))


@pytest.mark.parametrize("case", SMALL)
def test_folded_rows_are_the_unfolded_listing_folded_by_hand(case, unreplayed):
    unfolded = cli_json(*SMALL[case], "--all-variants", "--top", EVERY)["plans"]
    data = cli_json(*SMALL[case], "--top", EVERY)
    assert len(unfolded) == data["feasible"]  # the unfolded listing is every plan that fits
    rows = expected_rows(unfolded)
    assert data["variants_folded"] is True and data["distinct_fit"] == len(rows) == len(data["plans"])
    for plan, (key, first, zero, rec) in zip(data["plans"], rows):
        assert row_key(plan) == key
        assert plan_fields(plan) == plan_fields(unfolded[first])  # the row shows its best-ranked plan, numbers and all
        assert (plan["folded_zero_variants"], plan["folded_recompute_variants"]) == (zero, rec)
    # every plan that fits is shown or folded into exactly one row
    assert sum(1 + p["folded_zero_variants"] + p["folded_recompute_variants"] for p in data["plans"]) == len(unfolded)
    # both kinds of folding happen in these spaces
    assert any(p["folded_zero_variants"] for p in data["plans"])
    assert any(p["folded_recompute_variants"] for p in data["plans"])


def test_variants_of_the_530b_rows():
    # the 530B search's rows, from the library's numbers of every plan: a row's ZeRO variants are the
    # plans that fit with the same t, p, d, b, m, SP and recompute, but for those that another
    # recompute choice of the same ZeRO variant beats (no slower, no larger); each of its recompute
    # variants is such a beaten plan, and the plan beating it is the row's
    model, training, gb = search_inputs(load_model("gpt3-530b"), 2240)
    result = search(model, training, 2240, gb, 80 * 10**9, gpu=load_gpu("a100-80gb"))
    e = result.evaluated
    dev, step = e.device_bytes, e.step_time_s
    fits = (dev <= 80 * 10**9) & (dev > 0)
    shape = [np.asarray(getattr(e.plans, f)) for f in ("t", "p", "d", "m", "b", "sp")]
    recompute = [np.asarray(getattr(e.plans, f)) for f in ("recompute", "recomputed_layers")]
    zero = [np.asarray(getattr(e.plans, f)) for f in ("zero", "shard")]

    def equal(i, arrays):
        mask = fits.copy()
        for a in arrays:
            mask &= a == a[i]
        return mask

    def beaten_by(i):
        """The recompute siblings of plan i that are no slower and no larger (a tie: the lower number)."""
        sib = np.flatnonzero(equal(i, shape + zero))
        return [j for j in sib if j != i and step[j] <= step[i] and dev[j] <= dev[i]
                and not (step[j] == step[i] and dev[j] == dev[i] and j > i)]

    first = result.top[0]
    arrange(result)
    assert result.top[0] == first  # the fastest plan stays first
    for x in result.listed():
        row = [int(i) for i in np.flatnonzero(equal(x.plan, shape + recompute))]
        assert sorted(x.zero_variants + (x.plan,)) == [i for i in row if not beaten_by(i)]
        assert all((step[x.plan], dev[x.plan]) <= (step[i], dev[i]) for i in x.zero_variants)
        for i in x.recompute_variants:
            assert set(beaten_by(i)) & set(x.zero_variants + (x.plan,))
    assert sum(len(x.zero_variants) for x in result.listed()) >= 20


@pytest.mark.parametrize("sort", ("time", "memory"))
def test_fold_is_the_same_on_the_reference_search(sort):
    # the space's plan numbers (fast search) and the plans' own fields (reference search, no space)
    # give the same rows
    model, training, gb = search_inputs(load_model("gpt-22b"), 8)
    fast, ref = (arrange(search(model, training, 8, gb, 80 * 10**9, gpu=load_gpu("a100-80gb"), reference=r),
                         sort, True, 60) for r in (False, True))
    assert ref.space is None and fast.listing == ref.listing and fast.distinct_fit == ref.distinct_fit
    assert any(x.zero_variants for x in fast.listing) and any(x.recompute_variants for x in fast.listing)


def test_without_step_times_only_zero_variants_fold():
    model, training, gb = search_inputs(load_model("gpt-22b"), 8)
    result = arrange(search(model, training, 8, gb, 80 * 10**9, gpu=None), "time", True, 30)
    assert result.sort == "memory"  # nothing to time: least memory first
    memory = [result.numbers(x.plan)["device_bytes"] for x in result.listing]
    assert memory == sorted(memory) and not any(x.recompute_variants for x in result.listing)
    assert any(x.zero_variants for x in result.listing)


def test_table_shows_the_folded_counts():
    data = cli_json(*BIG)
    code, out = invoke(150, *BIG)
    assert code == 0
    assert f"variants folded into {data['distinct_fit']:,} rows" in out
    lines = [line for line in out.splitlines() if re.match(r"│ +\d+ │", line)]
    assert len(lines) == len(data["plans"]) == 10
    for line, plan in zip(lines, data["plans"]):
        cell = line.split("│")[-2].strip()
        words = [f"+{plan['folded_zero_variants']} ZeRO"] * bool(plan["folded_zero_variants"]) + [
            f"+{plan['folded_recompute_variants']} rec"] * bool(plan["folded_recompute_variants"])
        assert cell == " ".join(words)


@pytest.mark.parametrize("width", (80, 150))
def test_folded_table_keeps_one_line_per_row(width):
    code, out = invoke(width, *BIG, "--top", "10")
    assert code == 0
    assert not [line for line in out.splitlines() if len(line) > width] and "…" not in out
    rows = [line for line in out.splitlines() if re.match(r"[│ ]*\d+ [│ ]*\d+ ", line)]
    assert len(rows) == 10 and all("ZeRO" in line for line in rows[:2])


def test_all_variants_restores_the_search_ranking():
    # --all-variants lists what the search ranks, plan by plan (ZeRO variants side by side again)
    model, training, gb = search_inputs(load_model("gpt3-530b"), 2240)
    result = search(model, training, 2240, gb, 80 * 10**9, gpu=load_gpu("a100-80gb"), top=10)
    expected = [result.row(i) for i in result.top]
    data = cli_json(*BIG, "--all-variants")
    assert data["variants_folded"] is False and "distinct_fit" not in data
    assert [plan_fields(p) for p in data["plans"]] == expected
    assert all(p["folded_zero_variants"] == p["folded_recompute_variants"] == 0 for p in data["plans"])
    keys = [row_key(p) for p in data["plans"]]
    assert len(set(keys)) < len(keys)  # the unfolded listing repeats a plan in several ZeRO variants
    folded = [row_key(p) for p in cli_json(*BIG)["plans"]]
    assert len(set(folded)) == len(folded)  # folded: never
    code, out = invoke(150, *BIG, "--all-variants")
    assert code == 0 and "folded" not in out  # neither the heading line nor the column


@pytest.mark.parametrize("extra", ([], ["--all-variants"]), ids=("folded", "all variants"))
def test_sort_memory(extra):
    data = cli_json(*BIG, "--sort", "memory", "--top", "15", *extra)
    plans = data["plans"]
    assert data["sort"] == "memory" and len(plans) == 15
    keys = [(device(p), p["step_time_s"]) for p in plans]
    assert keys == sorted(keys)  # least device memory first, ties by step time
    # the first is the least memory of every plan that fits, from the library's numbers of every plan
    model, training, gb = search_inputs(load_model("gpt3-530b"), 2240)
    result = search(model, training, 2240, gb, 80 * 10**9, gpu=load_gpu("a100-80gb"))
    e = result.evaluated
    fits = (e.device_bytes <= 80 * 10**9) & (e.device_bytes > 0)
    assert device(plans[0]) == int(e.device_bytes[fits].min())
    if extra:  # unfolded: the 15 least device memories of all, in order
        assert [device(p) for p in plans] == sorted(e.device_bytes[fits].tolist())[:15]


def test_sort_memory_table_and_csv(run_cli):
    code, out = invoke(150, *BIG, "--sort", "memory", "--top", "8")
    assert code == 0 and "8 plans that fit, least device memory first" in out
    memory = [float(m) for m in re.findall(r"│ +([\d.]+) GB │ +[\d.]+ s │", out)]
    assert len(memory) == 8 and memory == sorted(memory)
    code, out, _ = run_cli(*BIG, "--sort", "memory", "--top", "8", "--format", "csv")
    fits = [line.split(",") for line in out.splitlines()[1:] if ",fits," in line]
    header = out.splitlines()[0].split(",")
    values = [int(r[header.index("device_bytes")]) for r in fits]
    assert len(values) == 8 and values == sorted(values)


def test_sort_time_is_the_default():
    assert cli_json(*BIG)["sort"] == "time"
    plans = cli_json(*BIG, "--sort", "time")["plans"]
    keys = [(p["step_time_s"], device(p)) for p in plans]
    assert keys == sorted(keys)


@pytest.mark.parametrize("args", (["--sort", "foo"], ["--sort", ""]))
def test_bad_sort_is_one_line_and_exit_2(run_cli, args):
    code, out, err = run_cli(*BIG, *args)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1
    assert lines[0].startswith("memplan: error:") and "--sort" in lines[0]


def test_help_states_the_rule():
    code, out = invoke(150, "search", "--help")
    assert code == 0
    for text in ("--sort", "--all-variants", "+n ZeRO", "+n rec", "no faster", "ZeRO stage or shard group"):
        assert text in out, text


# --- every preset ------------------------------------------------------------------------------
DEFAULT_GPU = "a100-80gb"  # what a preset that names no GPU is timed on


def preset_gpu(name):
    """The GPU the preset's YAML names (None: none)."""
    return load_model(name).gpu


def shown_name(name):
    return load_model(name).model.name


def divides(name, gpus):
    """Whether some t, p, d split `gpus` GPUs for the preset (t divides a and the key/value heads, at
    most 8; p divides L; d = gpus / (t p) divides the global batch), by hand."""
    preset = load_model(name)
    m = preset.model
    _, _, batch = search_inputs(preset, gpus)
    for t in range(1, 9):
        for p in range(1, m.num_layers + 1):
            if (m.num_attention_heads % t or m.g % t or m.num_layers % p or gpus % (t * p)
                    or batch % (gpus // (t * p))):
                continue
            return True
    return False


def megatron_refuses(name):
    """A preset the default --impl megatron has no inventory for (skipped): none since multi-head latent
    attention (memplan/inventory/mla.py) and Megatron-LM's MoE layers (memplan/inventory/moe.py) are modelled."""
    return False


def test_every_preset_on_its_own_gpu_and_the_skipped_ones_named():
    gpus = 7
    code, out = invoke(150, "search", "--gpus", str(gpus))
    assert code == 0, out
    skipped = {name for name in model_names() if not divides(name, gpus) or megatron_refuses(name)}
    assert skipped - {name for name in model_names() if megatron_refuses(name)}  # 7 GPUs: some preset cannot be split
    assert "each timed on its own preset's GPU" in out
    assert any(preset_gpu(name) for name in model_names())
    for name in model_names():
        gpu, model = preset_gpu(name) or DEFAULT_GPU, shown_name(name)
        budget = f"{load_gpu(gpu).process_memory_bytes / 1e9:,.2f} GB"  # no --mem: what one process can have
        assumed = r" \(assumed\)" if preset_gpu(name) is None else ""
        rows = [line for line in out.splitlines() if line.startswith(f"│ {model} ")]
        if name in skipped:
            assert not rows
            line = next(line for line in out.splitlines() if line.startswith(f"skipped {model} "))
            reason = ("no Megatron-LM inventory for multi-head latent attention yet" if megatron_refuses(name)
                      else f"no plan of {model} divides {gpus} GPUs")
            assert line.startswith(f"skipped {model} ({gpu}): {reason}"), line
        else:
            assert len(rows) == 1 and re.search(rf"│ {gpu} {budget}{assumed} +│", rows[0]), rows
    if not all(preset_gpu(name) for name in model_names()):
        assert f"(assumed): the preset names no GPU; timed on {DEFAULT_GPU}" in out
    data = cli_json("search", "--gpus", str(gpus))
    by_model = {d["model"]: d for d in data}
    assert set(by_model) == {shown_name(name) for name in model_names()}
    for name in model_names():
        d = by_model[shown_name(name)]
        assert d["gpu"] == (preset_gpu(name) or DEFAULT_GPU)
        assert ("skipped" in d) is (name in skipped)
        if name in skipped:
            assert d["plans"] == []
        else:
            assert d["budget_bytes"] == load_gpu(d["gpu"]).process_memory_bytes  # CUDA's total_memory if known
            if preset_gpu(name) is None:
                assert any("names no GPU" in note for note in d["notes"])


def test_every_preset_with_gpu_given():
    # --top 1: what is checked (the heading, each preset's GPU and name) is the same for any --top; the every-preset
    # table shows each preset's best plan, the same (byte for byte) as with the default 10, which the other tests run
    code, out = invoke(150, "search", "--gpus", "64", "--mem", "80GB", "--gpu", "h200", "--top", "1")
    assert code == 0 and "every preset on 64 h200 GPUs (--gpu), 80.00 GB per GPU" in out
    data = cli_json("search", "--gpus", "64", "--mem", "80GB", "--gpu", "h200", "--top", "1")
    assert {d["gpu"] for d in data} == {"h200"} and len(data) == len(model_names())
    # every preset answers by name, the K22 paper's four included (tests/test_planner.py ran this model-less
    # search at 2,240 GPUs for those four names: the same loop over the presets, 168 s of the suite's wall)
    assert {d["model"] for d in data} == set(model_names()) >= {"gpt-22b", "gpt3-175b", "gpt3-530b", "gpt-1t"}


def test_every_preset_at_80_columns_names_the_gpus():
    code, out = invoke(80, "search", "--gpus", "64", "--mem", "80GB")
    assert code == 0 and not [line for line in out.splitlines() if len(line) > 80]
    text = " ".join(out.split())  # the GPU lines may wrap
    for gpu in {preset_gpu(name) for name in model_names()}:
        names = [shown_name(name) for name in model_names() if preset_gpu(name) == gpu and not megatron_refuses(name)]
        cell = gpu if gpu is not None else f"{DEFAULT_GPU} (assumed)"
        assert f"on {cell}: {', '.join(names)}" in text


def test_every_preset_sorted_by_memory():
    data = cli_json("search", "--gpus", "64", "--mem", "80GB", "--sort", "memory", "--top", "3")
    for d in data:
        if "skipped" in d:
            continue  # the MoE presets under --impl megatron
        keys = [(device(p), p["step_time_s"]) for p in d["plans"]]
        assert d["sort"] == "memory" and keys == sorted(keys)


def test_search_presets_labels_progress_and_names_the_skipped():
    calls = []
    requests = []
    for name in ("gpt-22b", "llama3-8b"):
        preset = load_model(name)
        gpu = load_gpu(preset.gpu)
        requests.append((*search_inputs(preset, 7), gpu, gpu.memory_bytes))
    results, skipped = search_presets(requests, 7, progress=lambda done, total, label: calls.append(label))
    assert [r.model.name for r in results] == ["llama3-8b"] and results[0].gpu.name == "h100-80gb"
    assert [(s.model, s.gpu) for s in skipped] == [("gpt-22b", "a100-80gb")]
    assert "divides 7 GPUs" in skipped[0].reason
    assert set(calls) == {"llama3-8b on h100-80gb"}


def test_progress_bar_names_what_it_evaluates():
    progress = DelayedProgress(Console(file=io.StringIO(), width=120), delay=0)
    progress(1, 10, label="gpt-1t on a100-80gb")
    task = progress.bar.tasks[0]
    assert "gpt-1t on a100-80gb" in task.description and task.total == 10
    progress(3, 40, label="llama3-8b on h100-80gb")
    assert "llama3-8b on h100-80gb" in task.description and (task.completed, task.total) == (3, 40)
    progress.close()
