"""torchtitan 0.3.0's Qwen3 MoE plans beyond FSDP2 + EP (memplan/inventory/titan_moe.py check_titan_moe,
memplan/plan/titan.py, memplan/launch/titan.py): `--emit torchtitan` of an MoE plan loaded by torchtitan's own
ConfigManager and its ParallelDims building the meshes (on a fake process group: torchtitan's sparse mesh (pp,
dp_replicate, efsdp, ep) with efsdp = dp_shard cp tp / ep); pipeline parallelism and HSDP with EP, their states
derived by hand from torchtitan's meshes. Needs torchtitan (the test extra)."""

import os
import sys

import pytest

from memplan.api.estimating import estimate
from memplan.api.searching import search
from memplan.cli import main
from memplan.core.errors import MemplanError
from memplan.core.training import Recompute
from memplan.inventory.titan import titan_inventory
from memplan.launch.titan import FUNCTION, MODULE, QWEN3_MOE_FLAVORS
from memplan.memory.pipeline import schedule_in_flight, titan_stage_layers
from memplan.presets.catalog import load_model

pytest.importorskip("torchtitan")

import torch.distributed as dist  # noqa: E402
import torchtitan.distributed.parallel_dims as titan_dims  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.models.qwen3 import qwen3_configs  # noqa: E402

# qwen3-30b-a3b (torchtitan's "30B-A3B"): a layer's dense parameters wqkv 2048 x (32 + 2 x 4) x 128, wo 32 x 128 x
# 2048, two norms 2 x 2048, the q / k norms 2 x 128, the router 128 x 2048: 19,140,864; its experts 3 x 128 x 2048 x
# 768 = 603,979,776; the embedding and the LM head 151,936 x 2048 = 311,164,928 each, the final norm 2048
H, V, L = 2048, 151936, 48
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
DENSE, EXPERTS, EMBED = 19_140_864, 603_979_776, 311_164_928


