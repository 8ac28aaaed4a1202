"""Offload (memplan/memory/offload.py): optimizer states to the host (Megatron-LM's HybridDeviceOptimizer) and the decoder
layers' saved tensors (torch's save_on_cpu): hand-derived bytes, the GPU peak, host memory per node and its budget
in estimate and search, the step time's PCIe copies, what torch's save_on_cpu really packs (measured on CPU), the
Megatron-LM flags, bad input."""

import json
from pathlib import Path

import numpy as np
import pytest

from memplan.plan.estimate import estimate
from memplan.memory.term_bytes import PlanValues
from memplan.memory.offload import layer_copy_bytes, pow2ceil
from memplan.plan.arrange import arrange
from memplan.plan.search import search
from memplan.presets.batch import search_inputs
from memplan.presets.catalog import load_gpu, load_model
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec
from memplan.memory.states import total_params

# A small K22 GPT: L = 2, h = 64, a = 4, s = 32, v = 128 (LayerNorm, biases, learned positions, tied embeddings).
GPT = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
# parameters, by hand: a layer 12h^2 (QKV 3h^2, projection h^2, MLP 8h^2) + 13h (2 LayerNorms 4h, biases 3h + h +
# 4h + h) = 49,152 + 832 = 49,984; two layers 99,968; word embedding vh 8,192 + positions sh 2,048 + final norm 2h 128
P = 99_968 + 8_192 + 2_048 + 128
assert P == 110_336
A100 = load_gpu("a100-80gb")


def config(dp=1, zero=0, impl_training=None, **training):
    return Config(model=GPT, parallel=ParallelSpec(dp=dp, zero=zero),
                  training=TrainingSpec(global_batch=dp, **(impl_training or {}), **training))


def test_parameter_count_by_hand():
    assert total_params(GPT) == P


def test_pow2ceil_scalars_and_arrays():
    values = [0, 1, 2, 3, 4, 5, 24_576, 32_768, 32_769, (1 << 40) + 1]
    want = [0, 1, 2, 4, 4, 8, 32_768, 32_768, 65_536, 1 << 41]
    assert [pow2ceil(v) for v in values] == want
    assert pow2ceil(np.array(values, dtype=np.int64)).tolist() == want


# --- optimizer offload -----------------------------------------------------------------------------

def test_optimizer_offload_moves_exactly_the_states_off_the_gpu():
    """bf16-mixed AdamW, one GPU, everything offloaded: the GPU loses master + 2 moments = 12 B per parameter
    (12 x 110,336 = 1,324,032 B) at every moment of the step; the host holds them plus the pinned fp32 gradient
    copies (4 B) and the cached 16-bit clones (2 B): 6 x 110,336 = 662,016 B of staging."""
    base, off = estimate(config()), estimate(config(offload_optimizer_fraction=1.0))
    assert base.peak.optimizer == 12 * P and off.peak.optimizer == 0
    assert off.peak.host_optimizer == 1_324_032
    assert (off.host.optimizer, off.host.staging, off.host.activations, off.host.weights) == (1_324_032, 662_016, 0, 0)
    drops = [a.bytes - b.bytes for a, b in zip(base.step.events, off.step.events)]
    phases = [e.phase for e in base.step.events]
    assert phases[-1] == "optimizer"
    assert set(drops[:-1]) == {1_324_032}
    # the optimizer step: Megatron-LM's fused Adam has no temporaries; copying the host's fp32 parameters back
    # into the bf16 weights goes through an fp32 GPU temporary of the largest tensor, an MLP matrix 4h x h:
    # 4 x 16,384 = 65,536 B (torch Copy.cu, non_blocking conversion on the GPU)
    assert drops[-1] == 1_324_032 - 65_536
    assert base.step.peak_bytes - off.step.peak_bytes == 1_324_032  # the peak is not at the optimizer step here


def test_offload_fraction_and_zero_shard():
    """d = 8, ZeRO-1: a GPU holds ceil(110,336 / 8) = 13,792 parameters' states, 12 x 13,792 = 165,504 B; half
    offloaded: ceil(165,504 / 2) = 82,752 B on the host, and 6,896 parameters' pinned staging, 6 x 6,896 = 41,376 B."""
    e = estimate(config(dp=8, zero=1, offload_optimizer_fraction=0.5), gpu=A100)
    assert e.peak.optimizer == 165_504 - 82_752 and e.host.optimizer == 82_752 and e.host.staging == 41_376
    # host memory per node: a node of 8 A100s holds the 8 GPUs' offload
    assert e.host_bytes_per_node == 8 * (82_752 + 41_376)
    assert json.loads(json.dumps(_estimate_json(e)))["host_bytes_per_node"] == 8 * 124_128


