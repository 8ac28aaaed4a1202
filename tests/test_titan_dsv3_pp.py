"""torchtitan 0.3.0's DeepSeek-V3 with pipeline parallelism (--impl torchtitan --pp P, torch's 1F1B / GPipe).

torchtitan splits it as any decoder (pipeline_llm: _generate_llm_fqn_per_model_part, the embedding and the norm + head
each weighing one layer; _split_module): the n_dense_layers dense first layers (layers.0 ..) come first, on the first
stage beside the embedding.  Checked here against torchtitan's own code: each stage's parameters (its split modules on
the meta device), each stage's saved tensors (its pipelined model run over gloo, recorded; re-measured opt-in with
MEMPLAN_TITAN_SLOW=1), the emitted config loaded by its ConfigManager; and its refusal of multi-token prediction with
PP.  Needs torchtitan (the test extra)."""

import dataclasses
import os
from fractions import Fraction

import pytest

from memplan.api.estimating import estimate
from memplan.core.errors import MemplanError
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.titan import titan_model
from memplan.inventory.titan_dsv3 import dsv3_inventory
from memplan.memory.pipeline import schedule_in_flight, titan_stage_layers
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues
from memplan.presets.catalog import load_model

pytest.importorskip("torchtitan")

import torch  # noqa: E402
import yaml  # noqa: E402
from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _split_module  # noqa: E402

from tests.test_titan_dsv3 import SHAPE, _model  # noqa: E402
from validation.titan_dsv3 import dsv3_model_config  # noqa: E402

SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
S, V = 16, 128  # the measured run's sequence and vocabulary


def _yaml(tmp_path, **kw):
    spec = _model(seq_length=S, vocab_size=V, name="tiny-dsv3", **kw).model_dump(exclude={"inventory"})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": spec}))
    return str(path)


def _split_params(whole, p, layers):
    """Parameters of each stage torchtitan's pipeline_llm makes (its own split functions)."""
    return [sum(x.numel() for x in _split_module(whole, names).parameters())
            for names in _generate_llm_fqn_per_model_part(p, layers)]


def test_tiny_stage_parameters_equal_torchtitans_split(tmp_path):
    # 4 layers, the first 2 dense: torchtitan's p = 2 split is 6 effective layers, 3 + 3: the embedding, layers.0 and
    # layers.1 (both dense); layers.2 and 3 (MoE), the norm and the head.  Its split modules on the meta device
    # against memplan's stages (ep 1: each stage's experts whole)
    with torch.device("meta"):
        whole = dsv3_model_config(SHAPE, V, n_layers=4, n_dense=2).build()
    real = _split_params(whole, 2, 4)
    est = estimate(_yaml(tmp_path, num_layers=4, moe_first_dense_layers=2), impl="torchtitan", gpus=2, pp=2,
                   micro_batch=1, global_batch=2, ac="none").estimate
    assert [int(st.layers) for st in est.stages] == [2, 2]
    assert [int(st.params) for st in est.stages] == real
    # by hand (tests/test_titan_dsv3.py: an attention 17,360, a dense layer 35,792, an MoE layer 24,528 + 98,304):
    # 128 x 64 + 2 x 35,792; 2 x (24,528 + 98,304) + 64 + 64 x 128
    assert real == [V * 64 + 2 * 35_792, 2 * (24_528 + 98_304) + 64 + 64 * V]


