"""The Megatron MoE inventory's arithmetic (memplan/inventory/moe.py): load imbalance, capacity factor, padding, dense-first
layers, the backward's expert gradients, search = estimate, the emitted flags. No torch: what each term is was
measured against megatron-core (tests/test_validate_mcore_moe.py); here the expected values are derived by hand.

Mixtral 8x7B at s = 8192, b = 1, t = 1, bf16: h = 4096, E = 8, k = 2, f_e = 14336."""

import subprocess
import sys

import pytest

from memplan.plan.estimate import estimate
from memplan.launch.megatron import megatron_args
from memplan.presets.batch import make_config, search_inputs
from memplan.presets.catalog import load_gpu, load_model
from memplan.presets.files import ModelPreset
from memplan.core.model import ModelSpec
from memplan.inventory.assemble import inventory_for

MIXTRAL = load_model("mixtral-8x7b").model


def layer_bytes(model: ModelSpec, impl: str = "megatron", device: str = "cuda") -> dict[str, int]:
    values = model.symbols(b=1, t=1)
    return {t.id: int(t.bytes(values, 2, 0)) for t in inventory_for(model, impl, device).terms if t.scope == "layer"}


def routed(**routing) -> dict[str, int]:
    return layer_bytes(MIXTRAL.model_copy(update=routing))


def test_balanced_routed_terms_by_hand():
    b = routed()
    assert b["moe_permuted_tokens"] == 2 * 8192 * 4096 * 2  # k s b h x 2 B = 134,217,728
    assert b["moe_fc1_output"] == 2 * 2 * 8192 * 14336 * 2  # 2 k s b f_e x 2 B (fused SwiGLU's input)
    assert b["moe_fc2_input"] == 2 * 8192 * 14336 * 2
    assert b["moe_topk_indices"] == 2 * 8192 * 8  # k s b int64, on the sender: not routed
    assert "moe_act_out" not in b  # CUDA / TE: weighted_bias_swiglu_impl keeps only its input
    assert "moe_act_out" in layer_bytes(MIXTRAL, "megatron-local", "cpu")  # measured unfused path


def test_imbalance_scales_the_routed_terms_only():
    base, busy = routed(), routed(moe_imbalance=1.5)
    assert busy["moe_permuted_tokens"] == 201_326_592  # 1.5 x 134,217,728
    assert busy["moe_fc1_output"] == 3 * base["moe_fc1_output"] // 2
    assert busy["moe_topk_probs"] == base["moe_topk_probs"] and busy["qkv_input"] == base["qkv_input"]


def test_capacity_factor_bounds_and_padding_fills():
    # dropping: min(imbalance 2, C 1.25) = 1.25 x 134,217,728 = 167,772,160; padded: C x the balanced count
    assert routed(moe_imbalance=2.0, moe_capacity_factor=1.25)["moe_permuted_tokens"] == 167_772_160
    assert routed(moe_capacity_factor=0.5)["moe_permuted_tokens"] == 67_108_864
    padded = routed(moe_capacity_factor=1.25, moe_pad_to_capacity=True)
    assert padded["moe_permuted_tokens"] == 167_772_160
    # padded: two permutation indices (tokens, probabilities) of C k s b int64 = 2 x 1.25 x 16,384 x 8 B; no
    # masked_select probabilities
    assert padded["moe_permute_index"] == 327_680 and "moe_probs_dense" not in padded


def test_dense_first_layers_weigh_the_mlp_terms():
    # 4 layers, the first dense: the layers' total = 1 dense layer + 3 MoE layers (each from its own inventory)
    shape = dict(name="x", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=160, seq_length=128,
                 vocab_size=256, norm="rmsnorm", mlp="swiglu", position_embedding="rope", bias=False, dropout=False,
                 attention="flash", tied_embeddings=False)
    experts = dict(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=96)
    dense = sum(layer_bytes(ModelSpec(**shape)).values())
    moe = sum(layer_bytes(ModelSpec(**shape, **experts)).values())
    mixed = sum(layer_bytes(ModelSpec(**shape, **experts, moe_first_dense_layers=1)).values())
    assert 4 * mixed == dense + 3 * moe


