"""Measured saved tensors of the reference GPT layer / model against K22, term by term.

Every expected value below is a hand derivation from K22 (arXiv 2205.05198): the section 4.1
table of saved tensors (formulas.md section 2) with the Table 2 splits for tensor (t) and sequence
(SP) parallelism and recompute (formulas.md section 3), and the whole-model terms of section 4.3 /
5 (formulas.md section 4).  The exact extras torch saves that K22 ignores are written out as well.

All measurements run once per module (one process spawn per t), backend "live" = saved-tensor
ledger + live-storage tracker on real CPU bf16 tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from validation import LABELS, PARAMETER, Case, measure_layer, measure_many, measure_model  # noqa: E402
from validation.measure import probe_dropout  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (s, b, h, a, f, v): f=None means 4h
SHAPES = {
    "A": dict(s=64, b=2, h=64, a=4, v=512),
    "B": dict(s=32, b=3, h=128, a=8, v=384),
    "C_f160": dict(s=32, b=2, h=64, a=4, f=160, v=256),  # MLP width f != 4h
}
RECOMPUTES = ("none", "selective", "full")
L_MODEL = 2


def _grid():
    jobs = []
    for shape, dims in SHAPES.items():
        for t in (1, 2, 4):
            if shape == "C_f160" and t == 4:
                continue
            for sp in ((False,) if t == 1 else (False, True)):
                for rc in RECOMPUTES:
                    case = Case(**dims, L=L_MODEL, t=t, sp=sp, recompute=rc, backend="live")
                    jobs.append((case, "layer"))
                    if shape != "C_f160":
                        jobs.append((case, "model"))
    return jobs


JOBS = _grid()
IDS = [f"{sc}-s{c.s}b{c.b}h{c.h}a{c.a}f{c.ffn}-t{c.t}-{'sp' if c.sp else 'tp'}-{c.recompute}" for c, sc in JOBS]


@pytest.fixture(scope="module")
def measured(announce):
    with announce(f"measuring {len(JOBS)} reference-layer cases (t > 1 spawns gloo processes)"):
        results = measure_many(JOBS)
    return {(c, sc): m for (c, sc), m in zip(JOBS, results)}


# ---------------------------------------------------------------------------------------------
# expected values, derived by hand from K22


def expected_layer(c: Case) -> dict[str, int]:
    """Bytes per saved tensor of one layer on one rank (bf16 activations: 2 bytes, masks: 1).

    K22 section 4.1 table; Table 2: tensor parallelism splits everything between the column- and
    row-parallel linears by t and leaves the layer-norm inputs, the QKV / fc1 inputs and the two
    dropout masks after attention and MLP replicated (the "10sbh"); SP splits those along s.
    """
    s, b, h, a, f, t = c.s, c.b, c.h, c.a, c.ffn, c.t
    sp = c.sp and t > 1
    r = t if sp else 1  # the replicated region is split by t only with SP
    e = {
        "ln1_input": 2 * s * b * h // r,  # LN1 input 2sbh
        "qkv_input": 2 * s * b * h // r,  # QKV input 2sbh
        "qk": 4 * s * b * h // t,  # Q and K saved by QK^T 4sbh
        "softmax_out": 2 * a * s * s * b // t,  # softmax output 2as^2b
        "softmax_mask": a * s * s * b // t,  # softmax dropout mask as^2b
        "attn_dropout_out": 2 * a * s * s * b // t,  # dropout output 2as^2b (+ V below)
        "v": 2 * s * b * h // t,  # V 2sbh
        "proj_input": 2 * s * b * h // t,  # output projection input 2sbh
        "attn_dropout_mask": s * b * h // r,  # dropout mask after projection sbh
        "ln2_input": 2 * s * b * h // r,  # LN2 input 2sbh
        "fc1_input": 2 * s * b * h // r,  # fc1 input 2sbh
        "gelu_input": 2 * s * b * f // t,  # GeLU input 8sbh = 2sbf
        "fc2_input": 2 * s * b * f // t,  # fc2 input 8sbh = 2sbf
        "mlp_dropout_mask": s * b * h // r,  # MLP dropout mask sbh
        # --- extras K22 ignores, found by the ledger ---
        # LN mean and rstd: [s/r, b, 1] each, in the activation dtype on CPU (bf16, 2 bytes)
        "ln1_stats": 2 * (s // r) * b * 2,
        "ln2_stats": 2 * (s // r) * b * 2,
        # causal mask [s, s] bool saved by masked_fill; one storage shared by all layers
        "causal_mask": s * s,
    }
    if c.recompute == "selective":  # drop QK^T .. attention-over-V internals: the 5as^2b/t
        for k in ("softmax_out", "softmax_mask", "attn_dropout_out"):
            del e[k]  # Q, K, V and the mask stay: checkpoint keeps the region's inputs
    if c.recompute == "full":  # only the layer input (split with SP) and the shared mask
        e = {"ln1_input": e["ln1_input"], "causal_mask": e["causal_mask"]}
    return e


def expected_model(c: Case) -> dict[str, int]:
    """Whole model, first (only) pipeline stage, p = 1 (K22 section 4.3 and formulas.md section 4)."""
    s, b, h, v, t = c.s, c.b, c.h, c.v, c.t
    sp = c.sp and t > 1
    r = t if sp else 1
    per_layer = expected_layer(c)
    e = {k: c.L * n for k, n in per_layer.items() if k != "causal_mask"}
    e["causal_mask"] = s * s  # shared by the L layers: counted once
    e.update({
        "embedding_dropout_mask": s * b * h // r,  # K22: sbhp/t (they assume SP), 1-byte mask
        "final_ln_input": 2 * s * b * h // r,  # K22: 2sbh/t
        "head_input": 2 * s * b * h // r,  # K22: 2sbh/t (output projection input)
        "logits_fp32": 4 * s * b * v // t,  # K22: 4sbv/t (fp32 softmax of the logits)
        "token_ids": 8 * s * b,  # Megatron-LM's int64 token ids 8sb (t > 1: the shard-local copy)
        # --- extras ---
        "final_ln_stats": 2 * (s // r) * b * 2,
        "position_ids": 8 * s,  # int64 [b, s] expanded from arange(s): s elements of storage
        "target_ids": 8 * s * b,  # int64 shard-local targets kept by the cross-entropy
        "target_mask": s * b,  # bool out-of-shard target mask kept by the cross-entropy
    })
    if t > 1:
        e["embedding_input_mask"] = s * b  # bool out-of-shard token mask (index_put_ saves it)
    return e


def k22_layer_total(c: Case) -> int:
    """K22 Table 2 closed forms, in bytes (f = 4h)."""
    s, b, h, a, t = c.s, c.b, c.h, c.a, c.t
    sp = c.sp and t > 1
    if c.recompute == "full":
        return 2 * s * b * h // (t if sp else 1)  # 2sbh (split by SP in our layer: input is split)
    if c.recompute == "selective":
        return 34 * s * b * h // t if sp else (10 * s * b * h + 24 * s * b * h // t)
    if sp:
        return (34 * s * b * h + 5 * a * s * s * b) // t  # sbh(34/t + 5as/(ht))
    return 10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // t  # sbh(10 + 24/t + 5as/(ht))


def layer_extras(c: Case) -> int:
    """Exact extras over K22: LN stats (2 LNs x mean, rstd x [s/r, b] x 2 bytes) + causal mask s^2."""
    r = c.t if (c.sp and c.t > 1) else 1
    ln_stats = 0 if c.recompute == "full" else 2 * 2 * (c.s // r) * c.b * 2
    return ln_stats + c.s * c.s


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS, ids=IDS)
def test_ledger_matches_k22_term_by_term(measured, job):
    case, scope = job
    m = measured[job]
    expected = expected_layer(case) if scope == "layer" else expected_model(case)
    assert not m.unlabeled, m.unlabeled
    assert not m.notes, m.notes
    assert m.saved_bytes_by_label == expected
    assert set(m.saved_bytes_by_label) <= set(LABELS)


@pytest.mark.slow
@pytest.mark.parametrize("job", [j for j in JOBS if j[1] == "layer" and j[0].ffn == 4 * j[0].h],
                         ids=[i for i, j in zip(IDS, JOBS) if j[1] == "layer" and j[0].ffn == 4 * j[0].h])
def test_layer_total_is_k22_table2_plus_extras(measured, job):
    case, _ = job
    m = measured[job]
    assert m.saved_bytes_total == k22_layer_total(case) + layer_extras(case)
    if case.t == 1 and case.recompute == "none":  # Eq. 1: sbh(34 + 5as/h) = 34sbh + 5as^2b
        s, b, h, a = case.s, case.b, case.h, case.a
        assert m.saved_bytes_total - layer_extras(case) == 34 * s * b * h + 5 * a * s * s * b


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS, ids=IDS)
def test_live_tracker_agrees_with_ledger(measured, job):
    """Memory retained after forward = saved tensors + the scalar loss, nothing else."""
    m = measured[job]
    assert m.loss_bytes == (2 if job[1] == "layer" else 4)  # bf16 / fp32 scalar
    assert m.retained_after_forward_bytes == m.saved_bytes_total + m.loss_bytes
    assert m.peak_bytes >= m.retained_after_forward_bytes


@pytest.mark.slow
@pytest.mark.parametrize("job", [j for j in JOBS if j[0].t > 1], ids=[i for i, j in zip(IDS, JOBS) if j[0].t > 1])
def test_ranks_agree(measured, job):
    m = measured[job]
    assert m.world_size == job[0].t and m.rank == 0
    assert m.ranks_agree, m.per_rank_saved_bytes_total
    assert len(set(m.per_rank_saved_bytes_total)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS, ids=IDS)
def test_fake_equals_real(measured, job):
    """FakeTensorMode (SimulatedComm for t > 1) gives the real run's ledger and retained bytes."""
    case, scope = job
    real = measured[job]
    (fake,) = measure_many([(replace(case, backend="fake"), scope)])
    assert fake.entries == real.entries
    assert fake.retained_after_forward_bytes == real.retained_after_forward_bytes
    if case.t == 1:  # with gloo the peak may include a collective's buffers held a moment longer
        assert fake.peak_bytes == real.peak_bytes