def test_671b_stage_parameters_equal_torchtitans_split():
    # torchtitan's 671B flavour (model_registry, no MTP layers) built on the meta device (~1 s) and split by its own
    # functions: p = 2 holds 31 + 30 layers (the 3 dense in stage 0), p = 4 15, 16, 16, 14
    from torchtitan.models.deepseek_v3 import model_registry
    with torch.device("meta"):
        whole = model_registry("671B").model.build()
    for p in (2, 4):
        real = _split_params(whole, p, 61)
        est = estimate("deepseek-v3", impl="torchtitan", gpus=p, pp=p, ep=1, micro_batch=1, global_batch=p, seq_len=4096,
                       ac="full").estimate
        assert [int(st.layers) for st in est.stages] == list(titan_stage_layers(p, 61))
        assert [int(st.params) for st in est.stages] == real, p
    # by hand at p = 2 (tests/test_titan_dsv3.py test_states_by_hand's parts): stage 0 the embedding, 3 dense and 28
    # MoE layers; stage 1 30 MoE layers, the final norm and the head
    H, A, RQ, RKV, DN, DR, DV, F, FE, E, VV = 7168, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 129280
    attn = H * RQ + RQ + RQ * A * (DN + DR) + H * (RKV + DR) + RKV + RKV * A * (DN + DV) + A * DV * H + 2 * H
    moe = attn + E * H + 3 * H * FE + 3 * E * H * FE
    assert _split_params(whole, 2, 61) == [VV * H + 3 * (attn + 3 * H * F) + 28 * moe, 30 * moe + H + H * VV]


# torchtitan's pipelined DeepSeek-V3 over gloo (validation/titan_pp.py pp_rank with a DsvShape: the 2-layer tiny model
# of validation/titan_dsv3.py, layer 0 dense, layer 1 MoE, tests/test_titan_dsv3.py's SHAPE, vocabulary 128, split by
# torchtitan's _generate_llm_fqn_per_model_part / _split_module: stage 0 the embedding and the dense layer, stage 1 the
# MoE layer, the norm and the head; torch's Schedule1F1B / ScheduleGPipe, s b = 16 x 1, balanced routing, no EP, AC
# none; FlexAttention's save set in the stand-in op; the dataloader's positions a model kwarg every stage gets, as
# torchtitan's Trainer passes them), the most bytes of saved tensors alive on each stage:
#   MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_dsv3_pp.py -k gloo   (10 to 40 s a run)
RECORDED = {("1F1B", 2): [119040, 91940], ("1F1B", 3): [119168, 92068], ("1F1B", 4): [119296, 92196],
            ("GPipe", 2): [119040, 183624], ("GPipe", 3): [178560, 275436], ("GPipe", 4): [238080, 367248]}


def _memplan_stages(kind, m):
    """memplan's saved activations of each stage for the measured run (CPU terms, the plan of 2 stages on 2 ranks)."""
    spec = titan_model(_model(seq_length=S, vocab_size=V))
    terms = dsv3_inventory(spec, "cpu").terms
    plan = PlanValues(t=1, p=2, d=1, m=1, sp=0, zero=3, shard=1, b=1, recompute=int(Recompute.NONE),
                      recomputed_layers=1, microbatches=m, schedule=kind)
    training = TrainingSpec(micro_batch=1, recompute=Recompute.NONE, device="cpu")
    return [stage_memory(spec, terms, training, plan, st).activations for st in (0, 1)]


@pytest.mark.parametrize("kind,m", sorted(RECORDED))
def test_recorded_stages_equal_memplan(kind, m):
    # memplan: each stage keeps its micro-batches in flight (1F1B: 2 on stage 0, 1 on stage 1; GPipe: M on both) x
    # its own layers' terms: stage 0 the dense layer's (measured per layer in tests/test_titan_dsv3.py), not the
    # model's dense / MoE average (without PP each kind weighs n_dense / L), and the token ids (8 s b); stage 1 the
    # MoE layer's, the final norm, the fp32 log-softmax.  The run adds what memplan leaves out (tests/test_titan_pp.py):
    # the token ids of all M micro-batches are one storage (8 s b M, not 8 s b per micro-batch in flight), nll_loss's
    # 4-byte total_weight per micro-batch and the grouped GEMMs' int32 offsets (4 E, titan_moe.py) on the last stage
    flight = [int(schedule_in_flight(i, 2, 1, m, kind)[0]) for i in (0, 1)]
    first, last = _memplan_stages(kind, m)
    ids = 8 * S
    assert RECORDED[kind, m] == [first - flight[0] * ids + ids * m, last + flight[1] * (4 * SHAPE.E + 4) + ids * m]


