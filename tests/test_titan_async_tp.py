"""torchtitan's async TP (--async-tp: memplan/inventory/titan_async_tp.py, derived from torch 2.13's
torch/distributed/_symmetric_memory and inductor's micro_pipeline_tp pass, not measured): the symmetric-memory workspace
counted outside the caching allocator (in the device memory the verdict compares, not in the allocated peak, not
replayed), the TP collectives overlapped with their matmuls, the refusals and search rows equal to estimate's (the
emitted config as torchtitan 0.3.0 loads it: tests/test_launch_titan.py). Expected bytes are hand derivations from torch's
code (shown), and the requests torch's own fused ops make, traced on CPU (validation/titan_async_tp.py)."""

import pytest

from memplan.api.estimating import estimate
from memplan.api.searching import search
from memplan.cli import main
from memplan.memory.term_bytes import PlanValues
from memplan.presets.catalog import load_gpu, load_model
from memplan.timing.arrays import plan_floats
from memplan.timing.comm import link_per_byte
from memplan.timing.forms import basis
from memplan.timing.layer import async_tp_exposed

GPU = "h100-80gb"
PLAN = dict(impl="torchtitan", gpus=8, tp=2, ac="full", compile=True, seq_len=4096, micro_batch=2, global_batch=16,
            gpu=GPU)


