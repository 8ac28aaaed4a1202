"""`memplan estimate --impl torchtitan` (memplan/inventory/titan.py through the API and the CLI): the layer's bytes
equal the per-token figures tests/test_titan.py measures against torchtitan's real block, written out by hand for
Llama 3 8B; FSDP2's states are memplan's ZeRO 3 over --gpus with torchtitan's fp32 shards and bf16 layers in flight;
what is not modelled is refused. No torch needed (the estimate never imports it)."""

import pytest

from memplan.api.estimating import estimate
from memplan.cli import main
from memplan.core.errors import MemplanError
from memplan.inventory import titan

S, B = 1024, 1  # tokens per micro-batch: s b = 1024
H, A, G, F, D, V = 4096, 32, 8, 14336, 128, 128256  # llama3-8b

# Bytes per token, from the slice's measured terms (tests/test_titan.py measures each term's per-token size on CPU
# against torchtitan's block; the same formulas at h = 64 give its 3032 / 128 / 976):
# none, CPU: 2 norms x (x fp32 4h + rstd 4 + x*rstd fp32 4h + out bf16 2h) = 2 x 40964 = 81928; the RoPE cache rows
#   gathered at the dataloader's positions (d/2 complex64) 4d = 512; rotated q 2ad = 8192, k 2gd = 2048, v contiguous
#   2048; attention out 2ad = 8192, lse 4a = 128; SwiGLU 4 x 2f = 114688: 217736
# none, CUDA: the fused RMSNorm keeps x (2h) and rstd (4), its output (2h) stays as the matmul's input:
#   2 x 16388 = 32776 in place of 81928: 168584 (derived)
# full: the block input 2h = 8192
# selective-op: input 8192 + wqkv 2(a + 2g)d = 12288 + out 8192 + lse 128 + w1 2f = 28672 + w2 2h = 8192: 65664
PER_TOKEN = {("none", "cpu"): 217736, ("none", "cuda"): 168584, ("full", "cpu"): 8192, ("full", "cuda"): 8192,
             ("selective-op", "cpu"): 65664, ("selective-op", "cuda"): 65664}


def _estimate(ac, device="cuda", **kw):
    return estimate("llama3-8b", impl="torchtitan", gpus=8, ac=ac, seq_len=S, micro_batch=B,
                    **{"global_batch": 8, "device": device, **kw}).estimate


@pytest.mark.parametrize("ac,device", sorted(PER_TOKEN))
def test_layer_bytes_equal_the_measured_terms(ac, device):
    est = _estimate(ac, device)
    assert est.per_layer_bytes == PER_TOKEN[ac, device] * S * B
    assert (est.config.parallel.tp, est.config.parallel.dp, est.config.parallel.zero) == (1, 8, 3)


