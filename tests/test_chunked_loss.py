"""`--loss-chunks N` for --impl torch (MEASURED: the reference model's tied head and vocab-parallel cross-entropy
in checkpointed chunks, validation/losses.py, against memplan's step peak) and --impl megatron (DERIVED from that
measurement, checked here by hand). memplan/inventory/chunked_loss.py."""

import dataclasses

import pytest

from memplan.inventory import chunked_loss
from memplan.plan.estimate import estimate
from memplan.core.model import ModelSpec
from memplan.core.specs import Config
from memplan.core.training import TrainingSpec

LLAMA = ModelSpec(name="small-llama", num_layers=2, hidden_size=256, num_attention_heads=8, num_kv_heads=2,
                  ffn_hidden_size=512, seq_length=256, vocab_size=4096, norm="rmsnorm", mlp="swiglu",
                  position_embedding="rope", tied_embeddings=False, dropout=False, bias=False, attention="flash")
s, b, h, v = 256, 1, 256, 4096


def loss_minus_forward(chunks: int, phase: str = "loss") -> int:
    """Megatron: bytes of the step's first event of `phase` (the loss forward) minus the last layer's forward
    event and the head's saved terms: the loss moment's transients."""
    est = estimate(Config(model=LLAMA, training=TrainingSpec(loss_chunks=chunks)), device="cpu")
    events = est.step.events
    forward = max((e for e in events if e.phase == "forward"), key=lambda e: e.layer)
    loss = next(e for e in events if e.phase == phase and e.layer is None)
    head = sum(est.peak.term_bytes[t.id] for t in est.inventory.terms if t.scope == "last")
    return loss.bytes - forward.bytes - head


def test_megatron_chunked_loss_forward_by_hand():
    # one chunk of c = sb/N tokens: its logits (2 bytes), their fp32 copy (4) and the softmax buffer (4): 10 c v
    assert loss_minus_forward(4) == 10 * s * b * v // 4
    # the whole loss (N = 1): logits and their fp32 copy (6 s b v) beside the saved fp32 softmax (a head term)
    assert loss_minus_forward(1) == 6 * s * b * v


def test_megatron_chunked_loss_backward_by_hand():
    # the recompute of the last chunk back-propagated: the same 10 c v, beside the input gradients of the N - 1
    # chunks before it (2 bytes x (N - 1) c h); no weight-gradient tensor (Megatron-LM's fused wgrad accumulation)
    est = estimate(Config(model=LLAMA, training=TrainingSpec(loss_chunks=4)), device="cpu")
    moment = next(m for m in est.inventory.moments if m.id == "loss_backward")
    values = LLAMA.symbols(b=b, t=1)
    assert sum(t.bytes(values, 2, 0) for t in moment.transients) == 10 * s * b * v // 4 + 2 * 3 * s * b * h // 4
    assert "target_ids" in est.peak.term_bytes and "logits_fp32" not in est.peak.term_bytes


def test_removing_the_chunk_softmax_fails_the_hand_derivation(monkeypatch):
    original = chunked_loss.chunked_loss_moments

    def without(*args, **kwargs):
        return [dataclasses.replace(m, transients=tuple(t for t in m.transients if t.id != "softmax_chunk"))
                for m in original(*args, **kwargs)]

    monkeypatch.setattr(chunked_loss, "chunked_loss_moments", without)
    assert loss_minus_forward(4) != 10 * s * b * v // 4


# --- measured: the reference model (--impl torch) --------------------------------------------------------------
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")  # memplan.validate's peak harness imports the HF side too

from memplan.check.peak import PEAK_TOLERANCE, peak_grid, run_peak  # noqa: E402

CASES = [c for c in peak_grid(fake=False) if c.model == "k22" and c.loss_chunks > 1]


@pytest.fixture(scope="module")
def measured(peak_steps):
    return peak_steps(CASES)  # measured once with tests/test_validate_peak.py's grid


def test_reference_chunked_loss_peaks_as_measured(measured):
    # three cases of `memplan validate --peak`: chunks of 64 tokens (with and without full recompute) and of 8
    assert len(measured) == 3
    for r in measured:
        assert r.passed and abs(r.error) <= PEAK_TOLERANCE, (r.case.name, r.predicted, r.measured, r.error)
        assert r.predicted_at == r.measured_at == "backward"
    # the 64-token chunks peak at a chunk's recompute, the 8-token ones at the head's weight-gradient sum
    moments = {r.case.name: r.predicted_moment for r in measured}
    assert "recompute" in moments["k22 s256 v8192 N4"] and "weight gradient" in moments["k22 s64 h128 N8"]