def _estimate_json(e):
    from memplan.report.formats import estimate_dict

    return estimate_dict(e)


def test_host_memory_per_node_counts_the_gpus_of_a_node():
    """Every GPU of the node offloads: d = 8 on 8-GPU nodes, all offloaded: (165,504 + 6 x 13,792) x 8; a job of 2
    GPUs puts only 2 on its node."""
    e = estimate(config(dp=8, zero=1, offload_optimizer_fraction=1.0), gpu=A100)
    assert e.host_bytes_per_node == 8 * (165_504 + 82_752) == 1_986_048
    two = estimate(config(dp=2, zero=1, offload_optimizer_fraction=1.0), gpu=A100)
    assert two.host_bytes_per_node == 2 * two.host.total


def test_host_budget_refuses_the_plan():
    plan = config(dp=8, zero=1, offload_optimizer_fraction=1.0)
    assert estimate(plan, gpu=A100, host_budget_bytes=1_986_048).fits is True
    tight = estimate(plan, gpu=A100, host_budget_bytes=1_986_047)
    assert tight.fits is False and tight.fits_host is False and tight.device.total < tight.budget_bytes


def test_step_time_pays_the_pcie_copies():
    """Optimizer offload: the GPU no longer updates the offloaded states (its optimizer time goes), and every step
    copies the fp32 gradients to the host and the fp32 parameters back: 2 x 4 B x 13,792 parameters over 25 GB/s
    (the A100 preset's host_bandwidth), exposed."""
    base = estimate(config(dp=8, zero=1), gpu=A100).perf
    off = estimate(config(dp=8, zero=1, offload_optimizer_fraction=1.0), gpu=A100).perf
    copies = 2 * 4 * 13_792 / 25e9
    assert off.host_copy_s == pytest.approx(copies, rel=1e-6)
    assert off.optimizer_s == 0 and base.host_copy_s == 0
    assert off.step_time_s - base.step_time_s == pytest.approx(copies - base.optimizer_s, abs=1e-9)


# --- activation offload ----------------------------------------------------------------------------

def test_activation_offload_host_bytes_by_hand():
    """The reference torch layer (--impl torch) at s = 32, b = 1, h = 64, a = 4 saves K22's 34sbh + 5as^2b =
    69,632 + 20,480 = 90,112 B, two LayerNorms' fp32 mean and rstd 2 x 2 x 4sb = 512 B, and the chunk's causal mask
    s^2 = 1,024 B, packed once per layer that saves it: 91,648 B per layer, all powers of two already; 2 layers:
    183,296 B. Its weights are packed with it: QKV 3h^2 x 2 B = 24,576 -> 32,768 (a pinned block is a power of two),
    projection 8,192, MLP 2 x 32,768, four LayerNorm vectors 4 x 128 (the linear biases are not saved): 107,008 B per
    layer, 214,016 B for 2."""
    e = estimate(config(offload_activations=True), impl="torch")
    assert (e.host.activations, e.host.weights) == (183_296, 214_016)
    # the copies themselves move the tensors' own bytes: 91,648 + (12h^2 + 4h) x 2 B = 91,648 + 98,816 per layer
    plan = PlanValues.from_config(config())
    assert layer_copy_bytes(GPT, TrainingSpec(offload_activations=True), plan, "torch") == 91_648 + 98_816


def test_activation_offload_gpu_keeps_one_layer():
    """In layer j's backward the GPU holds that layer's saved tensors but none of layers 1..j-1 (on the host):
    j - 1 layers' saved bytes fewer than without offload, and one unpacked weight more, the largest: an MLP
    matrix, 4h x h x 2 B = 32,768 B. A walk of every layer (estimate keeps the most loaded stage's)."""
    base, off = (estimate(config(**kw), impl="torch").step.events for kw in ({}, dict(offload_activations=True)))
    layer = estimate(config(), impl="torch").peak.unit_bytes
    from memplan.inventory.assemble import inventory_for

    per_layer = sum(layer[t.id] for t in inventory_for(GPT, "torch").terms if t.scope == "layer")
    backward = [(a, b) for a, b in zip(base, off) if a.phase == "backward" and a.layer is not None]
    assert backward
    for a, b in backward:
        assert a.parts["saved"] - b.parts["saved"] == (a.layer - 1) * per_layer, a.moment
        assert b.parts["transient"] - a.parts["transient"] == 32_768
    # the forward after layer 2: the current layer until packed; layer 1 is on the host
    fwd = [(a, b) for a, b in zip(base, off) if a.phase == "forward" and a.layer == 2]
    assert fwd and fwd[0][0].parts["saved"] - fwd[0][1].parts["saved"] == per_layer


