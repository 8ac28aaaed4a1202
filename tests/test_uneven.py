"""Uneven pipeline stages (Megatron-LM --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers):
Megatron-LM's split rules, every stage's memory with its own layers, the search's extra candidate stage and split
dimension, and the step time of the slowest stage."""

import numpy as np
import pytest

from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec
from memplan.inventory.assemble import inventory_for
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues
from memplan.plan.estimate import estimate, stage_rows
from memplan.plan.search import search
from memplan.plan.space import Fixed, _splits
from memplan.presets.batch import make_config, search_inputs
from memplan.presets.catalog import load_gpu, load_model
from memplan.timing.layer import layer_time
from memplan.timing.step import step_time

H100 = load_gpu("h100-80gb")
# L = 13: no p > 1 divides it, so every pipeline needs an uneven split
TINY13 = ModelSpec(name="tiny13", num_layers=13, hidden_size=256, num_attention_heads=8, seq_length=128,
                   vocab_size=1000)


def gpt(L=13, **parallel):
    return Config(model=TINY13.model_copy(update=dict(num_layers=L)), parallel=ParallelSpec(**parallel),
                  training=TrainingSpec(micro_batch=1, global_batch=8 * parallel.get("dp", 1)))


@pytest.mark.parametrize("parallel, fragment", [
    (dict(pp=4, first_stage_layers=3, last_stage_layers=3), "do not split evenly"),  # 7 over 2 middle stages
    (dict(pp=2, first_stage_layers=6, last_stage_layers=6), "leave 1 of L=13"),  # no middle stage for it
    (dict(pp=4, first_stage_layers=13), "leave 0 of L=13"),  # the other stages get none
    (dict(pp=3, vpp=2, first_stage_layers=3, last_stage_layers=2), "not divisible by m=2"),
    (dict(first_stage_layers=3), "need pipeline parallelism"),
])
def test_megatron_s_split_rules(parallel, fragment):
    with pytest.raises(ValueError, match=fragment):
        gpt(**parallel)


def test_one_stage_given_the_rest_split_evenly():
    # Megatron-LM get_num_layers_to_build: the stages not given share L - given evenly (13 - 1 = 12 over 3)
    assert gpt(pp=4, first_stage_layers=1).split == (1, 4, 4)
    assert gpt(pp=4, last_stage_layers=4).split == (3, 3, 4)


def test_every_stage_stores_its_own_layers():
    """p = 4, L = 13 as 3 / 4 / 4 / 2 layers, M = 8 micro-batches, 1F1B: stage i holds p - i = 4, 3, 2, 1
    micro-batches of its layers, so 12, 12, 8 and 2 layers' activation sets (by hand)."""
    config = gpt(pp=4, first_stage_layers=3, last_stage_layers=2)
    assert [config.stage_layers(i) for i in range(4)] == [3, 4, 4, 2]
    inv = inventory_for(config.model, "megatron")
    plan = PlanValues.from_config(config)
    layer_terms = [t for t in inv.terms if t.scope == "layer"]
    for stage, sets in enumerate((12, 12, 8, 2)):
        mem = stage_memory(config.model, inv.terms, config.training, plan, stage)
        one_layer = sum(mem.unit_bytes[t.id] for t in layer_terms)
        assert sum(mem.term_bytes[t.id] for t in layer_terms) == sets * one_layer
        assert mem.layers == (3, 4, 4, 2)[stage]


def test_llama31_405b_published_layout():
    """Llama 3 (arXiv 2407.21783, section 3.3.2 and Table 4): p = 16 on 16,384 H100 with one layer fewer on the
    first and the last stage: 7 + 14 x 8 + 7 = 126 (Megatron-LM's --account-for-embedding-in-pipeline-split and
    --account-for-loss-in-pipeline-split give the same: (126 + 2) / 16 = 8, minus one on each end). Stage 0 holds
    16 micro-batches of 7 layers = 112 sets, stage 1 15 of 8 = 120: stage 1 is the peak."""
    config = make_config(load_model("llama3.1-405b"))
    assert (config.parallel.pp, config.split, config.parallel.gpus) == (16, (7, 8, 7), 16384)
    est = estimate(config, gpu=H100)
    rows = stage_rows(est)
    assert [r.layer_copies for r in rows[:3]] == [112, 120, 112]
    assert est.most_loaded == 1
    assert est.step.peak_bytes == max(s.peak_bytes for s in est.steps)


