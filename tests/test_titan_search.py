"""search --impl torchtitan (memplan/plan/titan.py, titan_search.py) and what the step-time model is told of torchtitan
(memplan/timing/): every listed plan is one torchtitan launches (distinct, tp dividing the heads, dp_replicate dividing
the data-parallel degree, compile where memplan traces it: tp 1, with float8 not under selective-op) and gets the verdict, memory and step time that
`estimate --impl torchtitan` with the same flags gives (a property over random plans and budgets within a few % of
the plan's need); the timing terms (FSDP2's reduce-scatter in every micro-batch, per-op selective AC's recompute,
torchtitan's five GEMMs, compile's fused memory-bound ops) each checked against a hand derivation from torchtitan's
code. Expected verdicts are estimate's own: the property is that the two commands agree."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan import estimate, search
from memplan.cli import main
from memplan.core.training import Recompute
from memplan.memory.term_bytes import PlanValues
from memplan.plan.titan import titan_dims
from memplan.presets.catalog import load_gpu, load_model
from memplan.timing.flops import gemms_per_layer, layer_matmul_flops
from memplan.timing.layer import layer_forms, layer_time
from memplan.timing.traffic import layer_traffic_bytes

GPU = "h100-80gb"
BASE = dict(impl="torchtitan", gpus=8, global_batch=16, gpu=GPU, pp=1)  # pp > 1: tests/test_titan_pp_search.py


def _flags(dims):
    """A listed row's torchtitan settings as estimate's options."""
    return dict(tp=dims["tp"], dp_replicate=dims["dp_replicate"], ac=dims["ac"], compile=dims["compile"],
                micro_batch=dims["local_batch"])


@st.composite
def plans(draw):
    tp = draw(st.sampled_from([1, 2]))
    ac = draw(st.sampled_from(["none", "full", "selective-op", "selective-layer:2", "selective-layer:5"]))
    compiled = draw(st.booleans())
    plan = dict(tp=tp, dp_replicate=draw(st.sampled_from([1, 2])), ac=ac, compile=compiled,
                micro_batch=draw(st.sampled_from([1, 2])), seq_len=draw(st.sampled_from([1024, 4096])),
                allocator=draw(st.sampled_from(["default", "expandable"])))
    if draw(st.booleans()):
        plan["frag_margin"] = 0.0
    return plan, draw(st.floats(-0.03, 0.03))


@settings(max_examples=8, deadline=None)
@given(plans())
def test_a_pinned_search_lists_the_plan_exactly_when_estimate_says_it_fits(drawn):
    plan, offset = drawn
    need = estimate("llama3-8b", **BASE, **plan)
    plan["mem"] = int(need.device_bytes * (1 + offset))
    est = estimate("llama3-8b", **BASE, **plan)
    found = search("llama3-8b", all_variants=True, **BASE, **plan).result
    assert found.candidates == 1
    assert len(found.top) == (1 if est.fits else 0)
    row = found.row(0)  # the one plan searched
    # the plan searched is the plan asked for, with estimate's step time
    assert _flags(row["torchtitan"]) == {k: plan[k] for k in ("tp", "dp_replicate", "ac", "compile", "micro_batch")}
    assert row["step_time_s"] == pytest.approx(est.estimate.perf.step_time_s, rel=1e-6)
    if found.top:
        assert row["memory"]["device_bytes"] == est.device_bytes


def test_every_plan_searched_is_distinct_launchable_and_estimates_the_same():
    found = search("llama3-8b", all_variants=True, top=3, seq_len=2048, mem=60 * 10**9, **BASE).result
    model, e = found.model, found.evaluated
    dims = [titan_dims(found.config(i)) for i in range(found.candidates)]
    assert len({tuple(sorted(d.items())) for d in dims}) == len(dims) > 300
    for t in dims:
        assert all(n % t["tp"] == 0 for n in (model.num_attention_heads, model.g, model.f, model.vocab_size, 2048))
        assert t["dp_replicate"] * t["dp_shard"] * t["tp"] == 8 and (t["dp_replicate"] == 1 or t["dp_shard"] >= 2)
        assert t["local_batch"] * t["gradient_accumulation"] * t["dp_replicate"] * t["dp_shard"] == 16
    # compiled plans at every tp (the compiled block measured per TP rank: tests/test_titan_tp.py)
    assert {t["tp"] for t in dims if t["compile"]} == {1, 2, 4, 8}
    # the space: tp 1, 2, 4, 8 (8 heads of K/V), AC none / full / selective-op / selective-layer:N / budget:F,
    # compile on and off
    assert {t["tp"] for t in dims} == {1, 2, 4, 8} and {t["compile"] for t in dims} == {True, False}
    assert {t["ac"].split(":")[0] for t in dims} == {"none", "full", "selective-op", "selective-layer", "budget"}
    # compiled selective-op plans are searched (the partitioner under torchtitan's save list: compiled.TITAN_SAC)
    assert {t["ac"].split(":")[0] for t in dims if t["compile"]} == {"none", "full", "selective-op", "selective-layer",
                                                                      "budget"}
    # memory-budget AC: compiled, tp 1 (cp 1 here), its 8 distinct budgets below 1 (0.8, 0.9 save and re-run what 0.7
    # does; 1 is the plain compiled block)
    budget = [t for t in dims if t["ac"].startswith("budget")]
    assert {(t["compile"], t["tp"]) for t in budget} == {(True, 1)}
    assert sorted({t["ac"] for t in budget}) == [f"budget:{f / 10:g}" for f in range(8)]
    for i in range(0, len(dims), 26):  # estimate with the plan's flags: the same plan, the same numbers (~20 plans)
        est = estimate("llama3-8b", seq_len=2048, **BASE, **_flags(dims[i]))
        assert est.estimate.step.peak_bytes == e.peak_bytes[i], dims[i]
        assert est.estimate.perf.step_time_s == pytest.approx(e.step_time_s[i], rel=1e-6)
    # the listing's rows are such plans, with the torchtitan settings in the JSON
    assert [found.row(x.plan)["torchtitan"] for x in found.listed()] == [dims[x.plan] for x in found.listed()]


@pytest.mark.parametrize("budget", ["0", "0.3", "0.7"])
def test_a_budget_search_lists_the_plans_estimate_times(budget):
    # --ac budget:F pinned: the compiled tp 1 plans at F only, each with estimate's memory and step time (its
    # recompute charged: memplan/inventory/budget_recompute.py); one drawn per pp and schedule
    found = search("llama3-8b", all_variants=True, top=2, seq_len=2048, ac=f"budget:{budget}", impl="torchtitan",
                   gpus=8, global_batch=16, gpu=GPU).result
    dims = [titan_dims(found.config(i)) for i in range(found.candidates)]
    assert {(d["ac"], d["compile"], d["tp"]) for d in dims} == {(f"budget:{budget}", True, 1)}
    seen = set()
    for i, d in enumerate(dims):
        if (d["pp"], d["pipeline_schedule"]) in seen:
            continue
        seen.add((d["pp"], d["pipeline_schedule"]))
        est = estimate("llama3-8b", seq_len=2048, impl="torchtitan", gpus=8, global_batch=16, gpu=GPU, pp=d["pp"],
                       pipeline_schedule=d["pipeline_schedule"], dp_replicate=d["dp_replicate"], tp=1,
                       ac=d["ac"], compile=True, micro_batch=d["pipeline_microbatch_size"] or d["local_batch"])
        assert est.estimate.step.peak_bytes == found.evaluated.peak_bytes[i], d
        assert est.estimate.perf.step_time_s == pytest.approx(found.evaluated.step_time_s[i], rel=1e-6), d
    assert len(seen) > 3


def test_budget_search_refusals_in_one_line(capsys):
    for extra in (["--ac", "budget:0.5", "--no-compile"], ["--ac", "budget:0.5", "--tp", "2"],
                  ["--ac", "budget:0.5", "--float8", "rowwise"], ["--ac", "budget:0.55"]):
        with pytest.raises(SystemExit) as exit_:
            main(["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--mem", "80GB"] + extra)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "budget" in err and err.count("\n") == 1, (extra, err)
    # a model whose widths are not traced: budget AC left out of the search, said in a note
    found = search("llama2-7b", impl="torchtitan", gpus=8, global_batch=16, gpu=GPU, seq_len=2048, top=1).result
    assert any(n.startswith("memory-budget AC not searched") for n in found.notes)


def test_a_float8_search_lists_only_plans_estimate_takes():
    # float8 with TP is modelled (measured per rank: tests/test_titan_tp.py): plans at every tp; compiled with tp > 1
    # only under full AC (options refuses the rest); estimate with a plan's flags gives the search's numbers
    found = search("llama3-8b", all_variants=True, top=2, seq_len=1024, float8="rowwise", micro_batch=1,
                   dp_replicate=1, **BASE).result
    dims = [titan_dims(found.config(i)) for i in range(found.candidates)]
    assert {d["tp"] for d in dims} == {1, 2, 4, 8}
    assert {d["ac"] for d in dims if d["compile"] and d["tp"] > 1} == {"full"}
    for i, d in enumerate(dims):
        if d["tp"] > 1 and (d["compile"] or d["ac"] == "selective-op"):
            est = estimate("llama3-8b", seq_len=1024, float8="rowwise", **BASE, **_flags(d))
            assert est.estimate.step.peak_bytes == found.evaluated.peak_bytes[i], d
    row = found.row(found.top[0])
    est = estimate("llama3-8b", seq_len=1024, float8="rowwise", **BASE, **_flags(row["torchtitan"]))
    assert row["memory"]["device_bytes"] == est.device_bytes


def test_compiled_float8_plans_leave_out_selective_op():
    # compile with float8 under selective-op is not traced (compiled.check_compile refuses it): the compiled plans
    # searched with --float8 are AC none / full / selective-layer only, the eager ones keep selective-op
    found = search("llama3-8b", all_variants=True, top=1, seq_len=1024, float8="rowwise", micro_batch=1,
                   dp_replicate=1, **BASE).result
    dims = [titan_dims(found.config(i)) for i in range(found.candidates)]
    assert {d["ac"] for d in dims if d["compile"]} >= {"none", "full"}
    assert "selective-op" not in {d["ac"] for d in dims if d["compile"]}
    assert "selective-op" in {d["ac"] for d in dims if not d["compile"]}


def test_selective_layer_counts_are_distinct_plans():
    # torchtitan <= 0.2 checkpoints layers N-1, 2N-1, ...: L // N of 32; N = 2 .. 32 give 16, 10, 8, 6, 5, 4, 3, 2, 1
    found = search("llama3-8b", all_variants=True, top=1, tp=1, dp_replicate=1, micro_batch=1, compile=False,
                   seq_len=1024, **BASE).result
    acs = sorted(titan_dims(found.config(i))["ac"] for i in range(found.candidates))
    assert acs == sorted(["none", "full", "selective-op"] + [f"selective-layer:{n}" for n in (2, 3, 4, 5, 6, 7, 9, 11, 17)])


def test_max_seq_search_agrees_with_estimate_for_a_pinned_plan():
    # search --max-seq answers a multiple of 128 tokens (SEQ_STEP) at which the plan's replay completes; estimate
    # --max-seq of the same plan answers the longest length itself: the same length to within one 128-token step
    plan = dict(tp=1, cp=1, dp_replicate=1, ac="full", compile=False, micro_batch=1, mem="40GB")
    found = search("llama3-8b", all_variants=True, max_seq=True, **BASE, **plan).result
    longest = found.max_seq_len
    assert longest % 128 == 0 and len(found.top) == 1
    est = estimate("llama3-8b", max_seq=True, seq_len=longest, **BASE, **plan)
    assert est.fits and longest <= est.limits["max_seq_len"] < longest + 128


@pytest.mark.parametrize("compiled", [False, True])
def test_float8_any_searches_bf16_and_each_recipe_as_estimate_plans_them(compiled):
    # one plan pinned but its float8: bf16, tensorwise and rowwise, three distinct launchable plans (torchtitan's
    # float8 converter or none), each row with estimate's memory and step time for that --float8
    plan = dict(tp=1, cp=1, dp_replicate=1, ac="full", compile=compiled, micro_batch=1, seq_len=4096, mem="80GB")
    found = search("llama3-8b", all_variants=True, float8="any", **BASE, **plan).result
    assert found.candidates == 3 and sorted(found.float8) == ["", "rowwise", "tensorwise"]
    for i in range(3):
        row, recipe = found.row(i), found.float8[i] or None
        assert row["torchtitan"]["float8"] == recipe
        est = estimate("llama3-8b", float8=recipe, **BASE, **plan)
        assert row["memory"]["device_bytes"] == est.device_bytes
        assert row["step_time_s"] == pytest.approx(est.estimate.perf.step_time_s, rel=1e-9)


def test_float8_any_refusals_and_what_it_leaves_out(capsys):
    # estimate plans one recipe; other stacks have no torchao float8; an A100 has no FP8 tensor cores
    for command in (["estimate", "--float8", "any"], ["search", "--impl", "megatron", "--float8", "any"]):
        with pytest.raises(SystemExit) as exit_:
            main(command[:1] + ["--model", "llama3-8b", "--gpus", "8", "--mem", "80GB"]
                 + (["--impl", "torchtitan"] if command[0] == "estimate" else []) + command[1:])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and "any" in err, (command, err)
    found = search("llama3-8b", float8="any", tp=1, micro_batch=1, compile=True, **{**BASE, "gpu": "a100-80gb"},
                   mem="80GB").result
    assert set(found.float8) == {""} and any("no FP8 tensor cores" in n for n in found.notes)


def test_search_refuses_what_is_not_modelled_in_one_line(capsys):
    for extra in (["--pp", "4"], ["--cp", "2", "--compile"], ["--ac", "bogus"], ["--dp", "4"],
                  ["--dp-replicate", "3"]):
        with pytest.raises(SystemExit) as exit_:
            main(["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--mem", "80GB"] + extra)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("memplan: error:") and err.count("\n") == 1, (extra, err)


def test_the_table_and_json_show_torchtitans_dimensions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--mem", "80GB", "--gpu", GPU,
              "--seq-len", "2048", "--top", "3"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert all(c in out for c in ("dp_replicate", "dp_shard", "local batch", "AC", "compile"))
    with pytest.raises(SystemExit) as exit_:  # CSV: one column per setting
        main(["search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--mem", "80GB", "--gpu", GPU,
              "--seq-len", "2048", "--top", "1", "--format", "csv"])
    header = capsys.readouterr().out.splitlines()[0].split(",")
    assert {f"torchtitan_{k}" for k in ("dp_replicate", "dp_shard", "tp", "ac", "compile", "local_batch")} <= set(header)


# --- the step-time model -------------------------------------------------------------------------------------------
MODEL = load_model("llama3-8b").model.model_copy(update={"seq_length": 2048})
H100 = load_gpu(GPU)


def _plan(recompute=Recompute.NONE, b=1, M=1, t=1):
    return PlanValues(t=t, p=1, d=8 // t, m=1, sp=int(t > 1), zero=3, shard=8 // t, b=b, recompute=int(recompute),
                      recomputed_layers=32, microbatches=M)


def test_fsdp2_reduce_scatters_in_every_micro_batch():
    # torchtitan's train_step runs backward once per micro-batch and never turns FSDP2's gradient sync off
    # (torchtitan/trainer.py): 4 micro-batches reduce-scatter the gradients 4 times; Megatron-LM's ZeRO 3 reduces once
    def dp_comm(impl, M):
        est = estimate("llama3-8b", gpus=8, seq_len=2048, micro_batch=1, global_batch=8 * M, gpu=GPU, impl=impl,
                       **({"zero": 3} if impl == "megatron" else {}))
        return est.estimate.perf.dp_comm_s
    assert dp_comm("torchtitan", 4) == pytest.approx(4 * dp_comm("torchtitan", 1), rel=1e-6)
    assert dp_comm("megatron", 4) == pytest.approx(dp_comm("megatron", 1), rel=1e-6)


def test_selective_op_recomputes_wo_w3_and_the_forwards_elementwise_ops():
    # SelectiveAC's policy (torchtitan/distributed/activation_checkpoint.py) saves the 1st, 3rd and 5th matmul of a
    # block (wqkv, w1, w2) and the attention, and recomputes the rest: wo (2 s h h FLOPs, h = 4,096) and w3
    # (2 s h f, f = 14,336) per sequence, two GEMM kernels, and every memory-bound op of the forward
    s, h, f = 2048, 4096, 14336
    matmuls = (2 * s * h * h + 2 * s * h * f) / (H100.peak_bf16_flops * H100.matmul_efficiency)
    lt = layer_time(MODEL, H100, _plan(Recompute.SELECTIVE), impl="torchtitan")
    assert lt.recompute_s == pytest.approx(matmuls + 2 * H100.matmul_overhead_s + lt.forward_memory_s, rel=1e-6)


def test_torchtitans_block_runs_five_gemms():
    # torchtitan 0.3.0's Llama 3 block: wqkv (fused), wo, w1, w3, w2 (torchtitan/models/llama3/model.py)
    assert gemms_per_layer(MODEL, "torchtitan") == 5
    fwd = layer_forms(MODEL, H100, 2, "torchtitan").fwd_compute
    assert fwd.u == pytest.approx(5 * H100.matmul_overhead_s)
    assert fwd.t * H100.peak_bf16_flops * H100.matmul_efficiency >= layer_matmul_flops(MODEL)


def test_a_compiled_layer_moves_the_fused_kernels_bytes():
    # derived, uncalibrated: Inductor fuses each elementwise chain into one kernel (one read of its inputs, one write
    # of its output), the traffic of Megatron-LM's fused kernels, not eager's op-by-op passes
    eager = layer_time(MODEL, H100, _plan(), impl="torchtitan")
    compiled = layer_time(MODEL, H100, _plan(), impl="torchtitan", compiled=True)
    fused, unfused = layer_traffic_bytes(MODEL, 2, fused=True), layer_traffic_bytes(MODEL, 2, fused=False)
    hbm = H100.memory_bandwidth * H100.memory_bound_efficiency
    assert compiled.forward_memory_s == pytest.approx((fused.tp_fwd + fused.replicated_fwd) / hbm, rel=1e-6)
    assert eager.forward_memory_s == pytest.approx((unfused.tp_fwd + unfused.replicated_fwd) / hbm, rel=1e-6)
    assert compiled.forward_compute_s == eager.forward_compute_s
    # so a compiled plan is faster than the same plan eager, and says so in search's ranking
    one = dict(tp=1, dp_replicate=1, ac="full", micro_batch=2, seq_len=2048, **BASE)
    assert (estimate("llama3-8b", compile=True, **one).estimate.perf.step_time_s
            < estimate("llama3-8b", compile=False, **one).estimate.perf.step_time_s)


def test_hardware_flops_count_selective_ops_recomputed_matmuls():
    # HFU's FLOPs: per recomputed layer and sequence wo's 2 s h h and w3's 2 s h f (not Megatron-LM's attention core)
    s, h, f = 2048, 4096, 14336
    est = {impl: estimate("llama3-8b", gpus=8, seq_len=s, micro_batch=1, global_batch=8, gpu=GPU, impl=impl,
                          **({"ac": "selective-op"} if impl == "torchtitan" else {"recompute": "none", "zero": 3}))
           for impl in ("torchtitan", "megatron")}
    extra = est["torchtitan"].estimate.perf.hardware_flops - est["megatron"].estimate.perf.hardware_flops
    assert extra == pytest.approx(8 * 32 * (2 * s * h * h + 2 * s * h * f), rel=1e-9)


def test_hsdp_adds_the_all_reduce_across_replicas():
    # per gradient byte on one node's 8 GPUs (one NVLink rate c): FSDP2 over 8 reduce-scatters (1 - 1/8) c; HSDP 2 x 4
    # reduce-scatters over 4, (1 - 1/4) c, then all-reduces its quarter across the 2 replicas, 2 x 1/4 x (1 - 1/2) c:
    # 1.0 c in all, 8/7 of FSDP2's
    def dp_comm(replicate):
        return estimate("llama3-8b", seq_len=2048, micro_batch=1, dp_replicate=replicate, **BASE).estimate.perf.dp_comm_s
    assert dp_comm(2) / dp_comm(1) == pytest.approx(8 / 7, rel=1e-6)
