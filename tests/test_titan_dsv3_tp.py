"""torchtitan 0.3.0's DeepSeek-V3 with tensor parallelism and context parallelism (--impl torchtitan --tp T / --cp C
on a DeepSeek-V3 model) against torchtitan's own code run over gloo.

validation/titan_dsv3_tp.py ``dsv3_tp_rank`` builds torchtitan's 2-layer DeepSeek-V3 (tests/test_titan_dsv3.py's
shape: h 64, 4 heads, r_q 32, r_kv 48, d_n 16, d_r 8, d_v 12, dense f 96; 16 experts of 32 in 8 groups, 4 chosen,
one shared, top-2; vocab 256; layer 0 dense, layer 1 MoE) with ``set_deepseek_v3_sharding_config`` (sequence
parallelism on) and runs ``parallelize_deepseekv3`` with ``tensor_parallel_degree`` 2 on 2 ranks (ep 1 and 2),
balanced routing, one AdamW step. RECORDED holds what each layer kept per rank (both ranks alike), from

    MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_dsv3_tp.py -k gloo     (~80 s a run)
    PYTHONPATH=. python -m validation.titan_dsv3_tp tp none|selective-op|full 1|2

The fast tests hold memplan's per-rank terms (memplan/inventory/titan_dsv3.py) against the recorded storages term by
term (a multiset of bytes), so removing any term fails; the grouped GEMMs' int32 offsets (4 E / ep bytes a layer) are
the one storage memplan leaves out.  Needs torchtitan."""

import os
from collections import Counter

import pytest

pytest.importorskip("torchtitan")

from memplan.api.estimating import estimate  # noqa: E402
from memplan.core.training import Recompute  # noqa: E402
from memplan.inventory.titan import titan_model  # noqa: E402
from memplan.inventory.titan_dsv3 import dsv3_layer_terms  # noqa: E402
from memplan.inventory.titan_moe import moe_etp  # noqa: E402
from memplan.memory.states import param_groups  # noqa: E402
from tests.test_titan_dsv3 import DENSE_IDS, SHAPE, _model  # noqa: E402