def test_stage_activations_are_each_stages_own_layers():
    # the dense layer keeps more than the MoE one at this shape: had memplan weighted both stages' layers by the
    # model's average (its pp = 1 rule), stage 0 would be below the measured run and stage 1 above
    first, last = _memplan_stages("GPipe", 2)
    spec = titan_model(_model(seq_length=S, vocab_size=V))
    one = PlanValues(t=1, p=1, d=1, m=1, sp=0, zero=3, shard=1, b=1, recompute=int(Recompute.NONE),
                     recomputed_layers=2, microbatches=1)
    training = TrainingSpec(micro_batch=1, recompute=Recompute.NONE, device="cpu")
    whole = stage_memory(spec, dsv3_inventory(spec, "cpu").terms, training, one, 0).activations
    # the whole model (one stage, one micro-batch) is both stages' terms once: 2 x (stage 0 + stage 1) under GPipe M 2
    assert 2 * whole == first + last
    assert first != last


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("kind,m", sorted(RECORDED))
def test_pipelined_dsv3_gloo_equals_recorded(kind, m):
    from validation.titan_pp import measure_pp

    ranks = measure_pp(SHAPE, 2, V, s=S, b=1, microbatches=m, schedule=kind)
    assert [r["modules"] for r in ranks] == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]
    assert [r["saved_peak"] for r in ranks] == RECORDED[kind, m]


def test_671b_stage_activations_by_hand():
    # deepseek-v3 --pp 2 --ep 8 on 64 GPUs, AC none, M = 2: stage 0 holds p - 0 = 2 micro-batches of its 3 dense and
    # 28 MoE layers and the token ids; stage 1 one of its 30 MoE layers and the head's terms.  A layer of each kind
    # is its own terms (the every-layer ones + that kind's: the weights n_dense / L, (L - n_dense) / L undone)
    kw = dict(impl="torchtitan", gpus=64, ep=8, seq_len=4096, micro_batch=1, global_batch=64, ac="none")
    est = estimate("deepseek-v3", pp=2, **kw).estimate
    spec = titan_model(load_model("deepseek-v3").model)
    terms = dsv3_inventory(spec, "cuda").terms
    values = spec.symbols(b=1, t=1, cp=1, ep=8, etp=1)
    undo = {"": 1, "dense": Fraction(61, 3), "moe": Fraction(61, 58)}
    kinds = {k: sum(dataclasses.replace(t, elements=t.elements * undo[t.layer_kind]).bytes(values, 2, 0)
                    for t in terms if t.scope == "layer" and t.kept(Recompute.NONE) and t.layer_kind in ("", k))
             for k in ("dense", "moe")}
    head = sum(t.bytes(values, 2, 0) for t in terms if t.scope == "last")
    assert [int(st.layers) for st in est.stages] == [31, 30]
    # memplan holds a stage's layers as n copies of their average, each term's rounded down to the byte: n bytes a
    # term at most (about 40 terms a layer: a few KB of the stages' ~200 GB)
    assert est.stages[0].activations == pytest.approx(2 * (3 * kinds["dense"] + 28 * kinds["moe"] + 8 * 4096),
                                                      abs=2 * 31 * 64)
    assert est.stages[1].activations == pytest.approx(30 * kinds["moe"] + head, abs=30 * 64)
    assert kinds["dense"] != kinds["moe"]


def test_refused_in_one_line():
    kw = dict(impl="torchtitan", seq_len=4096, micro_batch=1, ac="full")
    # the split-backward multi-stage schedules: the I -> W gradients are measured for the dense Llama block only
    # (the others: tests/test_titan_dsv3_multistage.py)
    with pytest.raises(MemplanError, match="with an MoE model is not modelled"):
        estimate("deepseek-v3", gpus=4, pp=2, global_batch=8, pipeline_schedule="InterleavedZeroBubble", **kw)
    # p = 21: 63 effective layers, 3 a stage: the first stage holds 2 layers, the dense layers.2 is stage 1's
    assert titan_stage_layers(21, 61)[:2] == (2, 3)
    with pytest.raises(MemplanError, match="fewer than the 3 dense first layers"):
        estimate("deepseek-v3", gpus=21, pp=21, global_batch=21, **kw)


