"""torchtitan 0.3.0's DeepSeek-V3 under the multi-stage pipeline schedules (--impl torchtitan --pp P
--pipeline-schedule Interleaved1F1B | LoopedBFS).

torchtitan splits its p m virtual stages as any decoder's (pipeline_llm: _generate_llm_fqn_per_model_part deals
layers.0, layers.1, ... out in order, the embedding and the norm + head each weighing one layer) and gives rank r the
stages r, r + p, ... (_get_pp_rank_to_stage_indices_mapping), so a rank's chunks hold different mixes of the dense
first layers and the MoE layers (memplan/memory/pipeline_multi.py chunk_dense).  Checked here against torchtitan's own
code: the dense layers of every rank's chunks (its split functions), each rank's parameters (its split modules of the
671B flavour on the meta device), each rank's saved tensors (its pipelined tiny model run with torch's real schedule
over gloo, recorded; re-measured opt-in with MEMPLAN_TITAN_SLOW=1), the emitted config (its ConfigManager and its
own stage metadata).  The split-backward schedules stay refused (tests/test_titan_dsv3_pp.py test_refused_in_one_line).
Needs torchtitan (the test extra)."""

import dataclasses
import os

import pytest

from memplan.api.estimating import estimate
from memplan.api.searching import search
from memplan.core.errors import MemplanError
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.titan import titan_model
from memplan.inventory.titan_dsv3 import dsv3_inventory
from memplan.memory.pipeline import titan_stages_per_rank
from memplan.memory.pipeline_multi import chunk_dense, rank_chunks, rank_stages
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues, whole_layer
from memplan.plan.titan import titan_dims

pytest.importorskip("torchtitan")

import torch  # noqa: E402
from torchtitan.distributed.pipeline_parallel import (  # noqa: E402
    _generate_llm_fqn_per_model_part, _get_pp_rank_to_stage_indices_mapping, _split_module)

from tests.test_titan_dsv3 import SHAPE, _model  # noqa: E402

SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
S, V, LAYERS, DENSE = 16, 128, 6, 2  # the measured run: 6 layers, the first 2 dense, 4 virtual stages on 2 ranks


def _titan_ranks(p, layers, kind):
    """Each rank's virtual stages' module names, torchtitan's own split and placement (2 stages a rank)."""
    names = _generate_llm_fqn_per_model_part(2 * p, layers)
    return [[names[s] for s in _get_pp_rank_to_stage_indices_mapping(r, p, kind, 2 * p)] for r in range(p)]


@pytest.mark.parametrize("kind", ["Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble"])
def test_chunk_dense_equals_torchtitans_split(kind):
    # the dense layers (layers.0 .. nd - 1) in each of a rank's chunks, counted in torchtitan's module names; the loop
    # and the V placements; DeepSeek-V3 671B (61 layers, 3 dense) and the measured tiny model (6 layers, 2 dense)
    for layers, nd, ps in ((61, 3, (2, 4, 8, 16)), (LAYERS, DENSE, (2,))):
        for p in ps:
            for r, chunks in enumerate(_titan_ranks(p, layers, kind)):
                real = tuple(sum(n.startswith("layers.") and int(n.split(".")[1]) < nd for n in c) for c in chunks)
                assert chunk_dense(r, p, 2, layers, nd, kind) == real, (layers, p, r)
                assert rank_chunks(r, p, 2, layers, kind) == tuple(sum(n.startswith("layers.") for n in c)
                                                                   for c in chunks)
    # by hand, 671B at p = 16: 32 stages of 63 effective layers, stages 0 .. 30 two each, so stage 0 the embedding
    # and layers.0, stage 1 layers.1 and layers.2: rank 1 holds two of the three dense layers (stage 1 and 17)
    assert [chunk_dense(r, 16, 2, 61, 3, "Interleaved1F1B") for r in (0, 1, 2)] == [(1, 0), (2, 0), (0, 0)]
    assert chunk_dense(0, 8, 2, 61, 3, "Interleaved1F1B") == (3, 0)  # p = 8: stage 0 holds 4 - 1 = 3 layers


