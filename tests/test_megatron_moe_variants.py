"""Megatron-LM's CUDA-only MoE variants (memplan/inventory/moe.py, recompute.py, fusions.py): --moe-grouped-gemm with
--recompute-modules moe_act, --moe-permute-fusion, --moe-shared-expert-overlap. They need Transformer Engine / the
grouped_gemm package / CUDA streams, so each term is DERIVED from megatron-core 0.16.1's code (and Transformer
Engine's permutation.py for the fused permute); the expected values below are hand derivations from the tensor shapes
in that code, not memplan's output. No torch.

Mixtral 8x7B at s = 8192, b = 1, bf16: h = 4096, E = 8, k = 2, f_e = 14336."""

import subprocess
import sys

import pytest

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.training import TrainingSpec
from memplan.inventory.assemble import training_inventory
from memplan.launch.bridge import launch_for
from memplan.core.specs import Config, ParallelSpec
from memplan.presets.catalog import load_model

MIXTRAL = load_model("mixtral-8x7b").model
ROUTED = 2 * 8192 * 14336 * 2  # k s b f_e x 2 B = 469,762,048: one f_e-wide tensor per routed copy


def inventory(impl="megatron", modules=None, off=(), **update):
    training = TrainingSpec(recompute="selective" if modules else "none", recompute_modules=modules or "core_attn",
                            fusions_off=off)
    return training_inventory(MIXTRAL.model_copy(update=update), impl, "cuda", training)


def layer_bytes(inv, t=1) -> dict[str, int]:
    values = MIXTRAL.symbols(b=1, t=t, etp=t, ep=1)
    return {x.id: int(x.bytes(values, 2, 1)) for x in inv.terms if x.scope == "layer"}


def test_moe_act_drops_the_experts_fc2_input():
    # TEGroupedMLP.forward with moe_act: CheckpointWithoutOutput.checkpoint(bias_act_func, fc1_output, ...) keeps its
    # inputs (fc1's output, the probabilities: saved anyway), discard_output_and_register_recompute frees its
    # output, fc2's saved input: k s b f_e x 2 B per MoE layer; nothing else (the attention core is kept: core_attn
    # not chosen)
    inv = inventory(modules="moe_act", moe_grouped_gemm=True)
    dropped = {x.id for x in inv.terms if x.dropped_by_selective}
    assert dropped == {"moe_fc2_input"}
    assert layer_bytes(inv)["moe_fc2_input"] == ROUTED
    assert not {x.id: x for x in inv.terms}["moe_fc1_output"].dropped_by_selective
    # unfused SwiGLU (--no-bias-swiglu-fusion: bias_act_func's glu then the probabilities' multiply) in the
    # checkpoint: its x_linear + offset, SiLU output and product (each k s b f_e) are dropped too
    unfused = inventory(modules="moe_act", off=("bias-swiglu",), moe_grouped_gemm=True)
    dropped = {x.id for x in unfused.terms if x.dropped_by_selective}
    assert dropped == {"moe_fc2_input", "moe_swiglu_up", "moe_silu_out", "moe_act_out"}
    assert sum(b for id, b in layer_bytes(unfused).items() if id in dropped) == 4 * ROUTED