def test_selective_and_full_recompute_keep_what_the_checkpoint_saves():
    c = Case(s=64, b=2, h=64, a=4, recompute="selective")
    ops = {e.label: e.op for e in measure_layer(c).entries}
    assert ops["qk"] == ops["v"] == ops["causal_mask"] == "checkpoint(inputs)"
    full = measure_layer(replace(c, recompute="full"))
    assert {e.label: e.op for e in full.entries if e.label != PARAMETER} == {
        "ln1_input": "checkpoint(inputs)", "causal_mask": "checkpoint(inputs)"}


def test_causal_mask_is_one_storage_shared_by_all_layers():
    m = measure_model(Case(s=32, b=2, h=64, a=4, v=256, L=3))
    (mask,) = m.entries_for("causal_mask")
    assert (mask.shape, mask.dtype, mask.bytes) == ((32, 32), "bool", 32 * 32)
    assert len(m.entries_for("ln1_input")) == 3  # while every layer has its own input


def test_dropout_masks_are_one_byte_bool():
    m = measure_layer(Case(s=32, b=2, h=64, a=4))
    for label in ("softmax_mask", "attn_dropout_mask", "mlp_dropout_mask"):
        (e,) = m.entries_for(label)
        assert e.dtype == "bool" and e.op == "torch.native_dropout"