def test_the_walked_chunks_dense_layers():
    # the timeline walks a rank's largest chunk (PlanValues.chunk_layers): its dense layers are the ones whose
    # gradients it counts as a dense layer's. 671B at p = 2: rank 0's chunks 15 (3 dense) + 16 (none): the 16, none;
    # the tiny model (6 layers, 2 dense) at p = 2: rank 1's chunks layers.1 (dense) + .2, and layers.5: the first, 1
    spec = _spec()
    plan = PlanValues(t=1, p=2, d=1, m=2, sp=0, zero=3, shard=1, b=1, recompute=int(Recompute.NONE),
                      recomputed_layers=LAYERS, microbatches=2, schedule="Interleaved1F1B")
    assert [plan.chunk_dense_layers(spec, r) for r in (0, 1)] == [0, 1]
    big = _model(num_layers=61, moe_first_dense_layers=3)
    assert [plan.chunk_dense_layers(big, r) for r in (0, 1)] == [0, 0]
    assert dataclasses.replace(plan, schedule="1F1B", m=1).chunk_dense_layers(big, 0) == 3  # single-stage: stage 0


def test_671b_rank_parameters_equal_torchtitans_split():
    # torchtitan's 671B flavour (no MTP layers) built on the meta device and split by its own functions (its
    # _split_module deep-copies the model for each stage, ~0.3 s a stage: ranks 0, 1, 2 and the last of p = 16), each
    # rank's chunks' parameters summed, against memplan's ranks (ep 1: every expert on the GPU); rank 0 holds the
    # embedding, the dense layers.0 and two MoE layers (.31, .32), rank 1 the dense layers.1 and .2 beside two MoE
    # layers (.33, .34), rank 2 four MoE layers, rank 15 two MoE layers (.29, .30), the final norm and the head
    from torchtitan.models.deepseek_v3 import model_registry
    with torch.device("meta"):
        whole = model_registry("671B").model.build()
    ranks = _titan_ranks(16, 61, "Interleaved1F1B")
    real = [sum(sum(x.numel() for x in _split_module(whole, names).parameters()) for names in ranks[r])
            for r in (0, 1, 2, 15)]
    est = estimate("deepseek-v3", impl="torchtitan", gpus=16, pp=16, ep=1, micro_batch=1, global_batch=32,
                   seq_len=4096, ac="full", pipeline_schedule="Interleaved1F1B").estimate
    assert [int(est.stages[r].params) for r in (0, 1, 2, 15)] == real
    # by hand (tests/test_titan_dsv3_pp.py test_671b_stage_parameters_equal_torchtitans_split's parts)
    H, A, RQ, RKV, DN, DR, DV, F, FE, E, VV = 7168, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 129280
    attn = H * RQ + RQ + RQ * A * (DN + DR) + H * (RKV + DR) + RKV + RKV * A * (DN + DV) + A * DV * H + 2 * H
    dense, moe = attn + 3 * H * F, attn + E * H + 3 * H * FE + 3 * E * H * FE
    assert real == [VV * H + dense + 2 * moe, 2 * dense + 2 * moe, 4 * moe, 2 * moe + H + H * VV]


# torchtitan's pipelined DeepSeek-V3 over gloo (validation/titan_pp.py pp_rank with a DsvShape: the tiny model of
# tests/test_titan_dsv3.py's SHAPE, layers.0 and .1 dense, the rest MoE, vocabulary 128, s b = 16 x 1, split into its
# virtual stages by torchtitan's _generate_llm_fqn_per_model_part / _split_module and placed by its loop style; torch's
# ScheduleInterleaved1F1B / ScheduleLoopedBFS, balanced routing, no EP, AC none), the most bytes of saved tensors alive
# on each of the 2 ranks. 6 layers at torchtitan's default 2 stages a rank (4 stages: rank 0 the embedding + layers.0
# (dense) and layers.3, .4; rank 1 layers.1 (dense) + .2 and layers.5, the norm and the head); 10 layers with
# pipeline_parallel_layers_per_stage 2 (ceil(12 / 2) = 6 stages, 3 a rank: rank 0 the embedding + layers.0, layers.3,
# .4 and .7, .8; rank 1 layers.1 + .2, .5, .6 and .9 + the head):
#   MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_dsv3_multistage.py -k gloo   (10 to 30 s a run)
PER_STAGE = {6: None, 10: 2}  # layers: pipeline_parallel_layers_per_stage
RECORDED = {("Interleaved1F1B", 2, 6): [411776, 357092], ("Interleaved1F1B", 4, 6): [471424, 397728],
            ("LoopedBFS", 2, 6): [411776, 448776], ("LoopedBFS", 3, 6): [617664, 673164],
            ("Interleaved1F1B", 4, 10): [764160, 690464], ("LoopedBFS", 2, 10): [704512, 741512]}