def test_expert_backward_gradient_is_sized_for_the_routed_copies():
    # the MLP backward's gradient of fc2's input: k s b f_e x r x 2 B = 2 x 8192 x 14336 x 2 = 469,762,048 (r = 1)
    for r in (1.0, 2.0):
        inv = inventory_for(MIXTRAL.model_copy(update=dict(moe_imbalance=r)), "megatron", "cuda")
        moment = next(m for m in inv.moments if m.id == "mlp_backward")
        grad = next(t for t in moment.transients if t.id == "grad_fc2_input")
        assert int(grad.bytes(MIXTRAL.symbols(b=1, t=1), 2, 0)) == int(469_762_048 * r)
        assert "moe_fc1_output" not in moment.freed  # the experts' saves are alive in the MLP backward
        # the largest: the gradient of the experts' fc1 output, 2 k s b f_e x r x 2 B
        act = next(m for m in inv.moments if m.id == "mlp_activation_backward")
        grad = next(t for t in act.transients if t.id == "grad_activation_input")
        assert int(grad.bytes(MIXTRAL.symbols(b=1, t=1), 2, 0)) == int(2 * 469_762_048 * r)
        assert "moe_fc1_output" in next(m for m in inv.moments if m.id == "attention_backward").freed


def test_search_equals_estimate_and_uses_ep():
    from memplan.plan.search import search

    a100 = load_gpu("a100-80gb")
    model, training, gb = search_inputs(ModelPreset(MIXTRAL.model_copy(update=dict(moe_imbalance=1.25))), 64,
                                        seq_length=4096)
    result = search(model, training, 64, gb, 80 * 10**9, gpu=a100, top=3, impl="megatron")
    assert result.top and result.config(result.top[0]).parallel.ep > 1
    for i in range(0, result.candidates, max(1, result.candidates // 8)):
        est = estimate(result.config(i), gpu=a100, impl="megatron")
        assert int(result.evaluated.peak_bytes[i]) == int(est.step.peak_bytes), i


def test_emitted_routing_flags():
    cfg = make_config(ModelPreset(MIXTRAL.model_copy(update=dict(moe_capacity_factor=1.25, moe_pad_to_capacity=True,
                                                                 moe_token_dispatcher="allgather"))),
                      parallel=dict(dp=8, ep=8))
    args = megatron_args(cfg)
    assert {"--moe-token-dispatcher-type allgather", "--moe-expert-capacity-factor 1.25",
            "--moe-pad-expert-input-to-capacity", "--expert-model-parallel-size 8"} <= set(args)


@pytest.mark.parametrize("impl", ["megatron", "megatron-local"])
def test_cli_estimates_mixtral(impl):
    p = subprocess.run([sys.executable, "-m", "memplan.cli", "estimate", "--model", "mixtral-8x7b", "--impl", impl,
                        "--moe-imbalance", "1.2", "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert '"moe_permuted_tokens"' in p.stdout


@pytest.mark.parametrize("dispatcher, buffer", [("alltoall", 2 * 8192 * 4096 * 2), ("allgather", 8 * 8192 * 4096 * 2)])
def test_combine_forward_buffers_by_hand(dispatcher, buffer):
    # inside the MoE forward, at the combine: the experts' output for the k s b routed copies (2 x 8192 x 4096 x 2 B =
    # 134,217,728), the dispatcher's buffer (alltoall: the k s b copies back; allgather at ep = 8: the 8 s b gathered
    # tokens, 536,870,912) and the unpermuted output s b h (67,108,864)
    model = MIXTRAL.model_copy(update=dict(moe_token_dispatcher=dispatcher))
    moment = next(m for m in inventory_for(model, "megatron", "cuda").moments if m.id == "moe_combine_forward")
    assert moment.phase == "forward"
    sizes = [int(t.bytes(model.symbols(b=1, t=1, ep=8), 2, 0)) for t in moment.transients]
    assert sizes == [134_217_728, buffer, 67_108_864]


def test_cli_explains_mixtral_with_expert_tp():
    # the routed tokens after the expert-TP all-gather, k s b h etp / t x 2 B at t = etp = 2: 4 x 8192 x 4096 x 2 / 2 =
    # 134,217,728 B
    p = subprocess.run([sys.executable, "-m", "memplan.cli", "explain", "--model", "mixtral-8x7b", "--tp", "2", "--sp",
                        "--ep", "4", "--dp", "4"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "4sbhetp/t = 4 x 8192 x 1 x 4096 x 2 / 2 = 134,217,728 B" in p.stdout


def test_router_options_by_hand():
    # Mixtral at s = 8192, b = 1 (8,192 tokens), E = 8, k = 2, bf16; what each router option adds (the tensors
    # measured in tests/test_validate_mcore_moe.py)
    base = routed()
    assert not {k for k in base if k.startswith(("moe_aux", "moe_z"))}  # --moe-aux-loss-coeff 0, no z-loss
    aux = routed(moe_aux_loss_coeff=0.01)
    # softmax of all 8 logits 8 x 8192 x 4 B = 262,144; tokens per expert 8 x 8 B; the loss 4 B
    assert (aux["moe_aux_scores"], aux["moe_aux_counts"], aux["moe_aux_loss"]) == (262_144, 64, 4)
    # z-loss: the logits 8 x 8192 and their logsumexp 8192, bf16 (2 B) or fp32 (4 B) with the router in fp32
    assert (routed(moe_z_loss_coeff=1e-3)["moe_z_logits"], routed(moe_z_loss_coeff=1e-3)["moe_z_lse"]) == (131_072,
                                                                                                            16_384)
    fp32 = routed(moe_z_loss_coeff=1e-3, moe_router_dtype="fp32")
    assert (fp32["moe_z_logits"], fp32["moe_z_lse"]) == (262_144, 32_768)
    # the probabilities in the router's dtype: scattered E s b = 65,536 x 4 B, the routed copies' k s b x 4 B
    assert (fp32["moe_probs_dense"], fp32["moe_permuted_probs"]) == (262_144, 65_536)
    assert (base["moe_probs_dense"], base["moe_permuted_probs"]) == (131_072, 32_768)
    # pre-softmax: the fp32 softmax of all E logits, 8 x 8192 x 4 B, instead of the k chosen (2 x 8192 x 4 B)
    assert routed(moe_router_pre_softmax=True)["moe_topk_probs"] == 262_144 and base["moe_topk_probs"] == 65_536
    # k = 1: megatron-core requires the pre-softmax, so it is assumed
    assert routed(moe_top_k=1)["moe_topk_probs"] == 262_144


def test_gelu_experts_by_hand():
    # GeLU experts (no GLU): fc1's output k s b f_e = 2 x 8192 x 14336 x 2 B = 469,762,048, not 2 f_e wide
    b = layer_bytes(MIXTRAL.model_copy(update=dict(mlp="gelu")), "megatron-local", "cpu")
    assert b["moe_fc1_output"] == b["moe_act_out"] == b["moe_fc2_input"] == 469_762_048
    assert "moe_swiglu_up" not in b


def test_emitted_router_flags():
    model = MIXTRAL.model_copy(update=dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_router_dtype="fp32"))
    args = megatron_args(make_config(ModelPreset(model), parallel=dict(dp=8, ep=8)))
    assert {"--moe-aux-loss-coeff 0.01", "--moe-z-loss-coeff 0.001", "--moe-router-dtype fp32"} <= set(args)
    assert "--moe-router-pre-softmax" not in args
    k1 = megatron_args(make_config(ModelPreset(MIXTRAL.model_copy(update=dict(moe_top_k=1))), parallel=dict(dp=8)))
    assert "--moe-router-pre-softmax" in k1 and not any(a.startswith("--moe-aux-loss-coeff") for a in k1)


def test_cli_router_options():
    p = subprocess.run([sys.executable, "-m", "memplan.cli", "estimate", "--model", "mixtral-8x7b", "--impl",
                        "megatron", "--moe-aux-loss-coeff", "0.01", "--moe-router-dtype", "fp32", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert '"moe_aux_scores"' in p.stdout
    bad = subprocess.run([sys.executable, "-m", "memplan.cli", "estimate", "--model", "mixtral-8x7b",
                          "--moe-router-dtype", "fp16"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