def test_splits_searched():
    # p = 16, L = 126: (126 + df + dl) % 16 == 0 with df, dl in 0..2 -> df + dl = 2: 8-0/8-2, 8-1/8-1, 8-2/8-0
    assert sorted(_splits(126, 16, Fixed(uneven=True))) == [(6, 8), (7, 7), (8, 6)]
    assert _splits(126, 16, Fixed()) == []  # no even split: searched only with --uneven-stages
    assert _splits(128, 16, Fixed(uneven=True)) == [(8, 8)]  # 128 + 1..4 is never a multiple of 16
    assert sorted(_splits(12, 2, Fixed(uneven=True))) == [(5, 7), (6, 6), (7, 5)]
    assert _splits(126, 16, Fixed(first_stage_layers=7, last_stage_layers=7)) == [(7, 7)]


def test_search_of_uneven_splits_equals_estimate():
    """Every plan of a space of uneven splits (L = 13 on 4 GPUs: p = 2 as 6 + 7 or 7 + 6, p = 4 as 3 / 4 / 4 / 2 or
    2 / 4 / 4 / 3), each plan's numbers are estimate's for that plan alone, whose peak is the maximum over every
    stage; some plans peak on the second stage, which only the uneven search evaluates beside the first and last."""
    training = search_inputs(load_model("gpt-22b"), 4)[1]
    result = search(TINY13, training, 4, 8, 10**15, gpu=H100, fixed=Fixed(uneven=True))
    e = result.evaluated
    assert set(np.unique(e.plans.p).tolist()) == {1, 2, 4}
    middle_peaks = 0
    for i in range(result.candidates):
        config = result.config(i)
        est = estimate(config, gpu=H100)
        assert int(e.device_bytes[i]) == int(est.flat_total)
        assert int(e.peak_bytes[i]) == int(est.step.peak_bytes)
        assert int(e.first_stage_peak_bytes[i]) == int(est.steps[0].peak_bytes)
        assert int(e.last_stage_peak_bytes[i]) == int(est.steps[-1].peak_bytes)
        one = step_time(config.model, config.training, H100, PlanValues.from_config(config), config.global_batch,
                        breakdown=False)
        assert float(one.step_time_s) == float(e.step_time_s[i])
        middle_peaks += est.most_loaded not in (0, config.parallel.pp - 1)
    assert middle_peaks > 0


def test_slowest_stage_and_the_others_as_bubble():
    """405B at p = 16 as 7 / 8 / 7 (m = 1, no recompute): a sequence takes T = n u on a stage of n layers (u: one
    layer's forward + backward, perf.layer_time) and the last stage also the LM head, so T_last = 7u + head, the
    middle 8u. The steady state runs at the slowest stage and the warm-up / cool-down slots are the others:
    bubble = b (sum T - T*) / m, the rest of the step b M T* (by hand from Narayanan et al. 2021's 1F1B)."""
    config = make_config(load_model("llama3.1-405b"))
    plan = PlanValues.from_config(config)
    st = step_time(config.model, config.training, H100, plan, config.global_batch)
    lt = layer_time(config.model, H100, plan)
    b, M = config.training.micro_batch, config.num_microbatches
    u = (lt.forward_compute_s + lt.forward_memory_s + lt.forward_comm_s + lt.backward_compute_s
         + lt.backward_memory_s + lt.backward_comm_exposed_s) / b
    t_last = (st.compute_s + st.memory_s + st.tp_comm_exposed_s) / (b * M)  # the last stage's 7 layers + head
    t_first, t_middle = 7 * u, 8 * u
    slowest = max(t_first, t_middle, t_last)
    assert slowest == t_middle  # the head costs less than one layer here
    assert st.bubble_s == pytest.approx(b * (t_first + 14 * t_middle + t_last - slowest), rel=1e-5)
    rest = st.step_time_s - st.bubble_s - st.pp_comm_s - st.dp_comm_exposed_s - st.zero3_gather_exposed_s \
        - st.optimizer_s - st.host_copy_s
    assert rest == pytest.approx(b * M * slowest, rel=1e-5)


def test_cli_pins_and_searches_the_split(run_cli):
    import json

    code, out, _ = run_cli("search", "--model", "llama3.1-405b", "--gpus", "16384", "--mem", "80GB", "--pp", "16",
                           "--first-stage-layers", "7", "--last-stage-layers", "7", "--vpp", "1", "--json")
    plans = json.loads(out)["plans"]
    assert code == 0 and plans and all((p["first_stage_layers"], p["last_stage_layers"]) == (7, 7) for p in plans)
    code, _, err = run_cli("estimate", "--model", "llama3.1-405b", "--first-stage-layers", "6")
    assert code == 2 and "do not split evenly" in err and "Traceback" not in err