def _spec(layers=LAYERS):
    return titan_model(_model(seq_length=S, vocab_size=V, num_layers=layers, moe_first_dense_layers=DENSE))


def _memplan_ranks(kind, micro, layers):
    """memplan's two ranks of the measured run (CPU terms): their StageMemory (saved activations, held counts)."""
    spec, m = _spec(layers), titan_stages_per_rank(2, layers, PER_STAGE[layers])
    plan = PlanValues(t=1, p=2, d=1, m=m, sp=0, zero=3, shard=1, b=1, recompute=int(Recompute.NONE),
                      recomputed_layers=layers, microbatches=micro, schedule=kind)
    training = TrainingSpec(micro_batch=1, recompute=Recompute.NONE, device="cpu")
    return m, [stage_memory(spec, dsv3_inventory(spec, "cpu").terms, training, plan, r) for r in (0, 1)]


@pytest.mark.parametrize("kind,micro,layers", sorted(RECORDED))
def test_recorded_ranks_equal_memplan(kind, micro, layers):
    # memplan: at each rank's peak step of torch's order, the held (micro-batch, chunk) sets x each chunk's own dense
    # and MoE layers' terms (a dense layer's, an MoE layer's: measured per layer in tests/test_titan_dsv3.py), the
    # token ids on the chunk of stage 0 (8 s b a micro-batch), the final norm and the fp32 log-softmax on the chunk of
    # the last stage.  The run adds what memplan leaves out (as tests/test_titan_dsv3_pp.py's single-stage runs): the
    # token ids of all M micro-batches are one storage (8 s M, not 8 s per held micro-batch), the labels one storage
    # (8 s M) while a loss is held, nll_loss's 4-byte total_weight per held loss and the grouped GEMMs' int32 offsets
    # (4 E) per held MoE layer
    m, ranks = _memplan_ranks(kind, micro, layers)
    out = []
    for r, mem in enumerate(ranks):
        stages, dense = rank_stages(r, 2, m, kind), chunk_dense(r, 2, m, layers, DENSE, kind)
        extra = 0
        for s, n, nd, held in zip(stages, rank_chunks(r, 2, m, layers, kind), dense, (int(h) for h in mem.held)):
            extra += 4 * SHAPE.E * (n - nd) * held
            if s == 0:
                extra += 8 * S * micro * (held > 0) - 8 * S * held
            if s == 2 * m - 1:
                extra += 4 * held + 8 * S * micro * (held > 0)
        out.append(int(mem.activations) + extra)
    assert out == RECORDED[kind, micro, layers]


def test_a_dense_layer_keeps_other_bytes_than_an_moe_layer():
    # why the chunks' mix matters at this shape: one dense layer's saved bytes differ from one MoE layer's, so rank 1
    # (a dense and an MoE layer in one chunk) would not match its run had memplan put all dense layers on rank 0
    spec = _spec()
    values = spec.symbols(b=1, t=1, cp=1, ep=1, etp=1)
    terms = [t for t in dsv3_inventory(spec, "cpu").terms if t.scope == "layer" and t.kept(Recompute.NONE)]
    kind = {k: sum(whole_layer(spec, t).bytes(values, 2, 0) for t in terms if t.layer_kind in ("", k))
            for k in ("dense", "moe")}
    assert kind["dense"] != kind["moe"]


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("kind,micro,layers", sorted(RECORDED))
def test_pipelined_dsv3_gloo_equals_recorded(kind, micro, layers):
    from validation.titan_pp import measure_pp

    m = titan_stages_per_rank(2, layers, PER_STAGE[layers])
    ranks = measure_pp(SHAPE, layers, V, s=S, b=1, microbatches=micro, schedule=kind, chunks=m, dense=DENSE)
    assert [r["modules"] for r in ranks] == {
        6: [[["tok_embeddings", "layers.0"], ["layers.3", "layers.4"]],
            [["layers.1", "layers.2"], ["layers.5", "norm", "lm_head"]]],
        10: [[["tok_embeddings", "layers.0"], ["layers.3", "layers.4"], ["layers.7", "layers.8"]],
             [["layers.1", "layers.2"], ["layers.5", "layers.6"], ["layers.9", "norm", "lm_head"]]]}[layers]
    assert [r["saved_peak"] for r in ranks] == RECORDED[kind, micro, layers]
    assert all(r["saved_after"] == 0 for r in ranks)


