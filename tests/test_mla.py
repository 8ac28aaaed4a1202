"""Multi-head latent attention and multi-token prediction for --impl megatron (memplan/inventory/mla.py), the
DeepSeek-V3 preset's published plan (configs/traced/deepseek-v3/plan.yaml) and its MTP parameters, by hand.

The local spec's latent attention is measured against megatron-core in tests/test_validate_mcore_mla.py; the
Transformer Engine spec and MTP are derived from code: their expected values here are derived by hand."""

import re

from click.testing import CliRunner

import memplan.cli
from memplan.inventory import assemble as inventory
from memplan.presets.batch import make_config
from memplan.presets.catalog import load_model
from memplan.core.model import ModelSpec
from memplan.memory.states import mtp_params, total_params

# a latent-attention layer: h = 64, a = 4 heads of d_n = 16 + d_r = 8 (Q, K) and d_v = 16, r_q = 32, r_kv = 16
MLA = dict(name="mla", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512,
           ffn_hidden_size=160, norm="rmsnorm", mlp="swiglu", position_embedding="rope", tied_embeddings=False,
           bias=False, dropout=False, attention="flash", kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16)


def _bytes(model, impl, device, t=1, sp=False, b=2, scope="layer"):
    inv = inventory.inventory_for(model, impl, device)
    values = model.symbols(t=t, b=b)
    return {x.id: int(x.bytes(values, 2, sp)) for x in inv.terms if x.scope == scope}


def test_transformer_engine_spec_latent_attention_by_hand():
    # s = 32, b = 2: 64 tokens, bf16. TELayerNormColumnParallelLinear keeps the latent (64 x 32 x 2 = 4,096 for q,
    # 64 x 16 x 2 = 2,048 for kv), its fp32 rstd (64 x 4 = 256) and the norm's output (the GEMM input, as large as
    # the latent); cuDNN fused attention keeps Q and K (64 x 4 x 24 x 2 = 12,288 each), V and the output
    # (64 x 4 x 16 x 2 = 8,192 each) and the fp32 softmax statistics (4 x 32 x 2 x 4 = 1,024); the fused MLA RoPE
    # keeps only the shared cos / sin tables: no per-layer rotary term
    got = _bytes(ModelSpec(**MLA), "megatron", "cuda")
    mla = {k: v for k, v in got.items() if k.startswith("mla_") or k in ("qk", "v", "proj_input", "softmax_lse")}
    assert mla == {"mla_q_latent": 4_096, "mla_q_norm_stats": 256, "mla_q_up_input": 4_096,
                   "mla_kv_latent": 2_048, "mla_kv_norm_stats": 256, "mla_kv_up_input": 2_048,
                   "qk": 24_576, "v": 8_192, "proj_input": 8_192, "softmax_lse": 1_024}
    assert "rope_cos_sin" not in got and "qkv_input" in got
    # t = 2 with SP: the latents are gathered over t and scattered along s (halved by SP), the heads split over t
    split = _bytes(ModelSpec(**MLA), "megatron", "cuda", t=2, sp=True)
    assert split["mla_q_latent"] == 2_048 and split["qk"] == 12_288 and split["softmax_lse"] == 512
    # without SP the latents are whole on every rank
    assert _bytes(ModelSpec(**MLA), "megatron", "cuda", t=2)["mla_kv_up_input"] == 2_048


def test_no_query_latent_keeps_no_query_norm():
    got = _bytes(ModelSpec(**{**MLA, "q_lora_rank": None}), "megatron", "cuda")
    assert not any(k.startswith("mla_q_") for k in got) and got["mla_kv_latent"] == 2_048


MOE = dict(MLA, num_layers=4, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32, moe_shared_ffn_hidden_size=32,
           moe_first_dense_layers=1)


