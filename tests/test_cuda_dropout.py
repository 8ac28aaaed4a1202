"""`--kernels cuda` traces against what CUDA's kernels saved on a GPU (issue 22 item 4; validation/cuda_dropout.py).

tests/data/cuda_dropout.json holds the measurement: the tiny configs of validation/trace_config.py FAMILIES with
attention dropout 0 and 0.1 (validation/cuda_dropout.py ``cases``) run for one training forward + loss at s = 64, b = 2, bf16,
on an NVIDIA H100 (torch 2.11.0+cu130, cuDNN 9.19), each decoder layer's saved bytes read off the tensors autograd
keeps (validation/trace_measure.py ``measure_hf_config`` on cuda); sdpa ran with torch's own choice of kernel (``default``:
cuDNN attention on that H100) and with flash / memory-efficient / cuDNN forced (``torch.nn.attention.sdpa_kernel``;
a kernel that refused the call is recorded as its error). Measured with
    PYTHONPATH=. python -m validation.cuda_dropout predict --out P.json            (CPU)
    PYTHONPATH=. python -m validation.cuda_dropout measure --predictions P.json --out M.json   (GPU)
and M.json's rows kept without the predictions (memplan's own output, never an expected value).

Each test traces one case with ``kernels="cuda"`` (the emulation, validation/trace_cuda.py ``CudaKernels``) and the
sdpa kernels of the row (default: torch's order on an H100, ``SDPA_ORDER``; a forced kernel: that one alone), and
checks every layer's bytes, the bytes outside the layers and the total against the measured row exactly; a row
where the forced kernel refused must refuse in the emulation too.
"""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from validation import trace as tr  # noqa: E402
from validation import trace_cuda as tcu  # noqa: E402
from validation import trace_measure as tm  # noqa: E402
from validation.cuda_dropout import cases  # noqa: E402

DATA = json.loads((Path(__file__).parent / "data" / "cuda_dropout.json").read_text())
ROWS = {(r["name"], r["backend"]): r for r in DATA["rows"]}
ORDER = {"default": tcu.SDPA_ORDER, "flash": ("flash",), "efficient": ("efficient",), "cudnn": ("cudnn",)}

# a representative subset (the whole table: about 80 traces); what each row exercises
CHECKED = [
    ("qwen2", "default"),  # GQA, no mask (is_causal): cuDNN attention, its int64 seed + offset (16 B)
    ("qwen2 p0.1", "default"),  # the same with dropout: Philox state only, no s x s tensor
    ("qwen2 p0.1", "flash"),  # flash forced: uint64 rng_state [2] + [] (24 B)
    ("qwen2", "efficient"),  # efficient forced with GQA: no kernel (it takes no enable_gqa)
    ("qwen2-eager p0.1", "default"),  # eager attention's dropout: native_dropout's 1-byte bool mask
    ("gemma3 p0.1", "default"),  # sliding layers with a mask (cuDNN takes it) beside global ones
    ("deepseek-v3", "default"),  # MLA (d_qk 24, d_v 16): cuDNN's output in q's layout, copied before o_proj
    ("deepseek-v3 p0.1", "efficient"),  # efficient forced: what the flash-first order runs for MLA
]


def test_the_fixture_is_the_measurement():
    assert (DATA["device"], DATA["torch"], DATA["cudnn"], DATA["s"], DATA["b"]) == \
        ("NVIDIA H100 80GB HBM3", "2.11.0+cu130", 91900, 64, 2)
    assert all("predicted" not in r for r in DATA["rows"])
    assert set(CHECKED) <= set(ROWS)


@pytest.mark.parametrize("name,backend", CHECKED, ids=[f"{n}-{b}" for n, b in CHECKED])
def test_cuda_trace_equals_the_h100_measurement(name, backend):
    config, impl = cases()[name]
    row = ROWS[(name, backend)]
    if "error" in row:
        assert row["error"].startswith("No available kernel")
        with pytest.raises(RuntimeError, match="No available kernel"):
            tr.trace_hf_config(config, impl, kernels="cuda", moments=False, sdpa=ORDER[backend])
        return
    inv = tr.trace_hf_config(config, impl, kernels="cuda", moments=False, sdpa=ORDER[backend])
    assert tm.predicted_bytes(inv, DATA["s"], DATA["b"]) == row["measured"]