def test_search_tries_the_multistage_schedules_as_estimate():
    # 61 layers: no p divides them, torchtitan splits 2p stages all the same (p = 2: 15 + 16 and 16 + 14 layers)
    base = dict(impl="torchtitan", gpus=64, seq_len=4096, global_batch=64, gpu="h100-80gb", mem="4000GB")
    found = search("deepseek-v3", pp=2, all_variants=True, **base).result
    dims = [titan_dims(found.config(i)) for i in range(found.candidates)]
    assert {d["pipeline_schedule"] for d in dims} == {"1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS"}
    for kind in ("Interleaved1F1B", "LoopedBFS"):
        i = next(i for i, d in enumerate(dims) if d["pipeline_schedule"] == kind and d["ac"] == "none")
        d = dims[i]
        est = estimate("deepseek-v3", **base, pp=2, ep=d["ep"], ac=d["ac"], pipeline_schedule=kind,
                       micro_batch=d["pipeline_microbatch_size"], dp_replicate=d["dp_replicate"])
        assert est.estimate.step.peak_bytes == found.evaluated.peak_bytes[i], kind
        assert [int(s.layers) for s in est.estimate.stages] == [31, 30]


def test_emitted_multistage_plan_loads_and_torchtitan_splits_it_so(tmp_path, monkeypatch):
    # the emitted module (torchtitan's shipped deepseek_v3_671b, whose own default schedule is Interleaved1F1B) loads in
    # its ConfigManager; torchtitan's own stage metadata of that config gives the virtual stages memplan split
    from torchtitan.distributed.pipeline_parallel import _get_pipeline_metadata

    from tests.test_launch_titan import _load
    result = estimate("deepseek-v3", impl="torchtitan", gpus=64, pp=16, ep=4, ac="full", seq_len=4096, micro_batch=1,
                      global_batch=64, pipeline_schedule="Interleaved1F1B", emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    par = config.parallelism
    assert (par.pipeline_parallel_degree, par.pipeline_parallel_schedule, par.expert_parallel_degree) == (
        16, "Interleaved1F1B", 4)

    class Dims:
        pp = 16
    stages, layers, iw, ow = _get_pipeline_metadata(Dims(), par, config.model_spec.model)
    assert (stages, layers) == (32, 61)
    split = _generate_llm_fqn_per_model_part(stages, layers, iw, ow)
    est = result.estimate
    assert [int(s.layers) for s in est.stages] == [
        sum(n.startswith("layers.") for s in _get_pp_rank_to_stage_indices_mapping(r, 16, "Interleaved1F1B", 32)
            for n in split[s]) for r in range(16)]


def test_split_backward_schedules_refused_in_one_line():
    kw = dict(impl="torchtitan", gpus=4, pp=2, global_batch=8, seq_len=4096, micro_batch=1, ac="full")
    for kind in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        with pytest.raises(MemplanError, match=f"{kind} with an MoE model is not modelled"):
            estimate("deepseek-v3", pipeline_schedule=kind, **kw)


def test_estimate_says_where_the_dense_layers_fall():
    est = estimate("deepseek-v3", impl="torchtitan", gpus=64, pp=16, ep=4, ac="full", seq_len=4096, micro_batch=1,
                   global_batch=64, pipeline_schedule="Interleaved1F1B").estimate
    assert any("the 3 dense first layers: 1 in rank 0's chunk 0, 2 in rank 1's chunk 0" in n for n in est.notes)
    assert [int(s.layers) for s in est.stages[:2]] == [3, 4]  # 1 + 2 and 2 + 2 (test_chunk_dense_equals_...)
