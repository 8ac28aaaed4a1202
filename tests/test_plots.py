"""--plot and --plot-techniques: the files are written and readable, matplotlib loads only when asked."""

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("matplotlib")

from memplan.report.plots import pareto_front, technique_bytes  # noqa: E402
from memplan.presets.batch import make_config  # noqa: E402
from memplan.presets.catalog import load_model  # noqa: E402

LLAMA_8B = ("--model", "llama3-8b", "--impl", "hf-sdpa", "--tp", "1", "--pp", "1", "--no-sp", "--dp", "1",
            "--global-batch", "1", "--seq-len", "4096", "--recompute", "full", "--precision", "bf16-true",
            "--optimizer-impl", "fused", "--gpu", "h100-80gb")


def svg_texts(path):
    return " ".join("".join(el.itertext()) for el in ET.parse(path).iter() if el.tag.endswith("text"))


def read_png(path):
    from matplotlib.image import imread

    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    return image


def test_estimate_png_and_svg(run_cli, tmp_path):
    png, svg = tmp_path / "step.png", tmp_path / "step.svg"
    code, out, err = run_cli("estimate", "--model", "gpt3-530b", "--plot", str(png))
    assert code == 0 and err == "" and "fits" in out
    read_png(png)
    code, _, _ = run_cli("estimate", *LLAMA_8B, "--plot", str(svg))
    assert code == 0
    text = svg_texts(svg)
    # the H100's budget: CUDA's total_memory, 85,017,493,504 B (configs/gpus/h100-80gb.yaml) = 85.02 GB
    for label in ("memory (GB)", "weights", "optimizer states", "gradients", "saved activations",
                  "transient tensors", "cuBLAS workspace", "outside PyTorch", "budget 85.02 GB", "peak",
                  "pipeline stage", "step peak of tensors (GB)"):
        assert label in text, label


def test_search_svg_is_small(run_cli, tmp_path):
    svg = tmp_path / "search.svg"
    code, _, _ = run_cli("search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB", "--plot", str(svg))
    assert code == 0
    text = svg_texts(svg)
    for label in ("estimated step time (s)", "device memory needed per GPU (GB)", "plans that fit", "Pareto front",
                  "chosen", "budget 80.00 GB"):
        assert label in text, label
    assert svg.stat().st_size < 1_500_000  # 179,129 plans, drawn as a rasterized histogram


def test_techniques_png(run_cli, tmp_path):
    png = tmp_path / "k22.png"
    code, _, _ = run_cli("estimate", "--model", "gpt3-530b", "--plot-techniques", str(png), "--format", "json")
    assert code == 0
    read_png(png)


def test_technique_bytes_are_k22_table2():
    # MT-NLG 530B (K22 Table 3): s=2048, b=1, h=20480, a=128, t=8; sbh = 41,943,040 and 5as/h = 64.
    sbh = 2048 * 1 * 20480
    rows = technique_bytes(make_config(load_model("gpt3-530b")))
    assert [r.bytes for r in rows] == [
        sbh * (34 + 64),  # no parallelism: sbh(34 + 5as/h)
        sbh * (10 + 3 + 8),  # TP: sbh(10 + 24/t + 5as/(ht))
        sbh * 49 // 4,  # TP + SP: sbh(34/t + 5as/(ht)) = sbh * 12.25
        sbh * 13,  # TP + selective: sbh(10 + 24/t)
        sbh * 17 // 4,  # TP + SP + selective: 34sbh/t
        sbh * 2,  # full recompute: 2sbh
    ]


def test_pareto_front():
    import numpy as np

    memory = np.array([10, 20, 30, 40, 15])
    time = np.array([9.0, 5.0, 6.0, 1.0, 9.5])
    # by memory: 10 (9.0) front; 15 (9.5) slower; 20 (5.0) front; 30 (6.0) slower; 40 (1.0) front
    assert list(pareto_front(memory, time)) == [0, 1, 3]


def test_missing_matplotlib_is_one_line(run_cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    code, _, err = run_cli("estimate", "--model", "gpt3-530b", "--plot", str(tmp_path / "x.png"))
    assert code == 2
    assert err.strip() == "memplan: error: --plot needs matplotlib: pip install 'memplan[plot]'"


@pytest.mark.parametrize("args", [("estimate", "--model", "gpt3-530b", "--plot", "x.pdf"),
                                  ("estimate", "--model", "gpt3-530b", "--plot-techniques", "no/such/dir/x.png"),
                                  ("search", "--gpus", "8", "--mem", "80GB", "--plot", "x.png")])
def test_bad_plot_requests(run_cli, args):
    code, out, err = run_cli(*args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("memplan: error:")


def test_core_commands_never_import_matplotlib():
    script = ("import sys\nfrom memplan.cli import main\n"
              "for args in (['estimate', '--model', 'gpt3-530b'], ['estimate', '--model', 'gpt3-530b', '--format', 'csv'],"
              " ['explain', '--model', 'gpt3-530b']):\n"
              "    try:\n        main(args)\n    except SystemExit as e:\n        assert e.code == 0, e.code\n"
              "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch')))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("LOADED []")
