"""torchtitan's memory-budget AC's recompute (memplan/inventory/budget_recompute.py): what the partitioner re-runs in
each compiled block's backward at F, traced at the Llama 3 8B / 70B / 405B widths (validation/budget_recompute.py),
checked against hand counts at F = 0, 0.7 and 1, and charged by the step time (memplan/timing/layer.py): the step
grows as F falls, F = 1 is the plain compiled block's. MEMPLAN_COMPILE_SLOW=1 re-traces the table (~35 s a width)."""

import os

import pytest

from memplan import estimate
from memplan.inventory import budget_recompute as br
from memplan.inventory.compiled import BUDGET_SAVED
from memplan.presets.catalog import load_model

WIDTHS = {"llama3-8b": (4096, 32, 8, 14336), "llama3-70b": (8192, 64, 8, 28672), "llama3.1-405b": (16384, 128, 8, 53248)}
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_COMPILE_SLOW"), reason="set MEMPLAN_COMPILE_SLOW=1 to run")


def _hand(h, a, g, f):
    """By hand, per token (d = h / a, q = h, kv = g d; bf16 2 B, the rstd fp32 4 B):
    F = 0 (only the block input saved): the backward needs every linear's input, sdpa's q, k, v, output and
    log-sum-exp, the norms' inputs and SwiGLU's gate and up, all recomputed from the input: wqkv, wo, w1, w3 re-run
    (w2's output only feeds the block's residual sum, whose backward needs no tensor), 2h(q + 2kv) + 2qh + 2 x 2hf
    FLOPs, and the attention. Its memory-bound ops read the input 2h, wqkv's output 2(q + 2kv), wo's 2h, w1's and
    w3's 2f each and the RoPE rows (s x d/2 complex64: 4d at b 1), and write what a matmul or sdpa reads: the two
    norms' outputs 2h each, rotated q and k and contiguous v 2q + 4kv, SwiGLU's product 2f.
    Below F = 1 the block (called with the dataloader's positions) also re-runs the RoPE gather: it reads the int64
    positions, 8, and the cache rows at them, 4d (complex64 d/2; the gathered rows only feed the rotation and its
    backward: not written).
    F = 0.7 (all but the norms' outputs and SwiGLU's product saved): no matmul; read the input 2h, wo's output 2h,
    the gate and up 2f each, the rstd 2 x 4; write the two norms' outputs 2h each and SwiGLU's product 2f.
    F = 1 (the plain compiled block, the gathered RoPE rows saved): no matmul; read the input 2h, wo's output 2h, the
    gate 2f, the rstd 2 x 4 (SiLU, the residual sums and the norms' fp32 products recomputed, fused into the
    backward's ops)."""
    d = h // a
    q, kv = h, g * d
    return {0: (2 * h * (q + 2 * kv) + 2 * q * h + 2 * 2 * h * f, 1,
                2 * h + 2 * (q + 2 * kv) + 2 * h + 4 * f + 8 + 4 * d + 2 * h + 2 * h + 2 * q + 4 * kv + 2 * f),
            7: (0, 0, 2 * h + 2 * h + 4 * f + 8 + 8 + 4 * d + 2 * h + 2 * h + 2 * f),
            10: (0, 0, 2 * h + 2 * h + 2 * f + 8)}


@pytest.mark.parametrize("name", WIDTHS)
def test_table_equals_hand_counts(name):
    model = load_model(name).model
    flops = br.linear_flops(model)
    for tenth, (matmul, attention, traffic) in _hand(*WIDTHS[name]).items():
        assert sum(flops[x] for x in br.BUDGET_LINEARS[tenth].split()) == matmul
        assert br.BUDGET_ATTENTION[tenth] == attention
        assert br.BUDGET_BYTES[WIDTHS[name]][tenth] == traffic
    # the attention kernel re-runs exactly where its output or log-sum-exp is not saved (compiled.BUDGET_SAVED)
    assert [int(not {"attn_out", "sdpa_logsumexp"} <= set(s.split())) for s in BUDGET_SAVED] == list(
        br.BUDGET_ATTENTION)
    # less saved, never less recomputed: FLOPs and bytes do not grow with F
    row = [sum(flops[x] for x in names.split()) for names in br.BUDGET_LINEARS]
    assert row == sorted(row, reverse=True)


def _perf(ac, **kw):
    return estimate("llama3-8b", impl="torchtitan", gpus=8, seq_len=4096, global_batch=8, gpu="h100-80gb", ac=ac,
                    compile=True, **kw).estimate.perf


def test_the_step_charges_the_recompute():
    plain = _perf("none")
    perf = {tenth: _perf(f"budget:{tenth / 10:g}") for tenth in (0, 3, 5, 7, 10)}
    # F = 1 is the plain compiled block: nothing more re-run
    assert perf[10].step_time_s == pytest.approx(plain.step_time_s, rel=1e-9) and perf[10].recompute_s == 0
    times = [perf[t].step_time_s for t in (0, 3, 5, 7, 10)]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]
    # the step's extra time is its recompute, and the hardware FLOPs grow by the re-run matmuls and attention
    assert perf[0].step_time_s - plain.step_time_s == pytest.approx(perf[0].recompute_s, rel=1e-6)
    model = load_model("llama3-8b").model.model_copy(update={"seq_length": 4096})
    h, s, layers = model.hidden_size, 4096, model.num_layers
    # F = 0 by hand: wqkv, wo, w1, w3 (2h(h + 2 x 1024) + 2h^2 + 4hf per token) and the attention core, 4 s^2 h per
    # sequence (the whole square, as hardware_flops counts a re-run attention), per layer, over the 8 sequences
    extra = 8 * layers * ((2 * h * (h + 2048) + 2 * h * h + 4 * h * 14336) * s + 4 * s * s * h)
    assert perf[0].hardware_flops - plain.hardware_flops == pytest.approx(extra, rel=1e-9)


def test_distinct_budgets_keep_one_plan_per_saved_set():
    # F = 0.7, 0.8, 0.9 save the same rows and re-run the same (one plan, named 0.7); F = 1 is plain compile
    assert br.distinct_budgets() == (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("name", WIDTHS)
def test_the_trace_gives_the_table(name):
    # the backward graph's re-run forward nodes at the model's widths, s 2,048 (~35 s of CPU for 8B, ~60 s for 405B)
    pytest.importorskip("torchtitan")
    from validation.budget_recompute import budget_recompute

    got = budget_recompute(*WIDTHS[name], 2048, tuple(i / 10 for i in range(11)))
    flops = br.linear_flops(load_model(name).model)
    for tenth, r in enumerate(got.values()):
        assert " ".join(sorted(br.BUDGET_LINEARS[tenth].split())) == " ".join(r["linears"])
        assert r["matmul_flops"] == sum(flops[x] for x in r["linears"])
        assert (r["attention"], r["memory_bytes"]) == (br.BUDGET_ATTENTION[tenth], br.BUDGET_BYTES[WIDTHS[name]][tenth])