def test_multi_token_prediction_on_the_last_stage_by_hand():
    # one MTP module, s = 32, b = 2, h = 64, v = 512, t = 1: enorm, hnorm and the final norm's inputs 3 x 64 x 64 x 2
    # = 24,576 and their fp32 rstd 3 x 64 x 4 = 768; eh_proj's 2h-wide input 64 x 128 x 2 = 16,384; the head's input
    # 8,192; the fp32 logits 64 x 512 x 4 = 131,072; the int64 targets 64 x 8 = 512. Its layer is an MoE layer: the
    # routed copies k s b h = 2 x 64 x 64 x 2 = 16,384 (not weighted by the 3 / 4 MoE share of the main layers' term)
    with_mtp = _bytes(ModelSpec(**MOE, mtp_layers=1), "megatron", "cuda", scope="last")
    without = _bytes(ModelSpec(**MOE), "megatron", "cuda", scope="last")
    mtp = {k: v for k, v in with_mtp.items() if k not in without}
    assert {k: mtp[k] for k in ("mtp_norm_inputs", "mtp_norm_stats", "mtp_eh_proj_input", "mtp_head_input",
                                "mtp_logits_fp32", "mtp_target_ids", "mtp_moe_permuted_tokens")} == {
        "mtp_norm_inputs": 24_576, "mtp_norm_stats": 768, "mtp_eh_proj_input": 16_384, "mtp_head_input": 8_192,
        "mtp_logits_fp32": 131_072, "mtp_target_ids": 512, "mtp_moe_permuted_tokens": 16_384}
    # the MTP layer has the latent attention and no dense MLP
    assert "mtp_qk" in mtp and "mtp_swiglu_input" not in mtp and "mtp_fc1_input" in mtp


def test_hf_plans_drop_multi_token_prediction():
    # transformers builds no MTP module: --impl hf-* plans (whole model per rank) drop it (presets.make_config)
    preset = load_model("deepseek-v3")
    assert make_config(preset).model.mtp_layers == 1
    hf = make_config(preset, training=dict(global_batch=64), gpus=8, whole_model_per_rank=True)
    assert hf.model.mtp_layers == 0 and hf.parallel.ep == 1  # nor expert parallelism: transformers has none


def test_deepseek_v3_mtp_parameters_by_hand():
    # the preset's config.json: num_nextn_predict_layers 1. Its module's own parameters (the embedding and the output
    # head are the main model's, shared in Megatron-LM): q_a 7168 x 1536 = 11,010,048; q_b 1536 x 128 x 192 =
    # 37,748,736; kv_a 7168 x 576 = 4,128,768; kv_b 512 x 128 x 256 = 16,777,216; o 128 x 128 x 7168 = 117,440,512;
    # latent norms 1536 + 512 = 2,048; layer norms 2 x 7168 = 14,336; experts 256 x 3 x 7168 x 2048 =
    # 11,274,289,152; router 256 x 7168 = 1,835,008; shared expert 3 x 7168 x 2048 = 44,040,192; eh_proj
    # 2 x 7168 x 7168 = 102,760,448; enorm, hnorm, final norm 3 x 7168 = 21,504: 11,610,067,968 in all. With the
    # embedding and head copies Hugging Face's checkpoint stores for it (2 x 129280 x 7168 = 1,853,358,080) that is
    # 13.46 B, and 671.03 B + 13.46 B = 684.5 B: the published "685 B including 14 B of MTP"
    model = load_model("deepseek-v3").model
    assert model.mtp_layers == 1
    assert mtp_params(model) == 11_610_067_968
    assert total_params(model) == 671_026_404_352  # the published 671 B excludes MTP


def test_deepseek_v3_estimate_runs_with_its_published_plan():
    result = CliRunner().invoke(memplan.cli.cli, ["estimate", "--model", "deepseek-v3"], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.output
    assert re.search(r"plan: t=1 p=16 d=128 .*ZeRO=1 .*on 2048 GPUs", out)
    assert "ep = 64" in out and "671.0 billion parameters" in out and "s=4096" in out
    assert "3 layer(s) on the first stage, 4 on each of the 14 middle one(s), 2 on the last" in out