@pytest.mark.parametrize("term, which", [("softmax_chunk", "N4"), ("grad_head_weight_new_sum", "N8")])
def test_removing_a_chunk_transient_fails(measured, monkeypatch, term, which):
    original = chunked_loss.chunked_loss_moments

    def without(*args, **kwargs):
        return [dataclasses.replace(m, transients=tuple(t for t in m.transients if t.id != term))
                for m in original(*args, **kwargs)]

    monkeypatch.setattr(chunked_loss, "chunked_loss_moments", without)
    from memplan.check.peak import predict_peak

    cases = [r for r in measured if which in r.case.name]
    assert cases
    for r in cases:
        assert abs(int(predict_peak(r.case).peak_bytes) - r.measured) > PEAK_TOLERANCE * r.measured, r.case.name


def test_chunking_lowers_the_measured_peak(measured):
    chunked = next(r for r in measured if r.case.name == "k22 s256 v8192 N4")
    whole = run_peak([dataclasses.replace(chunked.case, loss_chunks=1)])[0]
    assert whole.passed and chunked.measured < 0.65 * whole.measured


def test_chunked_loss_step_time_by_hand():
    # each chunk's forward re-run in the backward (derived): one more logits GEMM, 2 s h v FLOPs at matmul_efficiency,
    # 4N - 3 more GEMM kernels (matmul_overhead_s each) and the forward cross-entropy's bytes once more, (A + 4 x 9)
    # per logit, per micro-batch (t = 1, b = 1, M micro-batches)
    from memplan.memory.term_bytes import PlanValues
    from memplan.timing.step import step_time
    from memplan.presets.catalog import load_gpu

    gpu = load_gpu("h100-80gb")
    M, N = 4, 8
    plan = PlanValues(1, 1, 1, 1, 0, 0, 1, 1, 0, 2, M)
    one = step_time(LLAMA, TrainingSpec(global_batch=M), gpu, plan, M)
    chunked = step_time(LLAMA, TrainingSpec(global_batch=M, loss_chunks=N), gpu, plan, M)
    gemm = 2 * s * h * v / (gpu.peak_bf16_flops * gpu.matmul_efficiency) + (4 * N - 3) * gpu.matmul_overhead_s
    traffic = s * v * (2 + 4 * 9) / (gpu.memory_bandwidth * gpu.memory_bound_efficiency)
    assert chunked.compute_s - one.compute_s == pytest.approx(M * gemm, rel=1e-4)
    assert chunked.memory_s - one.memory_s == pytest.approx(M * traffic, rel=1e-4)


def test_hf_layers_backward_holds_the_lm_head_gradient_whatever_the_chunks():
    # --impl hf-sdpa, one micro-batch (torch .grad tensors): the LM head's weight gradient (v x h bf16) is made in the
    # loss's backward, chunked or not, and is alive in every layer's backward after it; the layers' own gradients
    # made by then do not depend on the loss either. So each layer-backward event holds the same gradient bytes with
    # N = 1 and N = 4, and the last layer's first backward event holds at least the head's v h 2 bytes (the chunked
    # loss once counted it only from the embedding's backward). The final RMSNorm's backward (five fp32 s b h
    # tensors) runs after the head's with either loss.
    def events(chunks):
        est = estimate(Config(model=LLAMA, training=TrainingSpec(loss_chunks=chunks, precision="bf16-true")),
                       impl="hf-sdpa", device="cpu")
        return est.step.events

    def layer_grads(evs):
        return [(e.layer, e.moment, e.parts["gradients"]) for e in evs if e.phase == "backward" and e.layer]

    whole, chunked = events(1), events(4)
    assert layer_grads(whole) == layer_grads(chunked)
    first = next(e for e in chunked if e.phase == "backward" and e.layer == LLAMA.num_layers)
    assert first.parts["gradients"] >= v * h * 2
    norm = [e for e in chunked if e.moment.startswith("final norm backward")]
    assert len(norm) == 1 and norm[0].parts["transient"] >= 5 * s * b * h * 4
