"""`--inventory FILE`: a traced inventory written by `memplan trace --out` (here the one shipped for Qwen3-8B, which
`memplan trace --hf-config configs/traced/qwen3-8b/config.json --impl hf-sdpa --kernels cuda --out ...` wrote) is
what estimate / search count for --impl hf-*, in place of the shipped or cached trace; a file of another
implementation or model is refused."""

import re
import shutil
from pathlib import Path

import pytest

from memplan.api.estimating import estimate

TRACED = Path(__file__).resolve().parent.parent / "configs" / "traced" / "qwen3-8b"
CONFIG = str(TRACED / "config.json")
PLAN = dict(hf_config=CONFIG, impl="hf-sdpa", seq_len=4096, micro_batch=1, global_batch=8)


@pytest.fixture(scope="module")
def inventory(tmp_path_factory):
    path = tmp_path_factory.mktemp("inventory") / "my-trace.yaml"
    shutil.copyfile(TRACED / "hf-sdpa-cuda.yaml", path)
    return path


def test_the_file_is_what_is_counted(inventory, tmp_path):
    shipped = estimate(**PLAN).estimate
    given = estimate(inventory=str(inventory), **PLAN)
    assert given.config.model.inventory == str(inventory)
    assert given.estimate.per_layer_bytes == shipped.per_layer_bytes  # the same trace, read from the file given
    assert given.estimate.device.total == shipped.device.total
    # a copy in which every saved tensor has twice the elements: the estimate follows the file
    edited = tmp_path / "edited.yaml"
    edited.write_text(re.sub(r"(\n\s+elements: )'?([^'\n]+)'?", r"\1'\2 + \2'", inventory.read_text()))
    assert estimate(inventory=str(edited), **PLAN).estimate.per_layer_bytes == 2 * shipped.per_layer_bytes


def test_search_uses_it(inventory, run_cli):
    code, out, err = run_cli("search", "--hf-config", CONFIG, "--impl", "hf-sdpa", "--inventory", str(inventory),
                             "--gpus", "8", "--gpu", "h100-80gb", "--json")
    assert code == 0 and '"plans"' in out


@pytest.mark.parametrize("extra, fragment", [
    (["--hf-config", CONFIG, "--impl", "hf-eager"], "was traced for --impl hf-sdpa"),
    (["--hf-config", CONFIG], "plan with --impl hf-sdpa or hf-eager (got --impl megatron)"),
    (["--model", "llama3-8b", "--impl", "hf-sdpa"], "has 36 layers, the model 32"),
    (["--impl", "hf-sdpa"], "give --model or --hf-config"),
])
def test_refusals(inventory, run_cli, extra, fragment):
    code, out, err = run_cli("estimate", "--inventory", str(inventory), *extra)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and fragment in err, err


def test_not_a_file(run_cli, tmp_path):
    code, _, err = run_cli("estimate", "--hf-config", CONFIG, "--impl", "hf-sdpa", "--inventory",
                           str(tmp_path / "none.yaml"))
    assert code == 2 and "no such file" in err
