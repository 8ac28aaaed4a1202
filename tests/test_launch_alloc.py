"""`--emit megatron` exports the caching allocator's settings a plan fits with (issue 20): PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True when the replay dies with the default allocator and completes with expandable segments, or
when the plan was made with --allocator expandable / --alloc-conf; nothing when the default allocator will do."""

import json

import pytest

from memplan.api.estimating import estimate
from memplan.launch.megatron import ALLOC_CONF
from memplan.memory.alloc_conf import parse_alloc_conf
from memplan.memory.reserved import launch_alloc_conf

# Llama 3 8B, t = 2, d = 4, ZeRO 1 on an H100 80GB: at s = 15,744 memplan's replay dies with the default allocator and
# completes with expandable segments; at 8,192 it completes with the default one (the test checks both verdicts
# before it checks the launch, so a change of the model moves the length, not what the test asserts).
PLAN = dict(gpu="h100-80gb", tp=2, pp=1, dp=4, zero=1, global_batch=64)
MARGIN, EASY = 15744, 8192


def test_conf_of_the_launch():
    assert launch_alloc_conf("default", None) == ""
    assert launch_alloc_conf("default", None, expandable_fits=False) == ""
    assert launch_alloc_conf("default", None, expandable_fits=True) == "expandable_segments:True"
    assert launch_alloc_conf("expandable", None) == "expandable_segments:True"
    assert launch_alloc_conf("default", "max_split_size_mb:512") == "max_split_size_mb:512"
    conf = launch_alloc_conf("expandable", "max_split_size_mb:512")
    assert conf == "max_split_size_mb:512,expandable_segments:True"
    parsed = parse_alloc_conf(conf)  # what PyTorch reads back: both settings
    assert parsed.expandable_segments and parsed.max_split_size_bytes == 512 * 2**20
    assert launch_alloc_conf("expandable", "expandable_segments:True") == "expandable_segments:True"  # once


def test_estimate_exports_expandable_segments_when_only_they_fit():
    result = estimate("llama3-8b", seq_len=MARGIN, emit="megatron", **PLAN)
    reserved = result.estimate.reserved
    assert reserved is not None and not reserved.fits and reserved.expandable_fits
    assert result.launch.env[ALLOC_CONF] == "expandable_segments:True"
    assert any(ALLOC_CONF in n for n in result.launch.notes)
    assert f"export {ALLOC_CONF}=expandable_segments:True" in result.launch.block().splitlines()
    easy = estimate("llama3-8b", seq_len=EASY, emit="megatron", **PLAN)
    assert easy.estimate.reserved.fits and ALLOC_CONF not in easy.launch.env
    planned = estimate("llama3-8b", seq_len=MARGIN, emit="megatron", allocator="expandable", **PLAN)
    assert planned.estimate.reserved.fits and planned.launch.env[ALLOC_CONF] == "expandable_segments:True"


def test_cli_estimate_emit(run_cli):
    args = ("estimate", "--model", "llama3-8b", "--gpu", "h100-80gb", "--tp", "2", "--pp", "1", "--dp", "4", "--zero",
            "1", "--global-batch", "64", "--seq-len", str(MARGIN), "--emit", "megatron")
    code, out, err = run_cli(*args, "--emit-only")
    assert code == 0 and out.splitlines()[:2] == ["export CUDA_DEVICE_MAX_CONNECTIONS=1",
                                                  f"export {ALLOC_CONF}=expandable_segments:True"]
    assert f"memplan: note: {ALLOC_CONF}=expandable_segments:True" in err
    code, out, _ = run_cli(*args, "--json")
    assert json.loads(out)["launch"]["env"][ALLOC_CONF] == "expandable_segments:True"
    code, out, _ = run_cli(*args)
    assert "# llama3-8b: the plan as Megatron-LM arguments" in out and out.rstrip().endswith("--bf16")


@pytest.mark.parametrize("extra, fragment", [
    (["--emit-only"], "--emit-only needs --emit megatron"),
    (["--emit", "megatron", "--format", "csv"], "--emit megatron cannot follow CSV"),
    (["--emit", "megatron", "--impl", "hf-sdpa"], "plan it with --impl megatron"),
])
def test_cli_estimate_bad_emit(run_cli, extra, fragment):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--gpu", "h100-80gb", *extra)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and fragment in err


def test_search_exports_the_allocator_it_was_planned_with(run_cli):
    base = ("search", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--tp", "2", "--pp", "1", "--zero",
            "1", "--top", "1", "--emit", "megatron", "--json")
    code, out, _ = run_cli(*base, "--allocator", "expandable")
    assert json.loads(out)["launch"]["env"][ALLOC_CONF] == "expandable_segments:True"
    code, out, _ = run_cli(*base)
    assert ALLOC_CONF not in json.loads(out)["launch"]["env"]