def test_activation_offload_step_time():
    """save_on_cpu copies each layer's packed bytes to the host in the forward and back in the backward, on the
    compute stream: 2 layers x 2 x 190,464 B over 25 GB/s (one micro-batch)."""
    e = estimate(config(offload_activations=True), gpu=A100, impl="torch")
    assert e.perf.host_copy_s == pytest.approx(2 * 2 * 190_464 / 25e9, rel=1e-6)
    base = estimate(config(), gpu=A100, impl="torch").perf
    assert e.perf.step_time_s - base.step_time_s == pytest.approx(e.perf.host_copy_s, rel=1e-4)


def test_save_on_cpu_packs_what_memplan_counts():
    """Measured on CPU: torch's own save_on_cpu(pin_memory=True) (no CUDA: unpinned, but a real copy per saved
    tensor) around the reference layer packs exactly memplan's per-layer copy bytes, the weights included."""
    torch = pytest.importorskip("torch")
    from validation.layers import GPTLayer, LayerConfig, causal_mask
    from validation.parallel import Comm

    torch.manual_seed(0)
    h, a, s, b = 256, 8, 128, 2
    layer = GPTLayer(LayerConfig(h=h, a=a, f=4 * h), Comm(), dtype=torch.bfloat16)
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    packed = []
    ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
    pack = ctx.pack_hook

    def recording(t):
        device, copy = pack(t)
        packed.append(copy)
        return device, copy

    ctx.pack_hook = recording
    with ctx:
        y = layer(x, causal_mask(s))
    y.float().sum().backward()
    model = ModelSpec(num_layers=1, hidden_size=h, num_attention_heads=a, seq_length=s, vocab_size=512)
    plan = PlanValues.from_config(Config(model=model, training=TrainingSpec(micro_batch=b)))
    got = sum(t.untyped_storage().nbytes() for t in packed)
    assert got == layer_copy_bytes(model, TrainingSpec(micro_batch=b, offload_activations=True), plan, "torch",
                                   "cpu") == 5_132_288


