"""search --impl torchtitan over pipeline parallelism (memplan/plan/titan.py `pipelines`): pp 1 and the powers of 2
dividing the GPUs whose torchtitan stage split `estimate --impl torchtitan --pp` takes (memplan/memory/pipeline.py
titan_split), with the schedules 1F1B and GPipe, 1F1B only with as many micro-batches as stages (torch 2.13's
Schedule1F1B refuses fewer). Every plan searched is distinct and gets the memory and step time that `estimate` with
its flags gives (the same functions: the property is that the two commands agree); the splits estimate refuses are
never searched (hand-derived below). The emitted config of a listed pp plan is built in tests/test_launch_titan.py."""

import pytest

from memplan import estimate, search
from memplan.cli import main
from memplan.core.errors import MemplanError
from memplan.plan.titan import titan_dims

GPU = "h100-80gb"
BASE = dict(impl="torchtitan", gpus=16, global_batch=32, seq_len=1024, gpu=GPU)


def _flags(d):
    """A row's torchtitan settings as estimate's options (with pp: --micro-batch is the pipeline's micro-batch)."""
    return dict(tp=d["tp"], dp_replicate=d["dp_replicate"], ac=d["ac"], compile=d["compile"], pp=d["pp"],
                pipeline_schedule=d["pipeline_schedule"],
                micro_batch=d["pipeline_microbatch_size"] if d["pp"] > 1 else d["local_batch"])


def test_the_pp_space_is_torchtitans_valid_splits_each_plan_distinct():
    found = search("llama3-8b", all_variants=True, top=1, tp=1, compile=False, mem=80 * 10**9, **BASE).result
    dims = [titan_dims(found.config(i)) for i in range(found.candidates)]
    assert len({tuple(sorted(d.items())) for d in dims}) == len(dims)  # distinct plans only
    # torchtitan's split of L = 32 with the embedding and the output each counted as a layer (34 "effective"
    # layers dealt out, the first stages one more): p = 2: 17 + 17 -> 16, 16 (valid); p = 4: 9, 9, 8, 8 ->
    # 8, 9, 8, 7; p = 8: 5, 5, 4 x 6 -> 4, 5, 4, 4, 4, 4, 4, 3; p = 16: 3, 3, 2 x 14 -> 2, 3, 2, ..., 2, 1: middle
    # stages of different sizes, which estimate refuses with the single-stage schedules: never searched with them
    # (the multi-stage ones split 2p virtual stages themselves: tests/test_titan_multistage.py)
    single = [d for d in dims if d["pipeline_schedule"] in (None, "1F1B", "GPipe")]
    assert {d["pp"] for d in single} == {1, 2}
    assert any("pp 4, 8, 16 not searched with the single-stage schedules" in n for n in found.notes)
    for pp in (4, 8, 16):
        with pytest.raises(MemplanError, match="middle stages"):
            estimate("llama3-8b", pp=pp, **BASE)
    piped = [d for d in single if d["pp"] == 2]
    assert {d["pipeline_schedule"] for d in piped} == {"1F1B", "GPipe"}
    assert {d["pipeline_schedule"] for d in dims if d["pp"] == 1} == {None}  # pp 1 once, no schedule
    # d = 16 / 2 = 8 data-parallel ranks: the local batch is 32 / 8 = 4 sequences, the pipeline's M = 4 / b
    # micro-batches (b = 1, 2, 4), no accumulation on top; 1F1B needs M >= 2 stages: b = 4 (M = 1) GPipe only
    assert {d["local_batch"] for d in piped} == {4} and {d["gradient_accumulation"] for d in piped} == {1}
    assert {d["pipeline_microbatch_size"] for d in piped if d["pipeline_schedule"] == "1F1B"} == {1, 2}
    assert {d["pipeline_microbatch_size"] for d in piped if d["pipeline_schedule"] == "GPipe"} == {1, 2, 4}
    # AC under pp: none, selective-op and full of the stage's 16 layers (selective-layer's count over the stages is
    # not modelled); full AC named "full" as estimate takes it
    assert {d["ac"] for d in piped} == {"none", "selective-op", "full"}
    e = found.evaluated
    for i in [i for i, d in enumerate(dims) if d["pp"] == 2][::5]:  # ~8 plans: estimate's numbers, the same plan
        est = estimate("llama3-8b", **BASE, **_flags(dims[i]))
        assert est.estimate.step.peak_bytes == e.peak_bytes[i], dims[i]
        assert est.estimate.perf.step_time_s == pytest.approx(e.step_time_s[i], rel=1e-6)
        assert est.estimate.perf.bubble_s > 0  # the pipeline's bubble is in the step time


