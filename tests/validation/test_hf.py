"""What HF transformers' GPT-2 and Llama really save for backward, term by term.

Every expected value below is derived by hand from the HF code path (transformers pinned in the
module docstring of validation/hf.py; models/gpt2/modeling_gpt2.py, models/llama/modeling_llama.py,
integrations/sdpa_attention.py, activations.py, loss/loss_utils.py) and from what each torch op's
backward needs; the derivation is in the comments.  bf16 model, training mode, CPU.

Notation: s sequence, b micro-batch, h hidden, a heads, g KV heads, d = h / a, f MLP width, v vocab.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from validation.hf import measure_hf  # noqa: E402
from validation.hf_rules import HF_LAYER_LABELS, HF_MODEL_LABELS  # noqa: E402
from validation.tags import PARAMETER, UNLABELED  # noqa: E402

BF16, FP32, I64 = 2, 4, 8
DIMS = dict(s=20, b=2, h=48, a=4, f=80, v=96)  # d = 12 != s, so transposed copies are told apart
L_MODEL = 2


def expected_layer(arch: str, attn: str, p: float, g: int | None, s, b, h, a, f, **_) -> dict[str, int]:
    d = h // a
    g = a if g is None else g
    sbh, sbf, ass = s * b * h, s * b * f, a * s * s * b
    if arch == "llama":
        e = {
            # LlamaRMSNorm: x.to(float32); pow(2) saves that fp32 copy [b, s, h] (x * rsqrt saves
            # it again, same storage); rsqrt(var + eps) saves its fp32 result [b, s, 1];
            # weight * normed.to(bf16) saves the bf16 normalised tensor.  The bf16 layer input
            # itself is saved by nobody (the residual add saves nothing).
            "ln1_fp32_input": FP32 * sbh,
            "ln1_rstd": FP32 * s * b,
            "ln1_normed": BF16 * sbh,
            # q_proj, k_proj, v_proj (F.linear) all save the RMSNorm output (weight * normed)
            "qkv_input": BF16 * sbh,
            # LlamaRotaryEmbedding: cos, sin of shape [1, s, d] (position_ids [1, s], not
            # expanded over b), bf16.  apply_rotary_pos_emb: q * cos saves cos, rotate_half(q) * sin
            # saves sin; q, k, rotate_half(.) are NOT saved there, since cos / sin need no grad.
            "rope_cos": BF16 * s * d,
            "rope_sin": BF16 * s * d,
            # o_proj input: eager: attn_output.transpose(1, 2).contiguous(); sdpa flash: the
            # kernel output itself ([b, s, a, d] memory, transpose + reshape are views): one storage
            "attn_out": BF16 * sbh,
            **{k.replace("ln1", "ln2"): n for k, n in (("ln1_fp32_input", FP32 * sbh),
                                                        ("ln1_rstd", FP32 * s * b),
                                                        ("ln1_normed", BF16 * sbh))},
            # gate_proj and up_proj save the post_attention_layernorm output
            "mlp_input": BF16 * sbh,
            # F.silu saves its input (gate_proj output); act(gate) * up saves both factors;
            # down_proj saves the product
            "silu_input": BF16 * sbf,
            "up_out": BF16 * sbf,
            "silu_out": BF16 * sbf,
            "fc2_input": BF16 * sbf,
        }
        if attn == "eager":
            e.update({
                # repeat_kv copies k, v to a heads; matmul(q, k^T) -> bmm saves k^T [b*a, d, s]
                # and a [b*a, s, d] copy of q (q after rope has [b, s, a, d] memory layout)
                "k": BF16 * b * a * s * d,
                "q": BF16 * b * a * s * d,
                # softmax(dtype=torch.float32) saves its fp32 output [b, a, s, s]
                "softmax_out": FP32 * ass,
                # .to(bf16) (then dropout) -> matmul(probs, v) saves probs [b*a, s, s] and v
                "attn_probs": BF16 * ass,
                "v": BF16 * b * a * s * d,
            })
            if p > 0:  # F.dropout on CPU: bernoulli_ mask in the input dtype, kept by the mul
                e["softmax_dropout_mask"] = BF16 * ass
        elif p == 0:
            # sdpa, CPU flash kernel (dropout 0, no mask: is_causal=True); enable_gqa=True on CPU
            # (no mask, d <= 256) so K and V keep g heads; it saves q, k, v, output, logsumexp
            e.update({
                "q": BF16 * b * a * s * d,
                "k": BF16 * b * g * s * d,
                "v": BF16 * b * g * s * d,
                "sdpa_logsumexp": FP32 * a * s * b,  # fp32 [b, a, s]
            })
        else:
            # sdpa with dropout on CPU: the math fallback upcasts q, k, v to fp32 (k, v repeated
            # to a heads), then matmul / softmax / dropout / matmul as eager, all in fp32
            e.update({
                "k": FP32 * b * a * s * d, "q": FP32 * b * a * s * d, "v": FP32 * b * a * s * d,
                "softmax_out": FP32 * ass, "softmax_dropout_mask": FP32 * ass, "attn_probs": FP32 * ass,
            })
        return e
    # GPT-2 (pre-LN, Conv1D = addmm, gelu_new)
    e = {
        # nn.LayerNorm -> native_layer_norm saves the input and mean, rstd [b, s, 1] (bf16 on CPU)
        "ln1_input": BF16 * sbh,
        "ln1_stats": 2 * BF16 * s * b,
        # c_attn: addmm(bias, x.view(-1, h), W) saves x
        "qkv_input": BF16 * sbh,
        # c_proj input: the merged heads (eager: transpose + reshape + contiguous; flash: output)
        "attn_out": BF16 * sbh,
        "ln2_input": BF16 * sbh,
        "ln2_stats": 2 * BF16 * s * b,
        # c_fc saves its input
        "mlp_input": BF16 * sbh,
        # NewGELUActivation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3)))):
        # pow saves x; tanh saves its output; (0.5 * x) * (1 + tanh) saves both factors; the
        # products / sums with Python scalars save nothing.  Four [b, s, f] bf16 tensors.
        "gelu_input": BF16 * sbf,
        "gelu_tanh_out": BF16 * sbf,
        "gelu_one_plus_tanh": BF16 * sbf,
        "gelu_half_x": BF16 * sbf,
        # mlp.c_proj saves the GeLU output
        "fc2_input": BF16 * sbf,
    }
    if attn == "eager":
        e.update({
            # q, k, v: strided views of the c_attn output; matmul reshapes (copies) them
            "k": BF16 * sbh, "q": BF16 * sbh, "v": BF16 * sbh,
            "softmax_out": BF16 * ass,  # softmax without dtype: bf16 output
        })
        if p > 0:  # attn_dropout: bf16 bernoulli mask; matmul saves the dropout output
            e.update({"softmax_dropout_mask": BF16 * ass, "attn_probs": BF16 * ass})
        # (p = 0: F.dropout returns its input; matmul saves softmax_out again, same storage)
    elif p == 0:
        # flash (CPU): query, key, value are views of ONE storage, the c_attn output [b, s, 3h]
        e.update({"qkv": BF16 * 3 * sbh, "sdpa_logsumexp": FP32 * a * s * b})
    else:  # math fallback, fp32, as for Llama
        e.update({"k": FP32 * sbh, "q": FP32 * sbh, "v": FP32 * sbh, "softmax_out": FP32 * ass,
                  "softmax_dropout_mask": FP32 * ass, "attn_probs": FP32 * ass})
    if p > 0:  # resid_dropout after c_proj, mlp.dropout after mlp.c_proj: bf16 masks on CPU
        e.update({"attn_dropout_mask": BF16 * sbh, "mlp_dropout_mask": BF16 * sbh})
    return e


def target_bytes(s, b) -> int:
    """ForCausalLMLoss: labels = F.pad(labels, (0, 1)); shift = labels[..., 1:].contiguous(),
    saved by nll_loss.  For b > 1 the slice is not contiguous: an int64 [b, s] copy.  For b = 1
    it already is contiguous, so the padded [1, s + 1] storage is what is kept."""
    return I64 * b * s if b > 1 else I64 * (s + 1)


def expected_model(arch, attn, p, g, L, s, b, h, a, f, v) -> dict[str, int]:
    layer = expected_layer(arch, attn, p, g, s, b, h, a, f)
    shared = ("rope_cos", "rope_sin") if arch == "llama" else ()
    e = {k: (n if k in shared else L * n) for k, n in layer.items()}  # cos / sin: one storage
    e.update({
        "token_ids": I64 * b * s,  # nn.Embedding saves the int64 input ids
        "head_input": BF16 * s * b * h,  # lm_head (F.linear) saves the final norm output
        # logits.float() [b, s, v] -> F.cross_entropy = log_softmax (saves its fp32 output) +
        # nll_loss (saves the same output, the int64 targets and an fp32 total_weight scalar).
        # The bf16 logits and their fp32 copy are not saved.
        "logits_fp32": FP32 * b * s * v,
        "target_ids": target_bytes(s, b),
        "nll_total_weight": FP32,
    })
    if arch == "llama":
        e.update({"final_norm_fp32_input": FP32 * s * b * h, "final_norm_rstd": FP32 * s * b,
                  "final_norm_normed": BF16 * s * b * h})
    else:
        e.update({
            "position_ids": I64 * s,  # wpe saves arange(s).unsqueeze(0): [1, s]
            "final_ln_input": BF16 * s * b * h,
            "final_ln_stats": 2 * BF16 * s * b,
        })
        if p > 0:
            e["embedding_dropout_mask"] = BF16 * s * b * h  # transformer.drop, bf16 on CPU
    return e


def _jobs():
    jobs = []
    for attn in ("eager", "sdpa"):
        for p in (0.0, 0.1):
            for scope in ("layer", "model"):
                jobs.append(("gpt2", attn, p, None, scope))
        for g in (2, 4):  # GQA (g < a) and MHA (g = a)
            for scope in ("layer", "model"):
                jobs.append(("llama", attn, 0.0, g, scope))
        jobs.append(("llama", attn, 0.1, 2, "layer"))  # attention_dropout > 0
    return jobs


JOBS = _jobs()
IDS = [f"{arch}-{attn}-p{p}-g{g}-{scope}" for arch, attn, p, g, scope in JOBS]


def _run(job, backend="live", **over):
    arch, attn, p, g, scope = job
    kw = dict(DIMS, g=g, L=L_MODEL, dropout=p, scope=scope, backend=backend)
    kw.update(over)
    return measure_hf(arch, attn, **kw)


@pytest.fixture(scope="module")
def measured(announce):
    with announce(f"measuring {len(JOBS)} transformers cases"):
        return {job: _run(job) for job in JOBS}


@pytest.mark.parametrize("job", JOBS, ids=IDS)
def test_every_saved_storage_has_a_label(measured, job):
    arch, _, _, _, scope = job
    m = measured[job]
    assert not m.unlabeled, [(e, c) for e, c in zip(m.entries, m.contexts) if e.label == UNLABELED]
    known = set(HF_LAYER_LABELS[arch]) | (set(HF_MODEL_LABELS[arch]) if scope == "model" else set())
    assert set(m.saved_bytes_by_label) <= known


@pytest.mark.parametrize("job", JOBS, ids=IDS)
def test_bytes_by_label_match_the_hand_derivation(measured, job):
    arch, attn, p, g, scope = job
    m = measured[job]
    if scope == "layer":
        assert m.saved_bytes_by_label == expected_layer(arch, attn, p, g, **DIMS)
    else:
        assert m.saved_bytes_by_label == expected_model(arch, attn, p, g, L_MODEL, **DIMS)


@pytest.mark.parametrize("job", JOBS, ids=IDS)
def test_live_tracker_agrees_with_ledger(measured, job):
    arch, _, _, _, scope = job
    m = measured[job]
    s, b, h = DIMS["s"], DIMS["b"], DIMS["h"]
    assert m.loss_bytes == (BF16 if scope == "layer" else FP32)  # layer: bf16 sum; model: fp32 loss
    extra = 0
    if scope == "layer" and arch == "llama":
        # the layer's input is a leaf held by its AccumulateGrad node; Llama saves no bf16 copy of it
        extra = BF16 * s * b * h
    assert m.retained_after_forward_bytes == m.saved_bytes_total + m.loss_bytes + extra
    assert m.peak_bytes >= m.retained_after_forward_bytes


MODEL_JOBS = [j for j in JOBS if j[4] == "model"]


@pytest.mark.parametrize("job", MODEL_JOBS, ids=[i for i, j in zip(IDS, JOBS) if j[4] == "model"])
def test_model_run_per_layer_equals_the_layer_alone(measured, job):
    arch, attn, p, g, _ = job
    m = measured[job]
    assert len(m.per_layer) == L_MODEL
    for d in m.per_layer:
        assert d == expected_layer(arch, attn, p, g, **DIMS)
    layer = measured.get((arch, attn, p, g, "layer"))
    if layer is not None:
        assert m.per_layer[0] == layer.saved_bytes_by_label
    assert set(m.shared_labels) == ({"rope_cos", "rope_sin"} if arch == "llama" else set())
    if arch == "llama":  # one storage each, saved by every layer, counted once by the model
        for label in ("rope_cos", "rope_sin"):
            (e,) = m.entries_for(label)
            assert (e.shape, e.dtype) == ((1, 1, DIMS["s"], DIMS["h"] // DIMS["a"]), "bfloat16")


def test_ledger_backend_equals_live_backend(measured):
    for job in [("llama", "sdpa", 0.0, 2, "model"), ("gpt2", "eager", 0.1, None, "layer")]:
        m = _run(job, backend="ledger")
        assert m.entries == measured[job].entries
        assert m.retained_after_forward_bytes is None


def test_fake_equals_real(measured):
    for job in [("llama", "eager", 0.0, 2, "model"), ("llama", "sdpa", 0.0, 2, "layer"),
                ("gpt2", "sdpa", 0.1, None, "model"), ("gpt2", "sdpa", 0.0, None, "layer")]:
        fake, real = _run(job, backend="fake"), measured[job]
        assert fake.entries == real.entries
        assert fake.retained_after_forward_bytes == real.retained_after_forward_bytes
        assert fake.peak_bytes == real.peak_bytes


def test_fake_mode_packed_sequence_replay_is_what_real_runs_decide():
    """validation.hf tells fake runs 'not packed'; a real run decides the same for arange ids."""
    from transformers.masking_utils import find_packed_sequence_indices

    assert find_packed_sequence_indices(torch.arange(DIMS["s"]).unsqueeze(0)) is None


def test_dropout_masks_are_bf16_bernoulli_on_cpu(measured):
    m = measured[("gpt2", "eager", 0.1, None, "model")]
    for label in ("embedding_dropout_mask", "softmax_dropout_mask", "attn_dropout_mask", "mlp_dropout_mask"):
        for e in m.entries_for(label):
            assert e.dtype == "bfloat16" and e.op == "torch.nn.functional.dropout"
    assert m.kernels["torch.nn.functional.dropout"] == ["aten.bernoulli_"]  # never native_dropout


def test_sdpa_kernels_on_cpu(measured):
    sdpa = "torch.nn.functional.scaled_dot_product_attention"
    for arch, g in (("llama", 2), ("gpt2", None)):
        flash = measured[(arch, "sdpa", 0.0, g, "layer")]
        assert "aten._scaled_dot_product_flash_attention_for_cpu" in flash.kernels[sdpa]
        (lse,) = flash.entries_for("sdpa_logsumexp")
        assert (lse.shape, lse.dtype) == ((DIMS["b"], DIMS["a"], DIMS["s"]), "float32")
        math = measured[(arch, "sdpa", 0.1, g, "layer")]
        assert math.kernels[sdpa][-1] == "<math>"
        assert {e.dtype for e in math.entries if e.op == sdpa} == {"float32"}


def test_target_ids_for_batch_one_keep_the_padded_labels():
    m = measure_hf("llama", "sdpa", s=16, b=1, h=32, a=2, f=48, v=64, scope="model", backend="fake")
    (e,) = m.entries_for("target_ids")
    assert (e.shape, e.dtype, e.bytes) == ((16,), "int64", target_bytes(16, 1)) == ((16,), "int64", 8 * 17)


@pytest.mark.slow  # test_bytes_by_label_match_the_hand_derivation's proof at Llama-3-8B's size, under FakeTensorMode
def test_llama3_8b_layer_under_fake_mode():
    """Llama-3-8B shapes (h 4096, a 32, g 8, f 14336), s 4096, b 1, dropout 0: one layer, fake."""
    dims = dict(s=4096, b=1, h=4096, a=32, f=14336)
    s, b, h, a, f, g = 4096, 1, 4096, 32, 14336, 8
    d = h // a
    t0 = time.time()
    for attn in ("eager", "sdpa"):
        m = measure_hf("llama", attn, g=g, v=128256, scope="layer", backend="fake", **dims)
        assert not m.unlabeled
        assert m.saved_bytes_by_label == expected_layer("llama", attn, 0.0, g, **dims)
        sbh, sbf = s * b * h, s * b * f
        if attn == "eager":  # 24sbh + 8sbf + 6as^2b + 8sb + 4sd
            total = 24 * sbh + 8 * sbf + 6 * a * s * s * b + 8 * s * b + 4 * s * d
        else:  # 20sbh + 4sbh g/a + 8sbf + 4asb + 8sb + 4sd
            total = 20 * sbh + 4 * sbh * g // a + 8 * sbf + 4 * a * s * b + 8 * s * b + 4 * s * d
        assert m.saved_bytes_total == total
        assert m.retained_after_forward_bytes == total + BF16 + BF16 * sbh  # + loss + leaf input
    assert time.time() - t0 < 20


def test_parameters_are_listed_not_counted(measured):
    m = measured[("llama", "eager", 0.0, 2, "layer")]
    params = [e for e in m.entries if e.label == PARAMETER]
    assert params and m.saved_parameter_bytes == sum(e.bytes for e in params)
    assert m.saved_bytes_total == sum(n for n in m.saved_bytes_by_label.values())