def _load(tmp_path, monkeypatch, launch):
    """torchtitan's ConfigManager on the emitted module, as `torchtitan.train --module M --config F` parses it."""
    (tmp_path / f"{MODULE}.py").write_text("\n".join(launch.args) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return ConfigManager().parse_args(["--module", MODULE, "--config", FUNCTION])


@pytest.fixture
def world(monkeypatch):
    """torchtitan's ParallelDims building its meshes for a world of n ranks on torch's fake process group."""
    monkeypatch.setattr(titan_dims, "device_type", "cpu")
    started = []

    def meshes(parallelism, n):
        if started:
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
        started.append(n)
        dims = ParallelDims.from_config(parallelism, world_size=n)
        dims.build_mesh()
        return dims

    yield meshes
    if started:
        dist.destroy_process_group()


def test_flavours_equal_torchtitans_configs():
    for (layers, dim, heads, kv, head_dim, experts, fe, k, vocab), (name, _) in QWEN3_MOE_FLAVORS.items():
        cfg = qwen3_configs[name](attn_backend="flex")
        attn, moe = cfg.layers[0].attention, cfg.layers[0].moe
        assert (len(cfg.layers), cfg.dim, attn.n_heads, attn.n_kv_heads, attn.head_dim, moe.num_experts,
                moe.routed_experts.inner_experts.hidden_dim, moe.router.top_k, cfg.vocab_size) == (
            layers, dim, heads, kv, head_dim, experts, fe, k, vocab)
        assert moe.shared_experts is None  # what memplan's Qwen3 MoE layout has (titan.py is_qwen3_moe)


def test_moe_plan_builds_in_torchtitan(tmp_path, monkeypatch, world):
    # --ep 8 on 16 GPUs: dp_shard 16, the experts' FSDP over efsdp = 16 / 8 = 2 (torchtitan's own meshes say so)
    result = estimate("qwen3-30b-a3b", impl="torchtitan", gpus=16, ep=8, ac="selective-op", seq_len=4096,
                      micro_batch=1, global_batch=32, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, result.launch)
    par = config.parallelism
    assert config.model_spec.flavor == "30B-A3B" and len(config.model_spec.model.layers) == 48
    assert (par.data_parallel_shard_degree, par.expert_parallel_degree, par.spmd_backend) == (16, 8, "partial_dtensor")
    assert type(config.loss).__qualname__ == "CrossEntropyLoss.Config"
    # torchtitan's Trainer.Config refuses CUDA graphs with the all-to-all dispatcher (the module would not load)
    assert config.training.disable_cuda_graphs and result.launch.document["training.disable_cuda_graphs"]
    assert (config.training.local_batch_size, config.training.global_batch_size) == (1, 32)
    dims = world(par, 16)
    assert (dims.get_mesh("ep").size(), dims.get_mesh("efsdp").size()) == (8, 2)


def test_tp_cp_ep_plan_states_by_hand_and_in_torchtitan(tmp_path, monkeypatch, world):
    # --tp 2 --cp 2 --ep 4 on 16 GPUs: dp_shard 4, torchtitan's efsdp = dp_shard cp tp / ep = 4; the experts whole
    # (etp 1 at ep > 1: tests/test_titan_moe_tp.py), E / 4 of them a GPU, FSDP2 over efsdp 4: 16 B / 16 per expert
    # parameter; wqkv, wo (18,874,368 a layer), the embedding and the LM head TP-sharded, FSDP2 over dp_shard x cp = 8:
    # / 16; the norms and the router (266,496 a layer) and the final norm replicated over tp: / 8
    kw = dict(impl="torchtitan", gpus=16, tp=2, cp=2, ep=4, ac="full", seq_len=4096, micro_batch=1, global_batch=8)
    result = estimate("qwen3-30b-a3b", emit="torchtitan", **kw)
    per_rank = L * (18_874_368 // 16 + 266_496 // 8 + EXPERTS // 16) + 2 * EMBED // 16 + H // 8
    st = result.estimate.peak.states
    assert st.gradients == 4 * per_rank and st.optimizer == 12 * per_rank
    config = _load(tmp_path, monkeypatch, result.launch)
    par = config.parallelism
    assert (par.tensor_parallel_degree, par.context_parallel_degree, par.expert_parallel_degree,
            par.data_parallel_shard_degree, par.spmd_backend) == (2, 2, 4, 4, "partial_dtensor")
    dims = world(par, 16)
    assert (dims.get_mesh("tp").size(), dims.get_mesh("cp").size(), dims.get_mesh("ep").size(),
            dims.get_mesh("efsdp").size()) == (2, 2, 4, 4)


def test_235b_plan_starts_from_the_30b_config(tmp_path, monkeypatch):
    # 0.3.0 ships no qwen3_235b_a22b config: the module swaps the model of qwen3_30b_a3b, and says so
    result = estimate("qwen3-235b-a22b", impl="torchtitan", gpus=64, ep=16, ac="full", seq_len=4096, micro_batch=1,
                      global_batch=64, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, result.launch)
    assert config.model_spec.flavor == "235B-A22B" and len(config.model_spec.model.layers) == 94
    assert config.parallelism.expert_parallel_degree == 16
    assert any("ships no 235B-A22B config" in n for n in result.launch.notes)


def test_hsdp_with_ep_states_by_hand_and_in_torchtitan(tmp_path, monkeypatch, world):
    # --dp-replicate 2 --ep 4 on 16 GPUs: dp_shard 8; torchtitan's sparse mesh (dp_replicate 2, efsdp 8 / 4 = 2, ep 4):
    # each GPU keeps its E / 4 experts' fp32 states sharded over 2, the dense ones over 8: 16 B / 8 per parameter
    # either way (the replicas hold copies), as FSDP2 over 8 ranks without EP would
    kw = dict(impl="torchtitan", gpus=16, ac="full", seq_len=1024, micro_batch=1, global_batch=16)
    result = estimate("qwen3-30b-a3b", dp_replicate=2, ep=4, emit="torchtitan", **kw)
    total = 2 * EMBED + H + L * (DENSE + EXPERTS)
    st = result.estimate.peak.states
    assert st.optimizer == -(-12 * total // 8) and st.gradients == -(-4 * total // 8)
    # in flight: the running and the prefetched layer (bf16) with the GPU's 32 experts, and the head
    # + each layer's RoPE cache (CosSinRoPE: fp32 cos, sin [s, 2d] = 8 s d B; tests/test_titan.py)
    assert st.weights == 2 * (2 * (DENSE + EXPERTS // 4) + EMBED + H) + L * 8 * 1024 * 128
    config = _load(tmp_path, monkeypatch, result.launch)
    par = config.parallelism
    assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree, par.expert_parallel_degree) == (2, 8, 4)
    dims = world(par, 16)
    assert (dims.get_mesh("dp_replicate").size(), dims.get_mesh("efsdp").size(), dims.get_mesh("ep").size()) == (2, 2, 4)


def test_ep_not_dividing_the_shard_group_refused_as_torchtitan_refuses(capsys, world):
    # dp_replicate 2 x dp_shard 8 with ep 16: torchtitan's mesh cannot be unflattened (efsdp = 8 / 16); memplan says so
    # in one line
    from torchtitan.config import ParallelismConfig

    with pytest.raises(ValueError):
        world(ParallelismConfig(data_parallel_replicate_degree=2, data_parallel_shard_degree=8,
                                expert_parallel_degree=16), 16)
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--model", "qwen3-30b-a3b", "--impl", "torchtitan", "--gpus", "16", "--dp-replicate", "2",
              "--ep", "16"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "shard group" in err, err
    with pytest.raises(MemplanError, match="shard group"):  # pp 2 leaves a shard group of 8
        estimate("qwen3-30b-a3b", impl="torchtitan", gpus=16, pp=2, ep=16)


def test_pp_with_ep_states_and_activations_by_hand():
    # --pp 2 --ep 8 on 16 GPUs: dp_shard 8, efsdp 1. torchtitan's split of 48 layers: 24 + 24, stage 0 with the
    # embedding. A GPU holds its stage's dense parameters and its E / 8 = 16 experts of each layer:
    kw = dict(impl="torchtitan", gpus=16, ep=8, seq_len=1024, micro_batch=1, global_batch=16)
    est = estimate("qwen3-30b-a3b", pp=2, ac="none", **kw).estimate
    assert titan_stage_layers(2, L) == (24, 24)
    dense0, experts0 = EMBED + 24 * DENSE, 24 * EXPERTS // 8
    s0 = est.stages[0]
    # with PP FSDP2 keeps the stage unsharded in bf16 all step (2 B / parameter) and its gradients accumulated
    # unsharded in fp32 (4 B), the rank's experts only (memplan/memory/dp_stack.py, derived); the sharded fp32
    # gradients and AdamW's master + moments: the dense ones over 8, the experts' over efsdp = 1
    # + each layer's RoPE cache (CosSinRoPE: fp32 cos, sin [s, 2d] = 8 s d B; tests/test_titan.py)
    assert s0.states.weights == 2 * (dense0 + experts0) + 24 * 8 * 1024 * 128
    assert s0.states.gradients == 4 * dense0 // 8 + 4 * experts0 + 4 * (dense0 + experts0)
    assert s0.states.optimizer == 12 * dense0 // 8 + 12 * experts0
    # 1F1B: stage 0 holds min(M, p) = 2 micro-batches (M = 16 / 8) of its 24 MoE layers' kept tensors (a layer's
    # terms measured in tests/test_titan_moe.py: here the pp = 1 plan's per-layer bytes) and the token ids (8 s b)
    layer = estimate("qwen3-30b-a3b", ac="none", **kw).estimate.per_layer_bytes
    assert s0.activations == 2 * (24 * layer + 8 * 1024)
    gpipe = estimate("qwen3-30b-a3b", pp=2, ac="none", pipeline_schedule="GPipe", **kw).estimate.stages[0]
    assert gpipe.activations == s0.activations  # M = 2: GPipe holds both as well


def test_split_backward_schedules_refused_with_moe(capsys):
    # the zero-bubble schedules' I -> W gradients are the dense block's (memplan/inventory/titan.py): refused
    for kind in ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"):
        with pytest.raises(SystemExit) as exit_:
            main(["estimate", "--model", "qwen3-30b-a3b", "--impl", "torchtitan", "--gpus", "16", "--pp", "2",
                  "--ep", "8", "--global-batch", "64", "--pipeline-schedule", kind])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and "MoE" in err, err


def test_searched_pp_ep_plan_builds_in_torchtitan(tmp_path, monkeypatch, world):
    # search --pp 2 --emit torchtitan: the best listed MoE plan's module; torchtitan's meshes take it for 16 ranks
    found = search("qwen3-30b-a3b", impl="torchtitan", gpus=16, pp=2, seq_len=4096, global_batch=32, mem=70 * 10**9,
                   gpu="h100-80gb", emit="torchtitan")
    dims = found.result.row(found.result.top[0])["torchtitan"]
    assert dims["pp"] == 2 and dims["ep"] > 1
    config = _load(tmp_path, monkeypatch, found.launch["qwen3-30b-a3b"])
    par = config.parallelism
    assert (par.pipeline_parallel_degree, par.pipeline_parallel_schedule, par.expert_parallel_degree) == (
        2, dims["pipeline_schedule"], dims["ep"])
    assert (config.training.local_batch_size, par.pipeline_parallel_microbatch_size) == (
        dims["local_batch"], dims["pipeline_microbatch_size"])
    built = world(par, 16)
    assert built.get_mesh("pp").size() == 2 and built.get_mesh("efsdp").size() * dims["ep"] == dims["dp_shard"]
    # and the search tries HSDP with EP where ep divides the shard group
    found = search("qwen3-30b-a3b", impl="torchtitan", gpus=16, dp_replicate=2, seq_len=4096, global_batch=32,
                   gpu="h100-80gb", all_variants=True).result
    plans = found.evaluated.plans
    assert set(plans.ep.tolist()) == {1, 2, 4, 8} and ((plans.d // plans.shard) == 2).all()
    assert ((plans.shard * plans.t) % plans.ep == 0).all()  # efsdp = dp_shard tp / ep (tp searched: moe_tp)


# torchtitan's pipelined Qwen3 MoE measured over gloo (validation/titan_pp.py pp_rank with a MoeShape: the tiny
# 4-layer model of validation/titan_moe.py, vocabulary 128, split by torchtitan's own _generate_llm_fqn_per_model_part
# and _split_module, torch's Schedule1F1B / ScheduleGPipe, M = 4 micro-batches of s b = 16 x 1, no EP, balanced
# routing, AC none; the dataloader's positions a model kwarg of every stage, as torchtitan's Trainer passes them), the
# most bytes of saved tensors alive on each stage:
#   MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_moe_plans.py -k gloo   (~60 s a schedule)
RECORDED_PP = {"1F1B": [254208, 145860], "GPipe": [507904, 581904]}


def _tiny_moe():
    from validation.titan_moe import MoeShape
    shape = MoeShape()
    spec = load_model("qwen3-30b-a3b").model.model_copy(update=dict(
        hidden_size=shape.h, num_attention_heads=shape.a, num_kv_heads=shape.g, head_dim=shape.d,
        num_experts=shape.E, moe_top_k=shape.k, moe_ffn_hidden_size=shape.fe, seq_length=16, num_layers=4,
        vocab_size=128))
    return shape, spec


def _pp_expected(kind):
    """What memplan counts per stage: the micro-batches in flight (memplan's schedule) times the stage's MoE layers'
    kept bytes (its terms, measured per layer in tests/test_titan_moe.py), the last stage's final norm and fp32
    log-softmax; plus what the run adds and memplan leaves out (the dense pp test's: the token ids' one storage of
    8 s b M, nll_loss's 4-byte total_weight per micro-batch on the last stage; and the grouped GEMMs' int32 offsets,
    4 E a layer, titan_moe.py)."""
    shape, spec = _tiny_moe()
    s, b, m, v = 16, 1, 4, 128
    values = spec.symbols(b=b, t=1, cp=1, ep=1, etp=1)
    terms = titan_inventory(spec, "cpu").terms
    layer = sum(t.bytes(values, 2, 0) for t in terms if t.scope == "layer" and t.kept(Recompute.NONE))
    norm = (10 * shape.h + 4) * s * b  # the final RMSNorm on CPU (tests/test_titan_pp.py)
    split = titan_stage_layers(2, 4)
    flight = [schedule_in_flight(i, 2, 1, m, kind)[0] for i in (0, 1)]
    offsets = 4 * shape.E
    return ([flight[0] * split[0] * (layer + offsets) + 8 * s * b * m,
             flight[1] * (split[1] * (layer + offsets) + norm + 4 * v * s * b + 4) + 8 * s * b * m], layer)


@pytest.mark.parametrize("kind", sorted(RECORDED_PP))
def test_pipelined_moe_recorded_equals_memplan(kind):
    expected, layer = _pp_expected(kind)
    assert RECORDED_PP[kind] == expected
    assert layer > 0


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("kind", sorted(RECORDED_PP))
def test_pipelined_moe_gloo_equals_recorded(kind):
    from validation.titan_moe import MoeShape
    from validation.titan_pp import measure_pp

    ranks = measure_pp(MoeShape(), 4, 128, s=16, b=1, microbatches=4, schedule=kind)
    assert [r["saved_peak"] for r in ranks] == RECORDED_PP[kind]
    assert [sum(n.startswith("layers.") for n in r["modules"]) for r in ranks] == [2, 2]


# HSDP with EP measured: torchtitan's own parallelize_qwen3 on 4 ranks over gloo, data_parallel_replicate_degree 2
# (dp_shard 2), expert_parallel_degree 2 (efsdp 1), the 2-layer tiny model, one AdamW step; all four ranks alike:
#   MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_moe_plans.py -k hsdp_gloo   (~55 s)
# By hand (tests/test_titan_moe.py RECORDED_STATES): the dense 2 x 12,960 + 2 x 256 x 64 + 64 = 58,752 parameters
# sharded over dp_shard 2 (29,376), the rank's 4 of 8 experts whole (2 x 3 x 4 x 32 x 64 = 49,152): 78,528 fp32
# a rank, the same as FSDP2 over 2 ranks with ep 2 (each replica a copy); the running layer 2 x (12,960 + 24,576)
RECORDED_HSDP = {"params": 314112, "grads": 314112, "adam": 628224, "running": 75072}


def test_hsdp_ep_states_equal_the_recorded_run(tmp_path):
    import yaml

    _, spec = _tiny_moe()
    path = tmp_path / "tiny.yaml"
    spec = spec.model_copy(update=dict(num_layers=2, vocab_size=256, name="tiny-qwen3-moe"))
    path.write_text(yaml.safe_dump({"model": spec.model_dump(exclude={"inventory"})}))
    got = RECORDED_HSDP
    assert got["params"] == 4 * (29_376 + 49_152) and got["running"] == 2 * (12_960 + 24_576)
    st = estimate(str(path), impl="torchtitan", gpus=4, dp_replicate=2, ep=2, micro_batch=2, global_batch=8,
                  ac="full").estimate.peak.states
    assert st.gradients == got["grads"] and st.optimizer == got["params"] + got["adam"]
    # in flight: the running layer (measured), the prefetched one (derived) and the head (256 x 64 + 64)
    # + each layer's RoPE cache (CosSinRoPE: fp32 cos, sin [s, 2d] = 8 s d B; tests/test_titan.py)
    assert st.weights == 2 * got["running"] + 2 * (256 * 64 + 64) + 2 * 8 * 16 * 16


@pytest.mark.slow
@SLOW
def test_hsdp_gloo_equals_recorded():
    from validation.titan_moe import MoeShape, measure_ep_states

    for rank in measure_ep_states(MoeShape(), ep=2, world=4, replicate=2):
        assert {k: rank[k] for k in RECORDED_HSDP} == RECORDED_HSDP
        assert rank["layer_shapes"]["moe.routed_experts.inner_experts.w1_EFD"] == (4, 32, 64)


def test_compiled_moe_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # --compile on the Qwen3 MoE (memplan/inventory/compiled_moe.py, ep 1): the module compiles the model's blocks
    # (torchtitan's apply_compile, every block, the MoE ones too), not the loss
    result = estimate("qwen3-30b-a3b", impl="torchtitan", gpus=8, ac="selective-op", compile=True, seq_len=4096,
                      micro_batch=1, global_batch=8, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, result.launch)
    assert config.compile.enable and list(config.compile.components) == ["model"]
    assert config.parallelism.expert_parallel_degree == 1
    eager = estimate("qwen3-30b-a3b", impl="torchtitan", gpus=8, ac="selective-op", seq_len=4096, micro_batch=1,
                     global_batch=8, emit="torchtitan")
    assert not _load(tmp_path, monkeypatch, eager.launch).compile.enable