def test_moe_act_needs_grouped_gemm_and_grouped_gemm_needs_cuda():
    with pytest.raises(MemplanError, match="moe-grouped-gemm"):
        inventory(modules="moe_act")
    with pytest.raises(MemplanError, match="need CUDA"):
        training_inventory(MIXTRAL.model_copy(update=dict(moe_grouped_gemm=True)), "megatron-local", "cpu",
                           TrainingSpec())
    p = subprocess.run([sys.executable, "-m", "memplan.cli", "estimate", "--model", "mixtral-8x7b", "--impl",
                        "megatron-local", "--device", "cpu", "--moe-permute-fusion"], capture_output=True, text=True,
                       timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "need CUDA" in lines[0], p.stderr[-2000:]


def test_legacy_grouped_mlp_ignores_the_swiglu_switch():
    # --no-bias-swiglu-fusion: SequentialMLP's experts (MLP.glu, then * probs) keep x_linear + offset, SiLU(gate) and
    # the product, each k s b f_e; TEGroupedMLP's bias_act_func the same; the legacy GroupedMLP (--transformer-impl
    # local) runs torch.compile'd activation_func_with_probs, which saves fc1's output and the probabilities only
    unfused = ("moe_swiglu_up", "moe_silu_out", "moe_act_out")
    sequential = layer_bytes(inventory("megatron-local", off=("bias-swiglu",)))
    assert [sequential[i] for i in unfused] == [ROUTED] * 3
    te_grouped = layer_bytes(inventory("megatron", off=("bias-swiglu",), moe_grouped_gemm=True))
    assert [te_grouped[i] for i in unfused] == [ROUTED] * 3
    legacy = layer_bytes(inventory("megatron-local", off=("bias-swiglu",), moe_grouped_gemm=True))
    assert not set(unfused) & set(legacy)
    assert legacy["moe_fc1_output"] == 2 * ROUTED and legacy["moe_fc2_input"] == ROUTED
    assert sum(sequential.values()) - sum(legacy.values()) == 3 * ROUTED


def test_permute_fusion_keeps_the_row_id_map():
    plain, fused = layer_bytes(inventory()), layer_bytes(inventory(moe_permute_fusion=True))
    # unfused (measured on CPU): routing map E s b bool = 65,536 B, probabilities scattered to E columns E s b x 2 B =
    # 131,072 B, permutation index k s b int64 = 131,072 B
    assert (plain["moe_routing_map"], plain["moe_probs_dense"], plain["moe_permute_index"]) == (65_536, 131_072, 131_072)
    # fused: _moe_permute_mask_map saves make_row_id_map's int32 [s b, 2 E + 1] = 17 x 8192 x 4 = 557,056 B (its
    # unpermute saves the same tensor); _moe_chunk_sort (the two sorts by local expert) an int32 per received copy
    # each: 2 x k s b x 4 = 131,072 B
    assert fused["moe_row_id_map"] == 557_056 and fused["moe_sort_chunks_map"] == 131_072
    assert not {"moe_routing_map", "moe_probs_dense", "moe_permute_index"} & set(fused)
    # with a capacity factor the router's token dropping keeps its routing map (E s b bool); the permute's is gone
    dropping = layer_bytes(inventory(moe_permute_fusion=True, moe_capacity_factor=1.25))
    assert dropping["moe_routing_map"] == 65_536
    # allgather at ep = 2: the gathered ep s b tokens x (2 E / ep + 1) int32 = 16,384 x 9 x 4 = 589,824 B; its
    # masked_select of the local probabilities stays (E/ep columns of the ep s b tokens x 2 B = 131,072 B)
    values = MIXTRAL.symbols(b=1, t=1, etp=1, ep=2)
    ag = {x.id: int(x.bytes(values, 2, 1)) for x in inventory(moe_permute_fusion=True,
                                                               moe_token_dispatcher="allgather").terms}
    assert ag["moe_row_id_map"] == 589_824 and ag["moe_probs_dense"] == 131_072 and "moe_permute_index" not in ag


def test_shared_expert_overlap_keeps_the_gathered_input():
    shared = dict(moe_shared_ffn_hidden_size=14336)
    # SharedExpertMLP.pre_forward_comm all-gathers the input (gather_from_sequence_parallel_region) and linear_fc1,
    # built without its own SP gather, saves the gathered s b h x 2 B = 67,108,864 B at t = 2; at t = 1 the copy is
    # the MLP input itself (copy_to_tensor_model_parallel_region)
    overlap = inventory(moe_shared_expert_overlap=True, **shared)
    assert layer_bytes(overlap, t=2)["shared_fc1_gathered_input"] == 67_108_864
    assert layer_bytes(overlap, t=1)["shared_fc1_gathered_input"] == 0
    assert "shared_fc1_gathered_input" not in layer_bytes(inventory(**shared), t=2)
    # combine_postprocess: the shared experts' fc2 output before the reduce-scatter, s b h x 2 B, beside the combine
    combine = {m.id: m for m in overlap.moments}["moe_combine_forward"]
    values = MIXTRAL.symbols(b=1, t=2, etp=2, ep=1)
    gathered = {x.id: int(x.bytes(values, 2, 1)) for x in combine.transients}["shared_fc2_output_gathered"]
    assert gathered == 67_108_864
    with pytest.raises(ValueError, match="alltoall"):  # megatron-core 0.16.1 TransformerConfig refuses it
        ModelSpec(**{**MIXTRAL.model_dump(exclude_unset=True), **shared, "moe_shared_expert_overlap": True,
                     "moe_token_dispatcher": "allgather"})
    with pytest.raises(MemplanError, match="shared_experts"):
        inventory(modules="shared_experts", moe_shared_expert_overlap=True, **shared)


def test_variants_emitted_for_megatron_and_bridge():
    model = MIXTRAL.model_copy(update=dict(moe_grouped_gemm=True, moe_permute_fusion=True,
                                           moe_shared_expert_overlap=True, moe_shared_ffn_hidden_size=14336))
    config = Config(model=model, parallel=ParallelSpec(dp=8), training=TrainingSpec())
    args = launch_for(config, "megatron").args
    assert {"--moe-grouped-gemm", "--moe-permute-fusion", "--moe-shared-expert-overlap"} <= set(args)
    bridge = launch_for(config, "bridge").args
    assert {"model.moe_grouped_gemm=true", "model.moe_permute_fusion=true",
            "model.moe_shared_expert_overlap=true"} <= set(bridge), bridge


def test_flex_dispatcher_with_deepep():
    # MoEFlexTokenDispatcher (DeepEP) at t = etp = 1, ep = 2: the group is etp x ep = 2 ranks, the GPU's s b = 8192
    # tokens routed to k etp = 2 of them; a GPU receives at most one token per routed copy (k s b = 16,384: the bound)
    values = MIXTRAL.symbols(b=1, t=1, etp=1, ep=2)

    def flex(**update):
        inv = inventory(moe_token_dispatcher="flex", **update)
        return {x.id: int(x.bytes(values, 2, 1)) for x in inv.terms if x.scope == "layer"}

    b = flex()
    assert b["moe_flex_topk_indices"] == 131_072  # setup_metadata torch.topk: k etp s b / t int64 = 16,384 x 8 B
    assert b["moe_deepep_token_in_rank"] == 16_384  # handle: is_token_in_rank, s b / t x etp ep ranks, bool
    assert b["moe_deepep_send_head"] == 65_536  # handle: send_head, the same shape in int32
    assert b["moe_deepep_recv_src_idx"] == 65_536  # handle: recv_src_idx, int32 per received token (16,384)
    assert b["moe_flex_multihot_mask"] == 32_768  # probs[mask]: the mask, received tokens x k etp = 16,384 x 2, bool
    assert b["moe_flex_multihot_index"] == 262_144  # index_put_: row and expert indices, 2 x 16,384 int64
    # permute (unfused) of the received tokens over E / ep = 4 local experts: the routing map (bool) and the multihot
    # probabilities (fp32) 16,384 x 4 each, the index int64 per routed copy
    assert (b["moe_routing_map"], b["moe_probs_dense"], b["moe_permute_index"]) == (65_536, 262_144, 131_072)
    assert b["moe_permuted_probs"] == 65_536  # DeepEP's fp32 probabilities, k s b x 4 B
    # fused permute: row_id_map int32, 2 E / ep + 1 = 9 per received token: 16,384 x 9 x 4 B
    fused = flex(moe_permute_fusion=True)
    assert fused["moe_row_id_map"] == 589_824 and not {"moe_routing_map", "moe_probs_dense"} & set(fused)
    # at t = etp = 2 the mask is (k s b etp / t received) x k etp = 16,384 x 4 bool
    values = MIXTRAL.symbols(b=1, t=2, etp=2, ep=2)
    inv = inventory(moe_token_dispatcher="flex")
    assert {x.id: int(x.bytes(values, 2, 1)) for x in inv.terms}["moe_flex_multihot_mask"] == 65_536
    with pytest.raises(ValueError, match="pad"):  # DeepEP refuses padding to capacity
        ModelSpec(**{**MIXTRAL.model_dump(exclude_unset=True), "moe_token_dispatcher": "flex",
                     "moe_capacity_factor": 1.0, "moe_pad_to_capacity": True})
    with pytest.raises(ValueError, match="etp x ep > 1"):
        Config(model=MIXTRAL.model_copy(update=dict(moe_token_dispatcher="flex")), parallel=ParallelSpec(dp=8),
               training=TrainingSpec())
    config = Config(model=MIXTRAL.model_copy(update=dict(moe_token_dispatcher="flex")), parallel=ParallelSpec(dp=8, ep=8),
                    training=TrainingSpec())
    assert {"--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend deepep"} <= set(
        launch_for(config, "megatron").args)
    assert "model.moe_flex_dispatcher_backend=deepep" in launch_for(config, "bridge").args