T, S, B, V = 2, 16, 2, 256  # global s b = 32 tokens, 16 on a rank's sequence shard
REC = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE, "full": Recompute.FULL}
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
OFFSETS = {1: 4 * SHAPE.E, 2: 4 * SHAPE.E // 2}  # the grouped GEMMs' int32 offsets (not modelled)

# measured per rank: bytes of each storage a layer keeps after its forward (its output and parameters apart), the
# dense layer 0 and the MoE layer 1 (both ranks alike).  Attention (both layers): attention_norm's fp32 x, rstd and
# x * rstd sequence-sharded (16 tokens), its output all-gathered (32 tokens x 2h = 4096); q_norm and kv_norm on the
# whole sequence (wq_a / wkv_a replicated: 32 x r fp32, rstd, x * rstd, bf16 output); q, wkv_b's output, k, the
# attention output, lse and its contiguous copy on the rank's 2 heads (/ t); the dense FFN's four / t.  The model
# called with the dataloader's positions, as torchtitan's Trainer calls it: the RoPE rows gathered at them, 4 d_r x all
# 32 tokens = 1024, whole on each TP rank
NONE_ATTN = [4096, 64, 4096, 4096, 4096, 128, 4096, 2048, 1024, 3072, 6144, 128, 6144, 3072, 3584, 3072, 1536, 256,
             1536]
DENSE_NONE = NONE_ATTN + [4096, 64, 4096, 4096, 3072, 3072, 3072, 3072]
# selective-op: wq_a 2048 and wkv_a 3584 whole (matmuls 1, 3), attention out 1536 + lse 256 / t, wo's partial sums
# whole 4096 (matmul 5) and reduce-scattered 2048, then w3 / t 3072 (7) and w2 reduce-scattered 2048
SEL_ATTN = [2048, 3584, 1536, 256, 4096, 2048]
RECORDED = {
    (1, "none", "dense"): DENSE_NONE,
    # ep 1: the MoE's input all-gathered (ffn_norm's output 4096); router and dispatcher over all 32 tokens (sigmoid
    # 1024, ids 512, scores 128, route_norm 64, argsort 512, sorted 128, token idx 512, copies 8192), offsets 64,
    # the experts' four k s b fe / t (2048), combine's fp32 16384, the shared expert's four / t on all tokens (1024)
    (1, "none", "moe"): NONE_ATTN + [4096, 64, 4096, 4096, 1024, 512, 128, 64, 512, 128, 512, 8192, 64, 2048, 2048,
                                     2048, 2048, 16384, 1024, 1024, 1024, 1024],
    (2, "none", "dense"): DENSE_NONE,
    # ep 2: ffn_norm's own output sequence-sharded (2048: the router's and routed experts' input), every routed
    # tensor over the rank's 16 tokens, the permutation index 256, offsets 32; the shared expert all-gathers its input
    # (4096) and keeps its four / t on all 32 tokens
    (2, "none", "moe"): NONE_ATTN + [4096, 64, 4096, 2048, 512, 256, 64, 32, 256, 64, 256, 256, 4096, 32, 2048, 2048,
                                     2048, 2048, 8192, 4096, 1024, 1024, 1024, 1024],
    (1, "selective-op", "dense"): SEL_ATTN + [3072, 2048],
    # the group-limited routing's topk outputs over all 32 tokens (group top-2 2048 + 4096, the 4 groups 512 + 1024,
    # top-k 256 + 512), the routed output reduce-scattered 2048, the shared w3 / t 1024 (matmul 7), its w2's output
    # reduce-scattered 2048
    (1, "selective-op", "moe"): SEL_ATTN + [2048, 4096, 512, 1024, 256, 512, 2048, 1024, 2048],
    (2, "selective-op", "dense"): SEL_ATTN + [3072, 2048],
    # ep 2: the topk outputs over the rank's 16 tokens, the all-to-alls' outputs (counts 128 = E int64, received
    # copies 4096, combined 4096), no reduce-scatter of the routed output (already sequence-sharded)
    (2, "selective-op", "moe"): SEL_ATTN + [1024, 2048, 256, 512, 128, 256, 128, 4096, 4096, 1024, 2048],
    (1, "full", "dense"): [], (1, "full", "moe"): [], (2, "full", "dense"): [], (2, "full", "moe"): [],
}
INPUT_KEPT = {"none": False, "selective-op": True, "full": True}
INPUT_BYTES = 2048  # the block input: 16 tokens x 2h
STATES = {"params": 408448, "grads": 408448, "adam": 816896}  # per rank after one AdamW step, ep 1 and 2 alike


def _terms(model=None):
    return dsv3_layer_terms(model or titan_model(_model()), "cpu")


def _memplan(ac, moe, values, terms, sp=1):
    """memplan's kept bytes of one layer (the dense or the MoE one: each kind's terms weighted 1/2 at L = 2, undone
    here) on one rank, the block input apart."""
    out = Counter()
    for t in terms:
        dense = t.id in DENSE_IDS or t.id == "w2.rs"
        kind = dense or t.id.startswith(("moe.", "shared.", "mm.shared"))
        if t.id == "input" or not t.kept(REC[ac]) or (kind and dense == moe):
            continue
        n = t.bytes(values, 2, sp) * (2 if kind else 1)
        if n:
            out[int(n) // t.storages] += t.storages
    return out


def _tp_values(ep):
    return {**titan_model(_model()).symbols(b=B, t=T, cp=1, ep=ep, etp=moe_etp(ep, T)), "s": S}


def _recorded(ep, ac, kind):
    rec = Counter(RECORDED[ep, ac, kind])
    if kind == "moe" and ac == "none":
        rec[OFFSETS[ep]] -= 1
    return +rec


@pytest.mark.parametrize("ep, ac, kind", sorted(RECORDED))
def test_tp_recorded_layer_equals_memplan_term_by_term(ep, ac, kind):
    assert _recorded(ep, ac, kind) == _memplan(ac, kind == "moe", _tp_values(ep), _terms())


# context parallelism: each layer with torchtitan's FlexAttention under its apply_cp_to_forward on rank 0 of a fake
# cp group of 2, 16 tokens of each of 2 sequences on the rank (validation/titan_dsv3_tp.py measure_dsv3_cp):
#   PYTHONPATH=. python -m validation.titan_dsv3_tp cp none|selective-op|full
# none: K (a (d_n + d_r) = 96 wide) and V (a d_v = 48, made contiguous) of the whole 64-token sequence all-gathered
# (12288, 6144) in place of the rank's k and wkv_b's output; everything else the rank's 32 tokens as without CP (the
# RoPE rows gathered at the rank's own positions 4 d_r x 32 = 1024)
CP_S_LOCAL = 16
CP_ATTN = [8192, 128, 8192, 4096, 4096, 128, 4096, 2048, 1024, 6144, 6144, 128, 6144, 3072, 12288, 6144, 3072, 512,
           3072]
RECORDED_CP = {
    ("none", "dense"): CP_ATTN + [8192, 128, 8192, 4096, 6144, 6144, 6144, 6144],
    ("none", "moe"): CP_ATTN + [8192, 128, 8192, 4096, 1024, 512, 128, 64, 512, 128, 512, 8192, 64, 4096, 4096, 4096,
                                4096, 16384, 2048, 2048, 2048, 2048],
    ("selective-op", "dense"): [2048, 3584, 3072, 512, 4096, 6144],
    ("selective-op", "moe"): [2048, 3584, 3072, 512, 4096, 2048, 4096, 512, 1024, 256, 512, 2048],
    ("full", "dense"): [], ("full", "moe"): [],
}


def _cp_values():
    return {**titan_model(_model()).symbols(b=B, t=1, cp=2, ep=1, etp=1), "s": 2 * CP_S_LOCAL}


@pytest.mark.parametrize("ac, kind", sorted(RECORDED_CP))
def test_cp_recorded_layer_equals_memplan_term_by_term(ac, kind):
    rec = Counter(RECORDED_CP[ac, kind])
    if kind == "moe" and ac == "none":
        rec[4 * SHAPE.E] -= 1
    assert +rec == _memplan(ac, kind == "moe", _cp_values(), _terms(), sp=0)


def test_a_removed_term_fails():
    # every term of the layer (the block input apart: input_kept) is needed by one of the TP or CP recordings
    terms = _terms()
    cases = [(ac, kind == "moe", _tp_values(ep), 1, _recorded(ep, ac, kind)) for ep, ac, kind in RECORDED]
    cases += [(ac, kind == "moe", _cp_values(), 0, None) for ac, kind in RECORDED_CP]
    for drop in {t.id for t in terms} - {"input"}:
        less = [t for t in terms if t.id != drop]
        assert any(_memplan(ac, moe, v, less, sp) != _memplan(ac, moe, v, terms, sp) for ac, moe, v, sp, _ in cases), drop


def _yaml(tmp_path):
    import yaml
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": _model().model_dump(exclude={"inventory"})}))
    return str(path)


def test_states_by_hand(tmp_path):
    # a rank's fp32 parameters at tp 2, dp 1 (both layers' attention: wq_a 32 x 64 and wkv_a 56 x 64 replicated, q_norm
    # 32, kv_norm 48, wq_b 48 x 32, wkv_b 56 x 48, wo 64 x 24 (/ t), two norms 2 x 64: 11,600; the dense FFN 3 x 48 x
    # 64: 9,216; the MoE: experts 3 x 16 x 16 x 64 at ep 1 (fe / t) or 3 x 8 x 32 x 64 at ep 2 (E / ep): 49,152, the
    # gate 16 x 64, the shared expert 3 x 16 x 64: 53,248; the embedding and LM head 128 x 64 each (/ t), the final
    # norm 64): 102,112 x 4 B
    n = 2 * 11600 + 9216 + 53248 + 2 * 8192 + 64
    assert 4 * n == STATES["params"]
    for ep in (1, 2):
        st = estimate(_yaml(tmp_path), impl="torchtitan", gpus=2, tp=2, ep=ep, micro_batch=B, global_batch=B,
                      seq_len=S * T, ac="full").estimate.peak.states
        assert st.gradients == STATES["grads"] and st.optimizer == STATES["params"] + STATES["adam"], ep


@pytest.mark.parametrize("ep", [1, 2])
def test_parallelized_parameters_per_rank_equal_memplan(ep, tmp_path):
    # measured cheaply: torchtitan's own parallelize_deepseekv3 (tp 2) on the meta device, rank 0 of a fake process
    # group (validation/titan_dsv3_tp.py dsv3_tp_local_params, ~2 s): the rank's parameters are the gloo run's
    # (STATES) and memplan's fp32 gradients / 4
    from validation.titan_dsv3_tp import dsv3_tp_local_params
    n = dsv3_tp_local_params(SHAPE, T, ep, V)
    st = estimate(_yaml(tmp_path), impl="torchtitan", gpus=2, tp=2, ep=ep, micro_batch=B, global_batch=B,
                  seq_len=S * T, ac="full").estimate.peak.states
    assert 4 * n == STATES["params"] == st.gradients


def test_latent_projections_replicated_by_hand():
    # torchtitan keeps wq_a (32 x 64) and wkv_a (56 x 64) whole on each TP rank (set_deepseek_v3_sharding_config:
    # Replicate), the up projections split: a rank's QKV group at t = 2 is 2048 + 3584 + (1536 + 2688 ... ) / 2;
    # split over t (mla_down_replicated off, Megatron-LM's local spec) it is (2048 + 3584) / 2 smaller
    model = titan_model(_model())
    assert model.mla_down_replicated and not _model().mla_down_replicated

    def qkv(m):
        return next(g for g in param_groups(m) if g.name == "QKV projection weight").per_gpu(m.symbols(t=T))
    assert qkv(model) == 2048 + 3584 + (48 * 2 * 32 + 56 * 2 * 48) // 2
    assert qkv(model) - qkv(_model()) == (2048 + 3584) // 2


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("ac", sorted(REC))
def test_tp_gloo_equals_recorded(ep, ac):
    from validation.titan_dsv3_tp import measure_dsv3_tp
    for rank in measure_dsv3_tp(SHAPE, ac, tp=T, ep=ep, vocab=V, s=S, b=B):
        assert [n for _, _, n in rank["layer"]] == RECORDED[ep, ac, "dense"]
        assert [n for _, _, n in rank["moe_layer"]] == RECORDED[ep, ac, "moe"]
        assert rank["input_kept"] == rank["moe_input_kept"] == INPUT_KEPT[ac]
        assert rank["input_bytes"] == INPUT_BYTES and {k: rank[k] for k in STATES} == STATES


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", sorted(REC))
def test_cp_fake_group_equals_recorded(ac):
    from validation.titan_dsv3_tp import measure_dsv3_cp
    for kind in ("dense", "moe"):
        got = measure_dsv3_cp(SHAPE, 2, CP_S_LOCAL, B, ac, moe=kind == "moe")
        assert [n for _, _, n in got["rows"]] == RECORDED_CP[ac, kind] and got["input_kept"] == (ac != "none")


def test_dsv3_flavour_equals_torchtitans_config():
    # memplan's deepseek-v3 preset is the key of torchtitan's 671B flavour (its config, not built)
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    from memplan.launch.titan import DSV3_FLAVORS
    (key, (name, _)), = DSV3_FLAVORS.items()
    cfg = deepseekv3_configs[name](attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
                                   num_mtp_layers=0)
    moe = cfg.layers[-1]
    attn, experts = moe.attention, moe.moe.routed_experts.inner_experts
    dense = sum(layer.moe is None for layer in cfg.layers)
    assert (len(cfg.layers), dense, cfg.dim, attn.n_heads, attn.q_lora_rank, attn.kv_lora_rank, experts.num_experts,
            experts.hidden_dim, moe.moe.router.top_k, cfg.vocab_size) == key
    assert estimate("deepseek-v3", impl="torchtitan", gpus=8, ep=8, global_batch=8,
                    emit="torchtitan").launch.document["flavor"] == name


def test_tp_cp_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # a tp 2 / cp 2 / ep 4 plan on 16 GPUs (dp_shard 4): torchtitan's ConfigManager loads the emitted module (its
    # shipped deepseek_v3_671b with the plan's settings) and its ParallelDims takes the degrees for a world of 16
    from torchtitan.distributed.parallel_dims import ParallelDims

    from tests.test_launch_titan import _load
    result = estimate("deepseek-v3", impl="torchtitan", gpus=16, tp=2, cp=2, ep=4, ac="selective-op", seq_len=8192,
                      micro_batch=1, global_batch=8, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    par = config.parallelism
    assert (par.tensor_parallel_degree, par.context_parallel_degree, par.expert_parallel_degree,
            par.data_parallel_shard_degree, par.spmd_backend) == (2, 2, 4, 4, "partial_dtensor")
    assert config.model_spec.name == "deepseek_v3" and config.model_spec.flavor == "671B"
    assert len(config.model_spec.model.layers) == 61 and config.training.seq_len == 8192
    assert type(config.activation_checkpoint).__qualname__ == "SelectiveAC.Config"
    dims = ParallelDims.from_config(par, world_size=16)
    assert (dims.tp, dims.cp, dims.ep, dims.dp_shard) == (2, 2, 4, 4)


def test_search_lists_tp_plans_and_agrees_with_estimate():
    # search --tp 2 on deepseek-v3: the plans carry tp 2 (ep over the divisors of E dividing dp_shard x tp, the experts
    # fe / t wide at ep 1 only), and a listed plan is what estimate gives for its settings
    from memplan import search

    base = dict(impl="torchtitan", gpus=256, tp=2, global_batch=256, gpu="h100-80gb", seq_len=4096)
    found = search("deepseek-v3", all_variants=True, **base).result
    plans = found.evaluated.plans
    assert set(plans.t.tolist()) == {2} and {1, 2, 256} <= set(plans.ep.tolist())
    assert (plans.expert_tp == [2 if e == 1 else 1 for e in plans.ep.tolist()]).all()
    dims = found.row(found.top[0])["torchtitan"]
    est = estimate("deepseek-v3", **base, ep=dims["ep"], ac=dims["ac"], dp_replicate=dims["dp_replicate"],
                   micro_batch=dims["local_batch"])
    assert found.row(found.top[0])["memory"]["device_bytes"] == est.device_bytes
