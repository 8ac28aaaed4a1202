"""Memory of a whole training step (validation/step.py), checked against hand derivations.

Every expected value is derived by hand (in the comments) from the model definitions
(validation/layers.py; transformers' models/llama/modeling_llama.py, loss/loss_utils.py) and from
torch/optim/adam.py of the pinned torch (2.13: ``_multi_tensor_adam`` and ``_fused_adam``).
Nothing is copied from the program's output.  Tiny shapes, bf16, CPU.

Notation: s sequence, b micro-batch, h hidden, a heads, g KV heads, d = h / a, f MLP width,
v vocab, L layers, N parameter count, P persistent bytes before the step.
"""

from __future__ import annotations

from dataclasses import astuple

import pytest

torch = pytest.importorskip("torch")

from validation.step import StepCase, measure_step  # noqa: E402

BF16, FP32 = 2, 4
LL = dict(model="llama", attn="sdpa", s=32, b=2, h=64, a=4, g=2, f=160, v=256, L=2)
K22 = dict(model="k22", s=32, b=2, h=64, a=4, v=256, L=2, p_drop=0.1)


def llama_params(s, b, h, a, g, f, v, L, **_) -> tuple[int, int]:
    """(N, number of parameter tensors) of LlamaForCausalLM (untied head, no biases)."""
    d = h // a
    # q_proj h x h, k_proj / v_proj h x g*d, o_proj h x h, gate/up h x f, down f x h,
    # input_layernorm / post_attention_layernorm weights h each: 9 tensors per layer
    per_layer = h * h + 2 * h * g * d + h * h + 3 * h * f + 2 * h
    # embed_tokens v x h, lm_head v x h, final norm h: 3 tensors
    return L * per_layer + 2 * v * h + h, 9 * L + 3


def k22_params(s, h, v, L, f=None, **_) -> tuple[int, int]:
    """(N, number of parameter tensors) of layers.GPTModel (head tied to the word embedding)."""
    f = 4 * h if f is None else f
    # qkv h x 3h + 3h, proj h x h + h, fc1 h x f + f, fc2 f x h + h, two LayerNorms 2h each:
    # 12 tensors per layer
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    # word v x h, positions s x h, final LayerNorm 2h: 4 tensors
    return L * per_layer + v * h + s * h + 2 * h, 12 * L + 4


@pytest.fixture(scope="module")
def m(announce):
    """Every measurement the tests use, once (module scope keeps the file fast)."""
    cases = {
        "ll": StepCase(**LL),
        "ll_fused": StepCase(**LL, optimizer="fused"),
        "ll_full": StepCase(**LL, recompute="full"),
        "ll_fake": StepCase(**LL, backend="fake"),
        "ll_M2": StepCase(**LL, microbatches=2),
        "k22_meg": StepCase(**K22, loop="megatron"),
        "k22_meg_fused": StepCase(**K22, loop="megatron", optimizer="fused"),
        "k22_meg_fake": StepCase(**K22, loop="megatron", backend="fake"),
        "k22_full": StepCase(**K22, recompute="full"),
    }
    with announce(f"measuring {len(cases) + 1} training steps"):
        out = {k: measure_step(c) for k, c in cases.items()}
        out["ll_ops"] = measure_step(StepCase(**LL), ops=True)
    return out


