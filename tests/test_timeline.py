"""The step timeline (memplan/memory/timeline.py): the planner's critical moments equal the walk over
every layer for every implementation; hand-derived bytes of the moments the issue names; what the
device adds; the fit and --max-seq answers through the CLI."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

import memplan

from memplan.plan.estimate import estimate, step_peaks
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues
from memplan.presets.catalog import load_gpu
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec
from memplan.memory.states import total_params
from memplan.inventory.assemble import inventory_for
from memplan.memory.timeline import step_events

H100 = load_gpu("h100-80gb")


@st.composite
def plans(draw):
    impl = draw(st.sampled_from(["megatron", "torch", "hf-eager", "hf-sdpa"]))
    hf = impl.startswith("hf-")
    llama = hf and draw(st.booleans()) or (impl == "megatron" and draw(st.booleans()))
    a = draw(st.sampled_from([4, 8]))
    h = a * draw(st.sampled_from([16, 32]))
    L = draw(st.sampled_from([2, 4, 6, 8]))
    t = 1 if hf else draw(st.sampled_from([t for t in (1, 2, 4) if not llama or (a // 2) % t == 0]))
    p = 1 if hf else draw(st.sampled_from([d for d in (1, 2) if L % d == 0]))
    m = draw(st.sampled_from([m for m in (1, 2) if L % (p * m) == 0 and (m == 1 or p > 1)]))
    s = 64 * draw(st.integers(1, 8))
    arch = dict(norm="rmsnorm", mlp="swiglu", position_embedding="rope", tied_embeddings=False, bias=False,
                num_kv_heads=a // 2, ffn_hidden_size=3 * h) if llama else {}
    attention = "flash" if impl == "hf-sdpa" else ("eager" if impl in ("torch", "hf-eager") else
                                                   draw(st.sampled_from(["eager", "flash"])))
    model = ModelSpec(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=s,
                      vocab_size=draw(st.sampled_from([256, 1000])), attention=attention,
                      dropout=False if hf and attention == "flash" else draw(st.booleans()), **arch)
    n = L // (p * m)
    recompute = draw(st.sampled_from(["none", "full"] + ([] if hf else ["selective"])))
    k = draw(st.integers(1, n)) if recompute == "full" else None
    b, d, M = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2])), draw(st.integers(1, 4))
    training = TrainingSpec(micro_batch=b, global_batch=b * d * M, recompute=recompute, recompute_num_layers=k,
                            precision=draw(st.sampled_from(["bf16-mixed", "bf16-true", "32-true"])),
                            optimizer_impl=draw(st.sampled_from(["foreach", "fused"])))
    par = ParallelSpec(tp=t, pp=p, vpp=m, dp=d, sp=t > 1 and draw(st.booleans()),
                       zero=draw(st.integers(0, 3)) if d > 1 else 0)
    return Config(model=model, parallel=par, training=training), impl


@settings(max_examples=400, deadline=None)
@given(plans())
def test_critical_moments_equal_the_walk(case):
    config, impl = case
    inv = inventory_for(config.model, impl)
    plan = PlanValues.from_config(config)
    for stage in range(config.parallel.pp):
        mem = stage_memory(config.model, inv.terms, config.training, plan, stage, granularity=inv.granularity)
        walk = step_events(config.model, inv, config.training, plan, mem, stage)
        critical = step_events(config.model, inv, config.training, plan, mem, stage, critical=True)
        assert critical.peak_bytes == walk.peak_bytes
        assert walk.peak_bytes == max(e.bytes for e in walk.events)


def llama_like(**over):
    model = ModelSpec(num_layers=4, hidden_size=512, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=1536,
                      seq_length=1024, vocab_size=32000, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
                      tied_embeddings=False, bias=False, dropout=False, attention="flash")
    return Config(model=model, training=TrainingSpec(**{"precision": "bf16-true", **over}))


def test_hf_loss_backward_holds_two_fp32_logit_gradients():
    # transformers' ForCausalLMLoss backward (validation/step.py op log): nll_loss's and log_softmax's
    # gradients, fp32 [b, s, v] each, beside the saved fp32 log-probabilities: 2 x 4 x s b v bytes
    config = llama_like()
    step = step_peaks(config, inventory_for(config.model, "hf-sdpa"), walk=0)[0]
    loss = next(e for e in step.events if e.moment.startswith("loss backward"))
    assert loss.parts["transient"] == 2 * 4 * 1024 * 1 * 32000


def test_foreach_adamw_temporary_is_one_copy_of_the_stepped_parameters():
    # torch/optim/adam.py _multi_tensor_adam: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs), one tensor
    # per parameter in the states' dtype. bf16-true: 2 bytes per parameter; fused: none.
    n = total_params(llama_like().model)
    for impl, temp in (("foreach", 2 * n), ("fused", 0)):
        config = llama_like(optimizer_impl=impl)
        step = step_peaks(config, inventory_for(config.model, "hf-sdpa"), walk=0)[0]
        assert step.optimizer_temp_bytes == temp
        opt = step.events[-1]
        # weights 2 + moments 2 x 2 + .grad 2 bytes per parameter, plus the temporary
        assert opt.phase == "optimizer" and opt.bytes == 8 * n + temp
    # bf16-mixed steps the fp32 master copy: 4 bytes per parameter
    config = Config(model=llama_like().model, training=TrainingSpec(optimizer_impl="foreach"))
    assert step_peaks(config, inventory_for(config.model, "hf-sdpa"))[0].optimizer_temp_bytes == 4 * n


def test_device_memory_adds_margin_and_runtime():
    config = llama_like(optimizer_impl="fused")
    est = estimate(config, gpu=H100, impl="hf-eager")
    # the cuBLAS workspaces join the tensors in PyTorch's pool: 32 MiB for each thread that runs matmuls, the
    # forward's and autograd's backward thread (two blocks recorded on an H100, tests/test_stream.py); 10 % margin on
    # both (rounded up) + 0.80 GB for a plain PyTorch process with no NCCL group (d = 1)
    allocated = est.step.peak_bytes + 2 * 32 * 2**20
    assert est.device.allocated_peak == allocated
    # the flat margin is a floor: where the allocator's replay reserves more above the allocated peak, that counts
    margin = -(-allocated // 10)
    reserved = est.reserved.result.reserved_peak_bytes
    assert est.device.flat_total == allocated + margin + 800_000_000
    assert est.device.total == allocated + max(margin, reserved - allocated) + 800_000_000
    # hf-sdpa's Llama, plain loop: its stream is the one checked against recordings of the real run
    # (Inventory.stream_checked): no flat margin, what the replay reserves above the allocated peak
    sdpa = estimate(config, gpu=H100, impl="hf-sdpa")
    reserved = sdpa.reserved.result.reserved_peak_bytes
    assert sdpa.device.margin == 0 and sdpa.device.total == reserved + 800_000_000 > sdpa.device.allocated_peak
    # a data-parallel stack's gathers are not in the recorded run: FSDP2 keeps the flat margin
    fsdp2 = memplan.estimate("llama3-8b", impl="hf-sdpa", gpus=8, global_batch=8, fsdp2=True, gpu="h100-80gb")
    assert fsdp2.estimate.device.margin == H100.fragmentation_margin > 0
    # K22's 530B plan (megatron-core): 2.6 GB with one communicator, + 0.6 GB for each further
    # group of more than one rank (t = 8, p = 35; d = 1: two groups)
    from memplan.presets.batch import make_config
    from memplan.presets.catalog import load_model

    big = estimate(make_config(load_model("gpt3-530b")), gpu=load_gpu("a100-80gb"))
    assert big.device.runtime_bytes == 2_600_000_000 + 600_000_000


def test_cli_peak_fields_and_max_seq(run_cli):
    args = ("estimate", "--model", "llama3-8b", "--impl", "hf-sdpa", "--tp", "1", "--pp", "1", "--no-sp", "--dp", "1",
            "--global-batch", "1", "--precision", "bf16-true", "--optimizer-impl", "fused", "--recompute", "full")
    code, out, _ = run_cli(*args, "--seq-len", "4096", "--max-seq", "--json")
    data = json.loads(out)
    mem = data["memory"]
    assert mem["peak_phase"] in ("forward", "loss", "backward", "optimizer")
    assert max(e["bytes"] for e in mem["timeline"]) == mem["peak_bytes"]
    assert mem["allocated_peak_bytes"] == mem["peak_bytes"] + mem["workspace_bytes"]
    assert mem["device_bytes"] == mem["allocated_peak_bytes"] + mem["fragmentation_bytes"] + mem["runtime_bytes"]
    s = data["max_seq_len"]
    # the answer is the boundary of the fit verdict: s fits, s + 1 does not
    fits = json.loads(run_cli(*args, "--seq-len", str(s), "--json")[1])
    over = json.loads(run_cli(*args, "--seq-len", str(s + 1), "--json")[1])
    assert fits["fits"] is True and over["fits"] is False
    # issue 20's runs on an H100 80GB (transformers sdpa, bf16 weights and AdamW states, one sequence per step):
    # with foreach AdamW 2,048 tokens train without checkpointing and 12,288 with it (2 + 2 + 4 + 2 bytes per
    # parameter at the optimizer step, 80.3 GB: the flat 10 % margin called neither a fit); with fused AdamW and
    # checkpointing 14,336 tokens fail (the optimizer states made at the first step): --max-seq stays below it
    for extra, s_trains in ((("--recompute", "none"), 2048), ((), 12288)):
        run = json.loads(run_cli(*args, *extra, "--seq-len", str(s_trains), "--optimizer-impl", "foreach",
                                 "--gpu", "h100-80gb", "--json")[1])
        assert run["fits"] is True, (extra, run["memory"]["oom_event"])
    longest = json.loads(run_cli(*args, "--gpu", "h100-80gb", "--max-seq", "--json")[1])["max_seq_len"]
    assert 12288 <= longest < 14336


def test_search_max_seq(run_cli):
    code, out, _ = run_cli("search", "--model", "gpt-22b", "--gpus", "8", "--mem", "80GB", "--max-seq", "--json",
                           "--top", "1")
    data = json.loads(out)
    s = data["max_seq_len"]
    assert s % 128 == 0 and data["plans"] and data["plans"][0]["memory"]["device_bytes"] <= 80 * 10**9
    code, out, _ = run_cli("search", "--model", "gpt-22b", "--gpus", "8", "--mem", "80GB", "--seq-len", str(s + 128),
                           "--json")
    assert json.loads(out)["feasible"] == 0


def test_cuda_allocator_blocks_are_modelled():
    # PyTorch's CUDA caching allocator rounds every block up to 512 bytes; CPU is exact. A layer of
    # s = 3, b = 1, h = 8 keeps LayerNorm's fp32 mean and rstd as two storages of 3 x 4 = 12 bytes:
    # 24 bytes of data in two 512-byte blocks on CUDA. Its input, 3 x 8 x 2 = 48 bytes, is one block.
    model = ModelSpec(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=3, vocab_size=16)
    config = Config(model=model)
    plan = PlanValues.from_config(config)
    for device, stats, layer_input in (("cuda", 2 * 512, 512), ("cpu", 2 * 3 * 2, 48)):
        inv = inventory_for(model, "megatron", device)
        mem = stage_memory(model, inv.terms, config.training, plan, 0, granularity=inv.granularity)
        # on CPU torch's layer norm keeps its statistics in the activation dtype (2 bytes)
        assert mem.unit_bytes["ln1_stats"] == stats
        assert mem.unit_bytes["ln1_input"] == layer_input


def test_estimate_require_fit_exit_code(run_cli):
    # exit 0 exactly when the device memory the plan needs is within the budget, 1 one byte below it
    need = json.loads(run_cli("estimate", "--model", "gpt-22b", "--json")[1])["memory"]["device_bytes"]
    assert run_cli("estimate", "--model", "gpt-22b", "--mem", f"{need}B", "--require-fit")[0] == 0
    assert run_cli("estimate", "--model", "gpt-22b", "--mem", f"{need - 1}B", "--require-fit")[0] == 1
    assert run_cli("estimate", "--model", "gpt-22b", "--mem", f"{need - 1}B")[0] == 0  # without it: a report
