"""A wheel works on its own: built from this checkout, installed into a fresh virtual environment
(no torch, no checkout on the path), it ships the presets and no generic top-level package."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_and_runs(tmp_path, announce):
    # no checkout on the path: with PYTHONPATH at a checkout (its memplan.egg-info) pip finds memplan installed and
    # skips the wheel, and the commands below would import the checkout's memplan
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    dist = tmp_path / "dist"
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    with announce("building a wheel and installing it with its dependencies in a fresh venv"):
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
                       check=True, capture_output=True, timeout=600)
        wheel = next(dist.glob("memplan-*.whl"))
        # a venv without pip of its own (ensurepip's copy of pip: ~5 s of CPU), the wheel and its dependencies
        # installed into it by this interpreter's pip (--python: pip >= 22.3), not byte-compiled ahead (~4 s of CPU;
        # Python compiles what the commands below import): 21 -> 11 s of CPU in all
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile",
                        str(wheel)], check=True, capture_output=True, timeout=600, env=clean)
    memplan = venv / "bin" / "memplan"
    # run away from the checkout, so nothing can come from it
    out = subprocess.run([str(memplan), "models", "--json"], env=clean, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    names = {row["name"] for row in json.loads(out.stdout)}
    assert names == ({p.stem for p in (ROOT / "configs" / "models").glob("*.yaml")} |
                     {p.parent.name for p in (ROOT / "configs" / "traced").glob("*/config.json")})
    # a shipped traced inventory is read from the wheel, with no torch and no transformers
    out = subprocess.run([str(memplan), "estimate", "--model", "qwen2.5-7b", "--impl", "hf-sdpa"], env=clean,
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "traced from transformers" in out.stdout, out.stderr
    out = subprocess.run([str(memplan), "estimate", "--model", "gpt3-530b"], env=clean, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "fits in" in out.stdout, out.stderr
    site = Path(subprocess.run([str(python), "-c", "import memplan, pathlib; print(pathlib.Path(memplan.__file__)"
                                ".parent.parent)"], env=clean, cwd=tmp_path, capture_output=True, text=True,
                               check=True).stdout.strip())
    assert site.is_relative_to(venv)
    assert not (site / "validation").exists() and (site / "memplan_validation").is_dir()
    assert (site / "memplan" / "_configs" / "gpus" / "h100-80gb.yaml").is_file()
