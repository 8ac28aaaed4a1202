"""Issues 20 and 24, review of the day's options at their edges (search --impl torchtitan's --float8 any, --ac budget:F,
--mtp, DeepSeek-V3's multi-stage schedules, torchtitan-only options elsewhere): each case failed before its fix (the
comment says how). Refusals are one stderr line and exit 2; the notes say what the search did."""

import re

import pytest

from memplan import search

BASE = dict(impl="torchtitan", gpus=8, global_batch=16, gpu="h100-80gb", mem="80GB")

REFUSED = [
    # torchtitan's own options were ignored by search with another --impl (estimate refused them): exit 0
    (["search", "--model", "llama3-8b", "--gpus", "8", "--ac", "full"], "--impl torchtitan"),
    (["search", "--gpus", "8", "--dp-replicate", "2"], "--impl torchtitan"),
    (["search", "--model", "llama3-8b", "--gpus", "8", "--pipeline-layers-per-stage", "2"], "--impl torchtitan"),
    (["search", "--model", "llama3-8b", "--impl", "hf-sdpa", "--gpus", "8", "--ac", "full"], "--impl torchtitan"),
    # a 20-digit --mtp was an OverflowError traceback in the step's events (estimate)
    (["estimate", "--model", "deepseek-v3", "--impl", "torchtitan", "--gpus", "256", "--ep", "8", "--tp", "2",
      "--mtp", "9" * 20], "at most 16,384"),
    (["search", "--model", "deepseek-v3", "--impl", "torchtitan", "--gpus", "256", "--mtp", "9" * 20],
     "at most 16,384"),
    # a size of 0: torchtitan's search divided by --tp 0 (ZeroDivisionError traceback), estimate took --pp 0 as 1
    # (exit 0) and said "sequence parallelism needs tensor parallelism" of --tp 0; every count option >= 1
    (["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--tp", "0"], "--tp 0: at least 1"),
    (["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--pp", "0"], "--pp 0: at least 1"),
    (["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--tp", "0"], "--tp 0: at least 1"),
    (["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--dp-replicate", "0"],
     "--dp-replicate 0: at least 1"),
    # --max-seq kept the sequences the asked tokens made at the preset's s: 488 x 241,536 = 117.87 M tokens a step
    # for --global-batch-tokens 4M (exit 0, said only in a note)
    (["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--max-seq", "--global-batch-tokens",
      "4M"], "give --global-batch N"),
    (["search", "--model", "llama3-8b", "--gpus", "8", "--max-seq", "--global-batch-tokens", "4M"],
     "give --global-batch N"),
    # a pinned schedule no pp is searched with answered "dp_replicate R must divide d ...; 1F1B needs as many
    # micro-batches as pipeline stages"; now the reason the pipelines were left out
    (["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--pipeline-schedule", "ZBVZeroBubble",
      "--compile"], "a split-backward schedule with --compile"),
    (["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--pipeline-schedule",
      "Interleaved1F1B", "--float8", "rowwise"], "pipeline parallelism not searched with float8 linears"),
    (["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "1", "--pipeline-schedule",
      "Interleaved1F1B"], "needs pp >= 2 dividing the GPUs"),
    # 256 GPUs do not split into 3 stages: the EP check answered first, of "the 85 ranks of an FSDP shard group"
    (["estimate", "--model", "deepseek-v3", "--impl", "torchtitan", "--gpus", "256", "--pp", "3", "--ep", "8",
      "--pipeline-schedule", "Interleaved1F1B", "--global-batch", "768"], "GPU count 256 is not divisible"),
]