def test_the_workspace_is_outside_the_pool_at_4sbh_over_t():
    # llama3-8b (h 4,096), s 4,096, b 2, t 2, bf16. torch 2.13 _pipelined_produce_and_all2all (wo / w2 + reduce-scatter,
    # and the column-parallel linears' input gradients in the backward) asks get_symm_mem_workspace for
    # out_chunks[0].numel() * element_size() * 2 = (s b / t) h x 2 B x 2 = 4096 x 4096 x 2 x 2 = 67,108,864 B; the
    # all-gather's request is the shard, (s b / t) h x 2 B = 33,554,432 B; the workspace is the larger, made by
    # empty_strided_p2p outside the caching allocator
    plain = estimate("llama3-8b", **PLAN)
    fused = estimate("llama3-8b", async_tp=True, **PLAN)
    workspace = (4096 * 2 // 2) * 4096 * 2 * 2
    assert workspace == 67_108_864
    dev, base = fused.estimate.device, plain.estimate.device
    assert dev.symm_workspace_bytes == workspace and base.symm_workspace_bytes == 0
    # not a tensor of the step, not in PyTorch's pool: the allocated peak and the replayed reserved peak do not move
    assert dev.peak_bytes == base.peak_bytes and dev.allocated_peak == base.allocated_peak
    assert fused.estimate.reserved.result.reserved_peak_bytes == plain.estimate.reserved.result.reserved_peak_bytes
    # ... but the caching allocator may take that much less of the GPU (the workspace holds it)
    assert plain.estimate.reserved.capacity_bytes - fused.estimate.reserved.capacity_bytes == workspace
    # in what the verdict compares: the outside-the-pool part, so the total grows by exactly the workspace
    assert dev.runtime_bytes - base.runtime_bytes == workspace
    assert fused.device_bytes - plain.device_bytes == workspace


@pytest.mark.parametrize("model,s,b,t", [("llama3-8b", 4096, 2, 2), ("llama3-70b", 8192, 16, 8)])
def test_the_workspace_is_what_torchs_fused_ops_ask_for(model, s, b, t):
    # torch 2.13's own fused ops (validation/titan_async_tp.py: run on meta tensors up to their get_symm_mem_workspace
    # call) at torchtitan's TP shapes: the all-gather asks for the shard, (s b / t) h x 2 B; the reduce-scatter for
    # two chunks of its output, 2 x (s b / t) h x 2 B (the backward's are the same ops on the same shapes, roles
    # swapped); memplan's workspace is the larger
    from validation.titan_async_tp import workspace_requests

    spec = load_model(model).model
    h, f = spec.hidden_size, spec.f
    asked = workspace_requests(s, b, h, f, t)
    shard = (s * b // t) * h * 2
    assert asked == {"all_gather_matmul": shard, "matmul_reduce_scatter": 2 * shard}
    est = estimate(model, impl="torchtitan", gpus=8 * t, tp=t, ac="full", compile=True, seq_len=s, micro_batch=b,
                   global_batch=8 * b, async_tp=True)
    assert est.estimate.device.symm_workspace_bytes == max(asked.values())


def test_the_workspace_shows_in_the_table_and_json(capsys):
    args = ["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--tp", "2", "--compile",
            "--ac", "full", "--seq-len", "4096", "--micro-batch", "2", "--global-batch", "16", "--async-tp"]
    for command, extra in (("estimate", []), ("estimate", ["--json"]), ("explain", [])):
        with pytest.raises(SystemExit) as exit_:
            main([command] + args[1:] + extra)
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "async TP symmetric-memory workspace" in out and "2 A s b h / t = 67,108,864 B" in out
    assert '"symm_workspace_bytes": 67108864' in out


@pytest.mark.parametrize("extra,words", [
    (["--tp", "2"], "needs --compile"),  # torchtitan's CompileConfig.__post_init__ refuses it
    (["--tp", "1", "--compile"], "--tp 2 or more"),  # _maybe_enable_async_tp: no TP mesh, nothing enabled
    (["--tp", "2", "--compile", "--impl", "megatron"], "give --impl torchtitan"),
])
@pytest.mark.parametrize("command", ["estimate", "search"])
def test_refused_in_one_line(extra, words, command, capsys):
    if command == "search" and extra[:2] == ["--tp", "2"] and "--compile" not in extra:
        extra = extra + ["--no-compile"]  # search: compile unpinned tries the compiled plans; --no-compile leaves none
    args = [command, "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--async-tp"] + extra
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and err.count("\n") == 1, err


def test_the_collectives_left_exposed_are_what_the_matmuls_cannot_hide():
    # one llama3-70b layer (s 8,192, h 8,192, q 8,192, 64 heads, 8 K/V heads, f 28,672) on the H100 preset, per
    # sequence: each collective moves A s h = 2 x 8192 x 8192 B at (t - 1) / t x link_per_byte; each fused op's matmul
    # takes its forward FLOPs / t at peak x matmul_efficiency: wqkv 2 s h (q + 2 q g / a), w1 + w3 2 x 2 s h f, wo
    # 2 s q h, w2 2 s h f. Exposed: max(comm - matmul, 0) per fused op (torch/_inductor/fx_passes/micro_pipeline_tp.py
    # fuses a reduce-scatter only with the one mm producing its input).
    model, gpu = load_model("llama3-70b").model.model_copy(update={"seq_length": 8192}), load_gpu(GPU)
    s, h, f = 8192.0, 8192.0, 28672.0
    rate = gpu.peak_bf16_flops * gpu.matmul_efficiency
    flops = {"wqkv": 2 * s * h * (h + 2 * h * 8 / 64), "w13": 4 * s * h * f, "wo": 2 * s * h * h, "w2": 2 * s * h * f}
    for t in (1, 2, 8):
        plan = PlanValues(t=t, p=1, d=1, m=1, sp=1, zero=3, shard=1, b=1, recompute=2, recomputed_layers=80,
                          microbatches=1)
        comm = 2 * s * h * (t - 1) / t * float(link_per_byte(gpu, t))
        left = {k: max(comm - n / t / rate, 0.0) for k, n in flops.items()}
        fwd, both = async_tp_exposed(model, gpu, basis(gpu, plan_floats(plan)), 2, False)
        assert fwd == pytest.approx(sum(left.values()), rel=1e-6, abs=1e-15)
        # backward: wo / w2's output-gradient all-gathers and wqkv's input-gradient reduce-scatter fused with their
        # input-gradient GEMMs; the MLP's input gradient (w1's + w3's, no single matmul) reduce-scattered unfused, whole;
        # wqkv's and w1 / w3's re-gathers beside their weight-gradient GEMMs
        backward = left["wo"] + left["w2"] + left["wqkv"] + comm + left["wqkv"] + left["w13"]
        assert both == pytest.approx(sum(left.values()) + backward, rel=1e-6, abs=1e-15)
        if t == 1:
            assert fwd == both == 0.0  # no TP group, nothing to hide
        if t == 8:  # at t 8 the smaller GEMMs no longer hide their collective: some is left, less than all
            assert 0.0 < fwd < 4 * comm


def test_async_tp_shortens_the_step_by_the_hidden_collectives():
    # the step keeps its compute, memory-bound and recompute's matmuls; its exposed TP time (and, under full AC, the
    # recomputed forwards' collectives) shrink by what the layers' fused ops hide
    plain = estimate("llama3-8b", **PLAN).estimate.perf
    fused = estimate("llama3-8b", async_tp=True, **PLAN).estimate.perf
    assert fused.compute_s == plain.compute_s and fused.memory_s == plain.memory_s
    assert fused.tp_comm_exposed_s < plain.tp_comm_exposed_s and fused.step_time_s < plain.step_time_s
    assert fused.recompute_s <= plain.recompute_s


def test_a_search_with_async_tp_lists_the_plans_estimate_times():
    # --async-tp pins it on the compiled plans with tp > 1 (torchtitan does nothing without a TP mesh; its
    # CompileConfig refuses it eager): each of them, and the others, with estimate's memory and step time
    found = search("llama3-8b", impl="torchtitan", gpus=8, global_batch=16, gpu=GPU, seq_len=2048, ac="full",
                   async_tp=True, all_variants=True, top=3).result
    e = found.evaluated
    dims = [found.row(i)["torchtitan"] for i in range(found.candidates)]
    on = [i for i, d in enumerate(dims) if d.get("async_tp")]
    assert {(dims[i]["compile"], dims[i]["tp"] > 1) for i in on} == {(True, True)}
    assert all(not (d["compile"] and d["tp"] > 1) for d in dims if not d.get("async_tp"))
    assert len(on) >= 3
    for i in on[::max(1, len(on) // 4)] + [next(i for i, d in enumerate(dims) if not d["compile"])]:
        d = dims[i]
        est = estimate("llama3-8b", impl="torchtitan", gpus=8, global_batch=16, gpu=GPU, seq_len=2048, tp=d["tp"],
                       pp=d["pp"], pipeline_schedule=d["pipeline_schedule"], dp_replicate=d["dp_replicate"],
                       ac=d["ac"], compile=d["compile"], async_tp=d.get("async_tp"),
                       micro_batch=d["pipeline_microbatch_size"] or d["local_batch"])
        assert est.estimate.step.peak_bytes == e.peak_bytes[i], d
        assert est.device_bytes == found.row(i)["memory"]["device_bytes"], d
        assert est.estimate.perf.step_time_s == pytest.approx(e.step_time_s[i], rel=1e-6), d