def test_cpu_functional_dropout_does_not_reach_native_dropout():
    """Why layers.dropout calls native_dropout: on CPU F.dropout saves a bf16 mask (2 bytes)."""
    ops, saved = probe_dropout(native=False)
    assert "aten.native_dropout" not in ops and saved == ["bfloat16"]
    ops, saved = probe_dropout(native=True)
    assert ops == ["aten.native_dropout"] and saved == ["bool"]


def test_live_tracker_matches_torch_mem_tracker():
    """Independent check with torch.distributed._tools.mem_tracker (CPU, t = 1)."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    import gc

    from validation.measure import _build, _forward_fresh
    from validation.parallel import SimulatedComm

    case = Case(s=64, b=2, h=64, a=4, backend="live")
    ours = measure_layer(case)
    comm = SimulatedComm(0, 1)
    torch.manual_seed(0)
    layer = _build(case, "layer", comm, torch.bfloat16, "cpu")
    _forward_fresh(layer, case, "layer", comm, torch.bfloat16, "cpu").backward()
    for p in layer.parameters():
        p.grad = None
    gc.collect()
    mt = mem_tracker.MemTracker()
    mt.track_external(layer)
    with mt:
        loss = _forward_fresh(layer, case, "layer", comm, torch.bfloat16, "cpu")
        after = mt.get_tracker_snapshot("current")[torch.device("cpu")]
        loss.backward()
    peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
    param = mem_tracker._MemRefType.PARAM
    assert after[mem_tracker._MemRefType.ACT] == ours.retained_after_forward_bytes
    assert peak["Total"] - peak[param] == ours.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name,a,h", [("175B", 96, 12288), ("530B", 128, 20480)])
def test_fake_mode_runs_paper_scale_per_rank_layer(name, a, h):
    """K22 Table 3 layers, t = 8, s = 2048, b = 1: no allocation, seconds, exact K22 + extras."""
    t0 = time.time()
    for sp in (False, True):
        for rc in RECOMPUTES:
            c = Case(s=2048, b=1, h=h, a=a, t=8, sp=sp, recompute=rc, backend="fake")
            m = measure_layer(c)
            assert m.saved_bytes_by_label == expected_layer(c)
            assert m.saved_bytes_total == k22_layer_total(c) + layer_extras(c)
            assert m.retained_after_forward_bytes == m.saved_bytes_total + m.loss_bytes
    assert time.time() - t0 < 30


def test_validation_does_not_import_memplan():
    code = "import sys, validation, validation.measure, validation.__main__; assert 'memplan' not in sys.modules"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_python_m_validation_prints_a_table():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "validation", "--s", "16", "--h", "32", "--a", "2"],
                         check=True, cwd=root, capture_output=True, text=True).stdout
    assert "softmax_out" in out and "saved total" in out


def test_case_validation():
    with pytest.raises(ValueError):
        measure_layer(Case(s=63, b=1, h=64, a=4, t=2, sp=True, backend="fake"))
    with pytest.raises(ValueError):
        measure_layer(Case(s=64, b=1, h=64, a=4, recompute="some"))


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a device)


@pytest.mark.cuda
@needs_cuda
def test_cuda_functional_dropout_reaches_native_dropout():
    ops, saved = probe_dropout(native=False, device="cuda")
    assert "aten.native_dropout" in ops and saved == ["bool"]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("rc", RECOMPUTES)
def test_cuda_allocator_matches_ledger(rc):
    c = Case(s=64, b=2, h=64, a=4, recompute=rc, backend="cuda")
    m = measure_layer(c)
    expected = expected_layer(c)
    if rc != "full":  # CUDA layer norm keeps mean / rstd in fp32: 4 bytes, not 2
        expected["ln1_stats"] = expected["ln2_stats"] = 2 * c.s * c.b * 4
    # a zero-byte saved storage (a CUDA kernel's empty tensor) is listed with 0 bytes: it is no term
    assert {k: v for k, v in m.saved_bytes_by_label.items() if v} == expected
    # the caching allocator rounds every block up to 512 bytes
    n_blocks = len([e for e in m.entries if e.label != PARAMETER]) + 1
    assert 0 <= m.retained_after_forward_bytes - m.saved_bytes_total - m.loss_bytes < 512 * n_blocks
    assert m.peak_bytes >= m.retained_after_forward_bytes


@pytest.mark.slow
def test_parallel_layer_computes_the_single_rank_function():
    """TP and TP+SP (t = 2, gloo), every recompute mode: same output, input and weight grads."""
    from validation.equivalence import check_tensor_parallel_equivalence

    result = check_tensor_parallel_equivalence(t=2)
    assert all(result.values()), result