def test_save_on_cpu_on_transformers_llama_packs_resaved_tensors_again():
    """transformers' Llama saves some tensors more than once (the RMSNorms' fp32 input and statistics, the normed
    input of q / k / v and gate / up): save_on_cpu copies each save, memplan counts each storage once per layer. So
    for --impl hf-* its host bytes and copy time are lower bounds: measured here, memplan's figure is exactly the
    packs counted once per storage, and the packs themselves are 26% more (tiny shapes)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import tempfile

    from memplan.presets.hf_config import read_hf_config
    from validation.hf import HFCase, _forward_fresh, build_config, build_model

    case = HFCase(s=32, b=2, h=64, a=4, f=160, v=512, L=2, p_drop=0.0, arch="llama", attn="sdpa", g=2)
    model = build_model(case)
    model.train()
    ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
    packs, pack, alive = [], ctx.pack_hook, []

    def recording(t):
        device, copy = pack(t)
        alive.append(t)  # no storage is freed and its address reused while the packs are counted
        packs.append((t.untyped_storage().data_ptr(), copy.untyped_storage().nbytes()))
        return device, copy

    ctx.pack_hook = recording
    with ctx:
        loss = _forward_fresh(model, case, "layer")
    loss.backward()
    once = {}
    for ptr, n in packs:
        once[ptr] = max(once.get(ptr, 0), n)
    hf = build_config(case).to_dict()
    hf["architectures"] = ["LlamaForCausalLM"]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(hf, f)
    spec = read_hf_config(f.name).model
    training = TrainingSpec(micro_batch=2, precision="bf16-true", offload_activations=True)
    want = layer_copy_bytes(spec, training, PlanValues.from_config(Config(model=spec, training=training)), "hf-sdpa",
                            "cpu")
    total = sum(n for _, n in packs)
    assert sum(once.values()) == want
    assert 1.2 < total / want < 1.3


# --- search --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_offload():
    gpu = load_gpu("h100-80gb")
    model, training, gb = search_inputs(load_model("llama3-8b"), 8, None, None, None,
                                        dict(offload_optimizer_fraction=1.0), None)
    return model, training, gb, gpu


def test_search_filters_on_host_memory(llama_offload):
    model, training, gb, gpu = llama_offload
    free = search(model, training, 8, gb, gpu.memory_bytes, gpu=gpu)
    host = np.asarray(free.evaluated.host_bytes_per_node)
    budget = int(np.median(host[host > 0]))
    limited = search(model, training, 8, gb, gpu.memory_bytes, gpu=gpu, host_budget_bytes=budget)
    device = np.asarray(free.evaluated.device_bytes)
    fits = (device <= gpu.memory_bytes) & (device > 0) & (host <= budget)
    assert 0 < limited.feasible == int(fits.sum()) < free.feasible
    arrange(limited)
    assert limited.top and all(limited.row(i)["memory"]["host_bytes_per_node"] <= budget for i in limited.top)
    reference = search(model, training, 8, gb, gpu.memory_bytes, gpu=gpu, host_budget_bytes=budget, reference=True)
    assert reference.feasible == limited.feasible and reference.top[:5] == search(
        model, training, 8, gb, gpu.memory_bytes, gpu=gpu, host_budget_bytes=budget).top[:5]


def test_search_host_memory_equals_estimate(llama_offload):
    model, training, gb, gpu = llama_offload
    result = arrange(search(model, training, 8, gb, gpu.memory_bytes, gpu=gpu, top=3))
    for i in result.top:
        e = estimate(result.config(i), gpu=gpu)
        assert result.row(i)["memory"]["host_bytes_per_node"] == e.host_bytes_per_node > 0
        assert result.row(i)["memory"]["device_bytes"] == e.flat_total


def test_search_with_activation_offload_keeps_recompute_none():
    gpu = load_gpu("h100-80gb")
    model, training, gb = search_inputs(load_model("llama3-8b"), 8, None, None, None, dict(offload_activations=True),
                                        None)
    result = search(model, training, 8, gb, gpu.memory_bytes, gpu=gpu)
    assert result.feasible and set(np.asarray(result.evaluated.plans.recompute).tolist()) == {0}


# --- launch --------------------------------------------------------------------------------------

def test_megatron_flags_for_offload():
    from memplan.launch.megatron import megatron_launch

    launch = megatron_launch(config(dp=8, zero=1, offload_optimizer_fraction=0.5))
    assert {"--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction 0.5",
            "--use-distributed-optimizer"} <= set(launch.args)
    one = megatron_launch(config(offload_optimizer_fraction=1.0))  # d = 1: the distributed optimizer is free
    assert "--use-distributed-optimizer" in one.args and "--optimizer-offload-fraction 1" in one.args
    zero0 = megatron_launch(config(dp=8, offload_optimizer_fraction=1.0))
    assert "--optimizer-cpu-offload" not in zero0.args and any("--zero 1" in n for n in zero0.notes)
    sgd = megatron_launch(config(dp=8, zero=1, optimizer="sgd", offload_optimizer_fraction=1.0))
    assert "--optimizer-cpu-offload" not in sgd.args and any("Adam-only" in n for n in sgd.notes)
    act = megatron_launch(config(offload_activations=True))
    assert "--cpu-offloading-num-layers 1" in act.args and any("L - 1" in n for n in act.notes)
    pp = megatron_launch(Config(model=GPT, parallel=ParallelSpec(pp=2),
                                training=TrainingSpec(global_batch=2, offload_activations=True)))
    assert not any("cpu-offloading" in a for a in pp.args) and any("pipeline" in n for n in pp.notes)


# --- the command line ----------------------------------------------------------------------------

@pytest.fixture
def run(forked_cli):
    """`run(*ARGS)`: memplan ARGS in a new process (tests/conftest.py forked_cli), as a CompletedProcess."""
    return lambda *args: forked_cli(args, timeout=120)


def test_estimate_verdict_and_json(run):
    args = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "1", "--pp", "1", "--zero", "1",
            "--global-batch", "8", "--gpu", "h100-80gb", "--offload", "optimizer"]
    data = json.loads(run(*args, "--json").stdout)
    per_node = data["host_bytes_per_node"]
    assert per_node == 8 * data["host"]["per_gpu_bytes"] > 0 and "fits_host" not in data
    over = run(*args, "--host-mem", f"{per_node - 1}B")
    assert "does not fit host memory" in over.stdout
    refused = json.loads(run(*args, "--host-mem", f"{per_node - 1}B", "--json").stdout)
    assert refused["fits_host"] is False and refused["fits"] is False
    assert run(*args, "--host-mem", f"{per_node - 1}B", "--require-fit").returncode == 1
    ok = json.loads(run(*args, "--host-mem", f"{per_node}B", "--json").stdout)
    assert ok["fits_host"] is True and ok["host_budget_bytes"] == per_node


def test_search_json_names_host_budget(run):
    out = run("search", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--offload", "optimizer",
              "--host-mem", "1TB", "--top", "2", "--json")
    data = json.loads(out.stdout)
    assert data["host_budget_bytes"] == 10**12 and data["offload"] == {"optimizer_fraction": 1.0, "activations": False}
    assert all(0 < p["memory"]["host_bytes_per_node"] <= 10**12 for p in data["plans"])


BAD = [
    (["estimate", "--model", "gpt-22b", "--offload", "foo"], "foo"),
    (["estimate", "--model", "gpt-22b", "--offload", "optimizer", "--offload-fraction", "2"], "--offload-fraction"),
    (["estimate", "--model", "gpt-22b", "--offload-fraction", "0.5"], "needs --offload optimizer"),
    (["estimate", "--model", "gpt-22b", "--offload", "activations", "--recompute", "full"], "without recompute"),
    (["search", "--model", "gpt-22b", "--gpus", "8", "--offload", "activations", "--recompute", "selective"],
     "without recompute"),
    (["estimate", "--model", "gpt-22b", "--offload", "optimizer", "--optimizer", "muon"], "adamw and sgd"),
    (["estimate", "--model", "gpt-22b", "--offload", "optimizer", "--host-mem", "0GB"], "must be positive"),
    (["estimate", "--model", "gpt-22b", "--offload", "optimizer", "--host-mem", "2TB", "--gpu", "NO-HOST"],
     "has no host_bandwidth"),
]


@pytest.mark.parametrize("args,fragment", BAD, ids=[" ".join(a[3:]) for a, _ in BAD])
def test_bad_input_one_line_exit_2(args, fragment, tmp_path, run):
    if "NO-HOST" in args:  # a GPU file without host_bandwidth: offload cannot be timed
        src = Path(__file__).parent.parent / "configs" / "gpus" / "a100-80gb.yaml"
        gpu = tmp_path / "gpu.yaml"
        gpu.write_text("".join(line for line in src.read_text().splitlines(keepends=True)
                               if not line.startswith("host_bandwidth")))
        args = [str(gpu) if a == "NO-HOST" else a for a in args]
    p = run(*args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("memplan: error:") and fragment in lines[0], lines


def test_search_says_when_only_host_memory_is_missing(run):
    """Optimizer offload puts 18 B per parameter of the whole model on a node of 8 GPUs whatever the plan (144.5 GB
    for llama3-8b): within 100 GB of host memory no plan fits, and the fastest miss says it is the host's."""
    out = run("search", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--global-batch", "8",
              "--offload", "optimizer", "--host-mem", "100GB")
    text = " ".join(out.stdout.split())
    assert "0 fit" in text and "144.54 GB of host memory per node, over the 100.00 GB of --host-mem by 44.54 GB" in text