def test_fsdp2_states_by_hand():
    st = _estimate("full").peak.states
    layer = 2 * H * H + 2 * H * G * D + 3 * H * F + 2 * H  # wq, wo; wk, wv; w1, w2, w3; two norms
    tail = V * H + H  # LM head, final norm
    total = V * H + 32 * layer + tail  # + the embedding
    # fp32 sharded parameters (the optimizer's) + AdamW's two moments: 12 B / 8; fp32 gradients 4 B / 8; no bf16
    # sharded copy; unsharded bf16: the running layer, the prefetched one, the head (not resharded after forward);
    # each layer's RoPE cache (s x d/2 complex64: 4 s d B; measured in tests/test_titan_step.py)
    assert st.optimizer == -(-12 * total // 8) and st.gradients == -(-4 * total // 8)
    assert st.weights == 2 * (2 * layer + tail) + 32 * 4 * S * D


def test_a_removed_term_fails(monkeypatch):
    full_terms = titan.llama3_layer_terms
    monkeypatch.setattr(titan, "llama3_layer_terms", lambda *a: [t for t in full_terms(*a) if t.id != "w1.out"])
    for ac in ("none", "selective-op"):
        assert _estimate(ac, "cpu").per_layer_bytes != PER_TOKEN[ac, "cpu"] * S * B


@pytest.mark.parametrize("args", [["--tp", "2", "--no-sp"], ["--pp", "2", "--pipeline-schedule", "ZBVZeroBubble", "--compile"],
                                  ["--pp", "4"], ["--cp", "2", "--cp-comm-type", "a2a"], ["--ac", "budget:0.5"],
                                  ["--recompute", "full"], ["--zero", "1"], ["--fp8", "delayed"],
                                  ["--compile", "--ac", "selective-op", "--float8", "rowwise"], ["--compile", "--cp", "2"],
                                  ["--compile", "--tp", "2", "--ac", "budget:0.5"], ["--model", "mixtral-8x7b"]])
def test_refused_in_one_line(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8"] + args)
    err = capsys.readouterr().err
    # --compile: traced with --cp 1 (memplan/inventory/compiled.py), with --float8 not under selective-op, budget AC
    # with --tp 1
    assert exit_.value.code == 2 and err.startswith("memplan: error:") and err.count("\n") == 1, err


@pytest.mark.parametrize("kw", [dict(tp=2, sp=False), dict(pp=2, pipeline_schedule="InterleavedZeroBubble", compile=True), dict(ep=2), dict(ac="budget:0.5"), dict(recompute="full"),
                                dict(zero=1), dict(fsdp2=True), dict(loss_chunks=4), dict(model="mixtral-8x7b")])
def test_refused_by_the_api(kw):
    with pytest.raises(MemplanError):
        estimate(**{"model": "llama3-8b", "impl": "torchtitan", "gpus": 8, **kw})


def test_ac_needs_torchtitan():
    with pytest.raises(MemplanError, match="--impl torchtitan"):
        estimate("llama3-8b", ac="full", gpus=8)


def test_selective_layer_keeps_full_bytes_for_every_nth_layer():
    # --ac selective-layer:N: torchtitan checkpoints layers N-1, 2N-1, ... (32 // N of llama3-8b's 32; measured on
    # CPU against its rule in tests/test_titan.py); they keep the block input, the others what none keeps
    layer_ids = {t.id for t in titan.llama3_layer_terms(H, A, G, F, D)}
    for ac, full_layers in (("selective-layer", 16), ("selective-layer:4", 8), ("selective-layer:3", 10),
                            ("selective-layer:1", 32)):
        stage = _estimate(ac, "cpu").stages[0]
        kept = sum(v for k, v in stage.term_bytes.items() if k in layer_ids)
        per_token = full_layers * PER_TOKEN["full", "cpu"] + (32 - full_layers) * PER_TOKEN["none", "cpu"]
        assert kept == per_token * S * B, ac


def test_hsdp_states_by_hand():
    # --dp-replicate 2 on 8 GPUs: torchtitan's (dp_replicate 2, fsdp 4) mesh: the fp32 states sharded over 4 ranks
    layer = 2 * H * H + 2 * H * G * D + 3 * H * F + 2 * H
    total = V * H + 32 * layer + V * H + H
    st = _estimate("full", dp_replicate=2).peak.states
    assert st.optimizer == -(-12 * total // 4) and st.gradients == -(-4 * total // 4)
    # all-gathered within a shard group: the whole layers; the RoPE caches as without HSDP
    assert st.weights == 2 * (2 * layer + V * H + H) + 32 * 4 * S * D
    assert _estimate("full", dp_replicate=1).peak.states == _estimate("full").peak.states


@pytest.mark.parametrize("kw", [dict(dp_replicate=3), dict(dp_replicate=8), dict(dp_replicate=2, zero_shard=4),
                                dict(ac="selective-layer:0"), dict(ac="selective-layer:x"),
                                dict(ac="selective-layer:33")])
def test_hsdp_and_layer_ac_refused(kw):
    with pytest.raises(MemplanError):
        _estimate(**{"ac": "full", **kw})


def test_hsdp_needs_torchtitan():
    with pytest.raises(MemplanError, match="--impl torchtitan"):
        estimate("llama3-8b", dp_replicate=2, gpus=8)


# --tp 2 on 8 GPUs (d = 4), per global token on one rank (the per-rank terms measured over gloo against torchtitan's
# parallelize_llama in tests/test_titan_tp.py), CUDA:
# selective-op: input 2h / t = 4096, wqkv 2(a + 2g)d / t = 6144, out 2ad / t = 4096, lse 4a / t = 64, wo
#   reduce-scattered 2h / t = 4096, w1 2f / t = 14336, w2's partial sums 2h = 8192, w2 reduce-scattered 4096: 45120
# none: 2 norms x (x 2h / t + rstd 4 / t + the all-gathered output 2h) = 2 x 12290 = 24580; the RoPE rows gathered
#   at the positions 4d = 512, whole (the attention runs on the all-gathered sequence); q 2ad / t = 4096, k, v
#   2gd / t = 1024 each, out 4096, lse 64; SwiGLU 4 x 2f / t = 57344: 92740
# full: 4096
TP_PER_TOKEN = {"selective-op": 45120, "none": 92740, "full": 4096}


@pytest.mark.parametrize("ac", sorted(TP_PER_TOKEN))
def test_tp_layer_bytes_by_hand(ac):
    est = _estimate(ac, tp=2, global_batch=4)
    assert est.per_layer_bytes == TP_PER_TOKEN[ac] * S * B
    assert (est.config.parallel.tp, est.config.parallel.dp, est.config.parallel.sp) == (2, 4, True)


def test_tp_states_and_loss_by_hand():
    # the TP shard of each parameter (matrices / t, the norms whole: measured in tests/test_titan_tp.py), sharded by
    # FSDP2 over d = 4; in flight: two layers and the tail, each the TP shard
    layer = (2 * H * H + 2 * H * G * D + 3 * H * F) // 2 + 2 * H
    tail = V * H // 2 + H
    total = V * H // 2 + 32 * layer + tail
    est = _estimate("full", tp=2, global_batch=4)
    st = est.peak.states
    assert st.optimizer == -(-12 * total // 4) and st.gradients == -(-4 * total // 4)
    assert st.weights == 2 * (2 * layer + tail) + 32 * 4 * S * D  # the RoPE caches whole on every TP rank
    # loss parallel: the saved fp32 log-probabilities are the rank's vocab shard, 4 v / t bytes per token
    assert est.stages[-1].term_bytes["logits_fp32"] == 4 * V // 2 * S * B