def test_persistent_torch_loop(m):
    N, n_tensors = llama_params(**LL)
    p = m["ll"].persistent
    assert p["weights"] == BF16 * N  # bf16 parameters
    assert p["gradients"] == 0  # zero_grad(set_to_none=True) at the end of step 1
    assert p["master_weights"] == 0
    assert p["optimizer_states"] == 2 * BF16 * N  # exp_avg, exp_avg_sq in the param dtype (bf16)
    assert p["optimizer_steps"] == FP32 * n_tensors  # one fp32 scalar ``step`` per parameter
    # LlamaRotaryEmbedding: inv_freq and original_inv_freq, fp32, d/2 each
    assert p["buffers"] == 2 * FP32 * (LL["h"] // LL["a"] // 2)
    assert m["ll"].persistent_total == sum(p.values())


def test_persistent_megatron_loop(m):
    N, n_tensors = k22_params(**K22)
    p = m["k22_meg"].persistent
    assert p["weights"] == BF16 * N
    assert p["gradients"] == FP32 * N  # the one fp32 main-grad buffer (master .grad are views)
    assert p["master_weights"] == FP32 * N
    assert p["optimizer_states"] == 2 * FP32 * N  # AdamW on fp32 masters: fp32 states
    assert p["optimizer_steps"] == FP32 * n_tensors
    assert p["buffers"] == 0


def test_grads_at_end_of_backward(m):
    N, _ = llama_params(**LL)
    # torch loop: one bf16 .grad per parameter is alive when backward ends ...
    assert m["ll"].grad_bytes_at_end_of_backward == BF16 * N
    assert m["ll_M2"].grad_bytes_at_end_of_backward == BF16 * N  # accumulated in place, not twice
    # ... and they are the only thing the step still holds: the backward's last segment ends at
    # P + 2N (activations, loss, logits all freed)
    last_bwd = [g for g in m["ll"].timeline if g.phase == "backward"][-1]
    assert last_bwd.end_bytes == m["ll"].persistent_total + BF16 * N
    # Megatron loop: the post-accumulate hook folds each bf16 grad into main_grad and drops it
    assert m["k22_meg"].grad_bytes_at_end_of_backward == 0
    last_bwd = [g for g in m["k22_meg"].timeline if g.phase == "backward"][-1]
    assert last_bwd.end_bytes == m["k22_meg"].persistent_total


def test_optimizer_phase_foreach_vs_fused(m):
    # torch/optim/adam.py, _multi_tensor_adam with AdamW (decoupled weight decay: in-place
    # _foreach_mul_ on the params, no grad copy), maximize=False, beta2 a float: lerp_, mul_,
    # addcmul_ in place; then exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs): ONE new tensor
    # per parameter, in the states' dtype; div_ / add_ / addcdiv_ in place; freed when the
    # function returns.  _fused_adamw_ updates everything in place and returns nothing.
    N, _ = llama_params(**LL)
    P = m["ll"].persistent_total
    assert m["ll_fused"].persistent_total == P
    # the optimizer phase starts with the bf16 grads alive (2N)
    assert m["ll_fused"].phase_peak("optimizer") == P + BF16 * N
    assert m["ll"].phase_peak("optimizer") == P + BF16 * N + BF16 * N  # + bf16 sqrt temporary
    # Megatron loop: no bf16 grads left, the temporary is fp32 (the masters' states)
    Nk, _ = k22_params(**K22)
    Pk = m["k22_meg"].persistent_total
    assert m["k22_meg_fused"].phase_peak("optimizer") == Pk
    assert m["k22_meg"].phase_peak("optimizer") == Pk + FP32 * Nk
    # after zero_grad / the master -> bf16 copy the step has left nothing behind
    for k in ("ll", "ll_fused", "k22_meg", "k22_meg_fused"):
        assert m[k].live_at_end == 0
        assert m[k].timeline[-1].phase == "optimizer"
        assert m[k].timeline[-1].end_bytes == m[k].persistent_total


def test_timeline_labels_and_peak(m):
    L = LL["L"]
    # forward: inputs + embedding (no layer), layers 0..L-1, then the loss part; backward: loss
    # part, layers L-1..0, embedding part; then the optimizer
    expected = ([("forward", None)] + [("forward", i) for i in range(L)] + [("loss", None), ("backward", None)]
                + [("backward", i) for i in reversed(range(L))] + [("backward", None), ("optimizer", None)])
    for k in ("ll", "ll_full", "k22_meg", "k22_full"):
        t = m[k].timeline
        assert [(g.phase, g.layer) for g in t] == expected, k
        assert max(g.max_bytes for g in t) == m[k].peak_bytes
        assert m[k].peak_bytes >= m[k].persistent_total
    t2 = m["ll_M2"].timeline
    assert [g.microbatch for g in t2] == [0] * (len(expected) - 1) + [1] * (len(expected) - 1) + [None]
    assert max(g.max_bytes for g in t2) == m["ll_M2"].peak_bytes
    # micro-batch 0 of M=2 keeps what M=1 keeps after forward (the /M comes after)
    assert m["ll_M2"].retained_after_forward == m["ll"].retained_after_forward


def test_recompute_lowers_retained_after_forward(m):
    assert m["ll_full"].retained_after_forward < m["ll"].retained_after_forward
    k22_none = measure_step(StepCase(**K22))
    assert m["k22_full"].retained_after_forward < k22_none.retained_after_forward
    # recompute changes no persistent byte
    assert m["ll_full"].persistent == m["ll"].persistent


def test_fake_equals_live(m):
    for live, fake in (("ll", "ll_fake"), ("k22_meg", "k22_meg_fake")):
        a, b = m[live], m[fake]
        assert b.persistent == a.persistent
        assert b.peak_bytes == a.peak_bytes
        assert (b.peak_phase, b.peak_layer) == (a.peak_phase, a.peak_layer)
        assert b.retained_after_forward == a.retained_after_forward
        # same labels and bytes; the op counts differ (the fake run replays HF's
        # find_packed_sequence_indices, see hf._fake_mode, which live runs compute with a few ops)
        assert [g[:5] for g in map(astuple, b.timeline)] == [g[:5] for g in map(astuple, a.timeline)]


def test_hf_loss_path_upcasts_logits_and_grads_order(m):
    s, b, h, v, L = (LL[k] for k in ("s", "b", "h", "v", "L"))
    ops = m["ll_ops"].ops
    assert m["ll_ops"].peak_bytes == m["ll"].peak_bytes  # keeping the op log changes nothing
    loss = [o for o in ops if o.phase == "loss"]
    # LlamaForCausalLM: lm_head -> bf16 logits [b, s, v]; ForCausalLMLoss: logits.float() ->
    # fp32 copy; cross_entropy -> log_softmax fp32 [b*s, v] (saved for backward)
    assert [o.allocated for o in loss if o.op == "mm"][-1] == BF16 * b * s * v
    assert [o.allocated for o in loss if o.op == "_to_copy"][-1] == FP32 * b * s * v
    assert [o.allocated for o in loss if o.op == "_log_softmax"] == [FP32 * b * s * v]
    bwd = [o for o in ops if o.phase == "backward"]
    # backward of the loss: nll_loss_backward and _log_softmax_backward_data each make an fp32
    # [b*s, v] gradient, then it is cast back to bf16 for the lm_head matmul
    assert [o.allocated for o in bwd if o.op == "_log_softmax_backward_data"] == [FP32 * b * s * v]
    # the first weight gradient of the backward is lm_head's (v x h, bf16), before any layer ...
    first_layer_op = next(i for i, o in enumerate(bwd) if o.layer is not None)
    head_grad = [o for o in bwd[:first_layer_op] if o.op == "mm" and o.allocated == BF16 * v * h]
    assert len(head_grad) == 1
    # ... and the embedding's is the last one: embedding_dense_backward, after layer 0
    emb = [i for i, o in enumerate(bwd) if o.op == "embedding_dense_backward"]
    assert len(emb) == 1 and bwd[emb[0]].allocated == BF16 * v * h
    assert all(o.layer is None for o in bwd[emb[0]:])
    assert max(i for i, o in enumerate(bwd) if o.layer == 0) < emb[0]


def test_a_traced_family_runs_its_config_with_the_case_shape():
    """model "family": validation/trace_config.py FAMILIES' small Qwen3 config (head_dim 24, q / k norms, tied
    embeddings) with the case's h, a, L, v, f, g; the torch loop as for Llama. By hand, Qwen3ForCausalLM:
    per layer q_proj h x a d, k_proj / v_proj h x g d, o_proj a d x h, q_norm / k_norm d, two norms h,
    gate / up / down 3 h f; embed_tokens v x h (the LM head tied to it), final norm h."""
    h, a, g, d, f, v, L = 64, 4, 2, 24, 96, 256, 3
    m = measure_step(StepCase(model="family", family="qwen3", attn="sdpa", s=16, b=2, h=h, a=a, g=g, f=f, v=v, L=L))
    N = L * (h * a * d + 2 * h * g * d + a * d * h + 2 * d + 2 * h + 3 * h * f) + v * h + h
    assert m.persistent["weights"] == BF16 * N
    assert m.persistent["optimizer_states"] == 2 * BF16 * N  # AdamW's two bf16 moments
    assert len(m.segments("backward", layer=L - 1)) == 1  # L decoder layers, each labelled
    with pytest.raises(ValueError, match="needs a family"):
        StepCase(model="family", s=16, b=2, h=h, a=a).check()
    with pytest.raises(ValueError, match="only it takes one"):
        StepCase(model="llama", family="qwen3", s=16, b=2, h=h, a=a).check()
    with pytest.raises(ValueError, match="family must be one of"):
        StepCase(model="family", family="falcon", s=16, b=2, h=h, a=a).check()