def test_search_lists_pp_plans_and_agrees_with_estimate():
    from memplan.api.searching import search

    # a budget every plan fits: all listed; the estimate gets the same budget, since the stage whose replay decides
    # (and so device_bytes) depends on it (memplan/plan/stage_verdict.py)
    base = dict(impl="torchtitan", gpus=64, seq_len=4096, global_batch=64, gpu="h100-80gb", mem="4000GB")
    found = search("deepseek-v3", pp=2, **base).result
    row = found.row(found.top[0])
    dims = row["torchtitan"]
    assert dims["pp"] == 2 and dims["pipeline_schedule"] in ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS")
    est = estimate("deepseek-v3", **base, pp=2, ep=dims["ep"], ac=dims["ac"], pipeline_schedule=dims["pipeline_schedule"],
                   micro_batch=dims["pipeline_microbatch_size"], dp_replicate=dims["dp_replicate"])
    assert row["memory"]["device_bytes"] == est.device_bytes


def test_emitted_pp_plan_loads_and_mtp_with_pp_is_refused_by_torchtitan(tmp_path, monkeypatch):
    # the emitted module (torchtitan's shipped deepseek_v3_671b with the plan's settings) loads in its ConfigManager;
    # the same job with the flavour's num_mtp_layers = 1 is refused by torchtitan itself (MTPDecoder.Config
    # update_from_config: "MTP does not support pipeline parallelism yet"), which is why memplan models no MTP layer
    from torchtitan.models.deepseek_v3 import model_registry

    from tests.test_launch_titan import _load
    result = estimate("deepseek-v3", impl="torchtitan", gpus=16, pp=2, ep=8, ac="full", seq_len=4096, micro_batch=1,
                      global_batch=16, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    par = config.parallelism
    assert (par.pipeline_parallel_degree, par.pipeline_parallel_schedule, par.expert_parallel_degree) == (2, "1F1B", 8)
    assert config.model_spec.flavor == "671B" and not config.model_spec.model.mtp_layers
    with pytest.raises(NotImplementedError, match="MTP does not support pipeline parallelism"):
        model_registry("671B", num_mtp_layers=1).model.update_from_config(config=config)


def test_671b_stage_states_with_ep_by_hand():
    # deepseek-v3 --pp 2 --ep 8 on 64 GPUs: dp_shard 32, efsdp 32 / 8 = 4. Stage 0 (31 layers) holds the embedding,
    # the 3 dense layers and 28 MoE layers with the GPU's E / 8 = 32 experts each; with PP FSDP2 keeps the stage
    # unsharded in bf16 all step and its gradients accumulated unsharded in fp32 (the rank's experts only; derived as
    # the dense PP row); the sharded fp32 gradients and AdamW's master + moments: the dense parts over 32, the experts
    # over efsdp = 4; each layer's RoPE cache 4 s d_r B (tests/test_titan_dsv3.py)
    H, A, RQ, RKV, DN, DR, DV, F, FE, E, VV, S4 = 7168, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 129280, 4096
    attn = H * RQ + RQ + RQ * A * (DN + DR) + H * (RKV + DR) + RKV + RKV * A * (DN + DV) + A * DV * H + 2 * H
    dense0 = VV * H + 3 * (attn + 3 * H * F) + 28 * (attn + E * H + 3 * H * FE)
    experts0 = 28 * 3 * E * H * FE // 8
    st = estimate("deepseek-v3", impl="torchtitan", gpus=64, pp=2, ep=8, seq_len=S4, micro_batch=1, global_batch=64,
                  ac="full").estimate.stages[0].states
    assert st.weights == 2 * (dense0 + experts0) + 31 * 4 * S4 * DR
    assert st.gradients == pytest.approx(4 * dense0 / 32 + 4 * experts0 / 4 + 4 * (dense0 + experts0), abs=8)
    assert st.optimizer == pytest.approx(12 * dense0 / 32 + 12 * experts0 / 4, abs=16)