@pytest.mark.parametrize("args,fragment", REFUSED, ids=[" ".join(a)[-50:] for a, _ in REFUSED])
def test_refused_in_one_line(run_cli, args, fragment):
    code, _, err = run_cli(*args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("memplan: error:"), err[-2000:]
    assert fragment in lines[0] and "Traceback" not in err, lines[0]


def test_float8_any_keeps_pipelined_plans_in_bf16_and_says_so():
    # before: the note said "pipeline parallelism not searched with --float8" while --float8 any searched the pp 2,
    # 4, 8 plans with bf16 linears; only the float8 recipes leave pipeline parallelism out
    found = search("llama3-8b", float8="any", tp=1, dp_replicate=1, ac="full", compile=False, micro_batch=1,
                   **BASE).result
    rows = [(found.row(i)["pp"], found.float8[i]) for i in range(found.candidates)]
    assert {r for p, r in rows if p > 1} == {""} and {r for p, r in rows if p == 1} == {"", "tensorwise", "rowwise"}
    assert not any("not searched with --float8" in n for n in found.notes)
    assert "pipeline parallelism not searched with float8 linears (not modelled with --pp)" in found.notes


def test_float8_any_with_a_pinned_memory_budget_says_float8_is_not_searched():
    # before: "--float8 any: bf16 and the float8 recipes tensorwise and rowwise searched" beside a pinned
    # --ac budget:F, which is traced with bf16 linears only (estimate refuses --float8 with it): every plan bf16
    found = search("llama3-8b", float8="any", ac="budget:0.5", tp=1, dp_replicate=1, micro_batch=1, pp=1,
                   **BASE).result
    assert found.candidates > 0 and set(found.float8) == {""}
    assert not any("tensorwise and rowwise searched" in n for n in found.notes)
    assert "--float8 any: float8 not searched (--ac budget:F is traced with bf16 linears)" in found.notes


def test_torchtitan_notes_do_not_call_measured_moments_derived(run_cli):
    # before: "the step's transient tensors of this implementation are derived from its code, not measured" (keyed on
    # the first moment, the loss's) beside "the compiled blocks' backward moments measured on CPU from Inductor's
    # generated backward"; torchtitan's own note says which are measured and which derived
    for extra in ([], ["--compile"]):
        code, out, _ = run_cli("estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", *extra)
        text = " ".join(out.split())
        assert code == 0 and re.search("backward moments (measured|traced) on CPU", text), extra
        assert "derived from its code, not measured" not in text, extra
    code, out, _ = run_cli("estimate", "--model", "gpt-22b")  # Megatron-LM's moments: derived, and said so
    assert code == 0 and "derived from its code, not measured" in " ".join(out.split())


def test_multi_stage_peak_note_names_each_chunk(run_cli):
    # before: "16 micro-batch(es) of its 2-layer chunk, 16 micro-batch(es) of its 2-layer chunk", the two chunks of
    # the rank alike; torchtitan's Interleaved1F1B at p = 16 puts 2 stages (chunks) on a rank, each named now
    code, out, _ = run_cli("estimate", "--model", "deepseek-v3", "--impl", "torchtitan", "--gpus", "256", "--pp", "16",
                           "--pipeline-schedule", "Interleaved1F1B", "--ep", "16", "--global-batch", "256")
    text = " ".join(out.split())
    assert code == 0 and re.search(r"of its chunk 1 \(\d+ layers\), \d+ micro-batch\(es\) of its chunk 2 \(", text)


def test_multi_stage_schedules_bounded_in_micro_batches(capsys):
    # the multi-stage schedules' orders are walked op by op: M = global batch / (d b) = 40,960 / (4 x 1) = 10,240
    # micro-batches is over memplan's 8,192 (pipeline_multi.MAX_MICROBATCHES): refused in one line, where the walk
    # took minutes and gigabytes (search --seq-len 1 ran ~13 min, ~3 GB before the cap)
    from memplan.cli import main as cli_main
    from memplan.memory.pipeline_multi import MAX_MICROBATCHES, multi_refusal

    assert multi_refusal(2, 2, MAX_MICROBATCHES, "Interleaved1F1B") == ""
    assert "8,192" in multi_refusal(2, 2, MAX_MICROBATCHES + 2, "Interleaved1F1B")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--pp", "2",
                  "--pipeline-schedule", "Interleaved1F1B", "--global-batch", "40960", "--micro-batch", "1",
                  "--seq-len", "128"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "8,192" in err