def test_megatron_layer_offloading_is_activation_offload(run_cli):
    # Megatron-LM --cpu-offloading-num-layers L - 1 (Transformer Engine keeps L - N = 1 layer on the GPU) is memplan's
    # activation offload; llama3-8b has L = 32
    def peak(*extra):
        code, out, err = run_cli("estimate", "--model", "llama3-8b", "--tp", "8", "--json", *extra)
        assert code == 0, err
        return json.loads(out)["memory"]["peak_bytes"]

    offloaded = peak("--offload", "activations")
    assert peak("--cpu-offloading-num-layers", "31") == offloaded < peak()
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--tp", "8", "--cpu-offloading-num-layers", "31",
                             "--emit", "megatron", "--emit-only")
    assert code == 0 and "--cpu-offloading-num-layers 31" in out, err
    for extra, fragment in [(("--cpu-offloading-num-layers", "20"), "modelled for N = L - 1 = 31"),
                            (("--cpu-offloading-num-layers", "31", "--pp", "2"), "without pipeline parallelism"),
                            (("--fine-grained-activation-offloading", "--offload-modules", "core_attn"),
                             "fine-grained activation offloading"),
                            (("--cpu-offloading-num-layers", "31", "--impl", "hf-sdpa", "--tp", "1"),
                             "--cpu-offloading-num-layers is Megatron-LM's")]:
        code, _, err = run_cli("estimate", "--model", "llama3-8b", "--tp", "8", *extra)
        assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