def test_every_listed_pp_plan_has_estimates_memory_and_time():
    # pp pinned (FSDP2 under PP keeps the stage's bf16 weights and fp32 gradients unsharded all step, 6 B per stage
    # parameter, more than FSDP2 over all 16 ranks' 16 / 16 B per parameter: no budget makes pp the one that fits)
    found = search("llama3-8b", top=6, pp=2, mem=50 * 10**9, **BASE).result
    assert found.top
    for x in found.listed():
        row = found.row(x.plan)
        assert row["pp"] == 2 == row["torchtitan"]["pp"]
        est = estimate("llama3-8b", mem=50 * 10**9, **BASE, **_flags(row["torchtitan"]))
        assert est.fits and row["memory"]["device_bytes"] == est.device_bytes, row["torchtitan"]
        assert row["step_time_s"] == pytest.approx(est.estimate.perf.step_time_s, rel=1e-6)
    assert any("bubble" in n and "uncalibrated" in n for n in found.notes)


def test_an_uneven_torchtitan_split_is_searched_as_estimate_splits_it():
    # Llama 3.1 405B, L = 126, p = 4: 128 effective layers, 32 a stage: 31, 32, 32, 31 (the first and the last stage
    # a layer short, the middle ones equal): searched, with estimate's stage split and numbers
    kw = dict(impl="torchtitan", gpus=32, global_batch=32, seq_len=1024, gpu=GPU, tp=8, pp=4, ac="full",
              compile=False, dp_replicate=1, mem=80 * 10**9)
    found = search("llama3.1-405b", all_variants=True, top=4, **kw).result
    # d = 32 / (8 x 4) = 1, local batch 32: GPipe with b = 1, 2, 4, 8, 16, 32; 1F1B with M = 32 / b >= 4: b <= 8;
    # the multi-stage schedules at 2 stages a rank (torchtitan's 8 stages of 16 effective layers: ranks of 15 + 16,
    # 16 + 16, 16 + 16, 16 + 15 layers): LoopedBFS, ZBVZeroBubble, Interleaved1F1B and InterleavedZeroBubble every b
    # (M = 32 / b is a multiple of its rounds, max(1, M // 4)), DualPipeV M >= 2 x 4: b <= 4
    assert found.candidates == 6 + 4 + 4 * 6 + 3
    row = found.row(found.top[0] if found.top else found.nearest_miss)
    assert (row["first_stage_layers"], row["last_stage_layers"]) == (31, 31)
    seen = set()  # every single-stage plan; the first of each multi-stage schedule (each ~0.3 s to estimate)
    for i in range(found.candidates):
        d = titan_dims(found.config(i))
        if d["pipeline_schedule"] in seen:
            continue
        if d["pipeline_schedule"] not in ("1F1B", "GPipe"):
            seen.add(d["pipeline_schedule"])
        est = estimate("llama3.1-405b", **{**kw, **_flags(d)})
        assert est.estimate.step.peak_bytes == found.evaluated.peak_bytes[i], d
    assert len(seen) == 5


def test_estimate_refuses_1f1b_with_fewer_micro_batches_than_stages():
    # 16 GPUs, pp 2, d 8, global batch 8, b 1: M = 1 micro-batch; torch's Schedule1F1B raises "Number of
    # microbatches (1) must be greater than or equal to the number of stages (2)"; GPipe runs it
    with pytest.raises(MemplanError, match="Schedule1F1B"):
        estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, global_batch=8, micro_batch=1, seq_len=1024)
    estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, global_batch=8, micro_batch=1, seq_len=1024,
             pipeline_schedule="GPipe")


def test_search_refuses_pp_it_does_not_model_in_one_line(capsys):
    for extra in (["--pp", "4"], ["--pp", "2", "--ac", "selective-layer:2"], ["--pp", "2", "--float8", "rowwise"],
                  ["--pp", "2", "--pipeline-schedule", "ZBVZeroBubble", "--compile"],
                  ["--pipeline-schedule", "Interleaved1F1B", "--pipeline-layers-per-stage", "4"]):
        with pytest.raises(SystemExit) as exit_:
            main(["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "16", "--mem", "80GB"] + extra)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("memplan: error:") and err.count("\n") == 1, (extra, err)


def test_the_table_shows_pp_and_the_schedule(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "16", "--mem", "60GB", "--gpu", GPU,
              "--seq-len", "1024", "--global-batch", "32", "--pp", "2", "--top", "3"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and all(c in out for c in ("pp", "schedule", "micro-batch", "1F1B"))
