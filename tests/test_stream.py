"""The allocation stream (memplan/memory/stream.py): at every event of the step timeline's walk of the last
step, the stream's live bytes equal the timeline's; its maximum over the whole run is estimate's allocated
step peak; it is well formed; a 1-layer model's stream derived by hand; the history option."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.api.estimating import estimate as api_estimate
from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec
from memplan.inventory.assemble import training_inventory
from memplan.memory.alloc_conf import parse_alloc_conf
from memplan.memory.allocator import replay, replay_ops
from memplan.memory.reserved import Replay, allocation_stream, replay_run
from memplan.memory.pipeline import microbatches_in_flight, schedule
from memplan.memory.stream import Alloc, Free, not_streamed, stream_for
from memplan.memory.stream_events import KINDS, Stamp
from memplan.memory.term_bytes import PlanValues
from memplan.plan.estimate import estimate, step_peaks
from memplan.presets.batch import make_config
from memplan.presets.catalog import load_model

GPT = dict(num_layers=4, hidden_size=1024, num_attention_heads=8, seq_length=512)
L4 = dict(num_layers=4)
HF_LLAMA = dict(num_layers=3, seq_length=1024)

# (preset, impl, parallel, training, model overrides, stages to check)
CASES = [
    *[("llama3-8b", impl, dict(tp=2, pp=1, dp=2, sp=True, zero=1),
       dict(micro_batch=1, global_batch=4, recompute=rec), L4, (0,))
      for impl in ("megatron", "megatron-local") for rec in ("none", "selective", "full")],
    ("llama3-8b", "megatron", dict(tp=2, pp=4, dp=1, sp=True), dict(micro_batch=1, global_batch=8), dict(num_layers=8),
     (0, 1, 3)),
    ("llama3-8b", "megatron", dict(tp=2, pp=4, dp=1, sp=True), dict(micro_batch=1, global_batch=2, optimizer="sgd"),
     dict(num_layers=8), (0, 3)),  # fewer micro-batches than stages
    ("gpt3-175b", "megatron", dict(tp=4, pp=2, dp=1, sp=True),
     dict(micro_batch=1, global_batch=4, recompute="full", recompute_num_layers=2), dict(GPT, num_layers=8), (0, 1)),
    ("gpt3-175b", "torch", dict(tp=1, pp=1, dp=1), dict(micro_batch=1, global_batch=1), GPT, (0,)),
    ("gpt3-175b", "torch", dict(tp=2, pp=2, dp=1), dict(micro_batch=1, global_batch=3, recompute="selective",
                                                     optimizer_impl="fused"), GPT, (0, 1)),
    ("gpt3-175b", "torch", dict(tp=1, pp=1, dp=2, zero=2), dict(micro_batch=2, global_batch=8), GPT, (0,)),
    *[("llama3-8b", impl, dict(tp=1, pp=1, dp=d, zero=z), dict(micro_batch=1, global_batch=M * d, recompute=rec,
                                                             optimizer_impl=opt), HF_LLAMA, (0,))
      for impl in ("hf-sdpa", "hf-eager") for rec in ("none", "full") for M, d, z, opt in
      ((1, 1, 0, "foreach"), (3, 1, 0, "fused"), (2, 2, 1, "foreach"))],
    ("qwen2.5-7b", "hf-sdpa", dict(tp=1, pp=1, dp=1), dict(micro_batch=1, global_batch=1), None, (0,)),
    ("qwen2.5-7b", "hf-sdpa", dict(tp=1, pp=1, dp=1), dict(micro_batch=1, global_batch=2, recompute="full"), None,
     (0,)),
    ("mixtral-8x22b", "hf-sdpa", dict(tp=1, pp=1, dp=1), dict(micro_batch=1, global_batch=1, recompute="full"), None,
     (0,)),
    ("mixtral-8x22b", "megatron", dict(tp=2, pp=2, dp=2, ep=2, sp=True, zero=1),
     dict(micro_batch=1, global_batch=8, recompute="selective"), L4, (0, 1)),
    ("mixtral-8x22b", "megatron-local", dict(tp=1, pp=1, dp=2, ep=2), dict(micro_batch=1, global_batch=2),
     dict(num_layers=2, seq_length=1024), (0,)),
    ("deepseek-v3", "megatron", dict(tp=2, pp=2, dp=4, ep=4, sp=True, zero=1),
     dict(micro_batch=1, global_batch=8, recompute="full"), dict(num_layers=4, moe_first_dense_layers=1), (0, 1)),
    ("deepseek-v3", "megatron", dict(tp=2, pp=2, dp=4, ep=4, sp=True, zero=1), dict(micro_batch=1, global_batch=8),
     dict(num_layers=4, moe_first_dense_layers=1, mtp_layers=1), (1,)),  # MTP modules: one allocation
    ("llama3-8b", "megatron", dict(tp=2, pp=4, dp=1, sp=True, first_stage_layers=1, last_stage_layers=3),
     dict(micro_batch=1, global_batch=8), dict(num_layers=8), (0, 1, 3)),  # uneven stages
    ("llama3-8b", "megatron", dict(tp=2, pp=1, dp=1, sp=True), dict(micro_batch=1, global_batch=2, fp8="delayed",
                                                                  loss_chunks=4), dict(num_layers=2), (0,)),
    ("llama3-8b", "hf-sdpa", dict(tp=1, pp=1, dp=1), dict(micro_batch=1, global_batch=1, loss_chunks=4,
                                                        optimizer="muon"), dict(num_layers=2), (0,)),
    # ZeRO-3: per-tensor shards, the gathered parameters in flight (memplan's one layer, FSDP2's, DeepSpeed's,
    # torchtitan's), the experts' shards over their own group
    *[("llama3-8b", impl, dict(tp=1, pp=1, dp=2, zero=3), dict(micro_batch=1, global_batch=4, dp_stack=stack,
                                                             recompute=rec), HF_LLAMA, (0,))
      for impl, stack, rec in (("hf-sdpa", None, "none"), ("hf-sdpa", "fsdp2", "full"), ("hf-eager", "deepspeed", "none"),
                               ("torchtitan", "torchtitan", "none"), ("torchtitan", "torchtitan", "full"))],
    ("mixtral-8x22b", "megatron", dict(tp=2, pp=2, dp=2, ep=2, sp=True, zero=3),
     dict(micro_batch=1, global_batch=8, recompute="selective"), L4, (0, 1)),
    # LoRA / QLoRA: the frozen base (bf16, or NF4 linears), fp32 adapters with the only gradients and states
    ("llama3-8b", "hf-sdpa", dict(tp=1, pp=1, dp=1), dict(micro_batch=1, global_batch=1, lora_rank=16,
                                                        precision="bf16-true"), HF_LLAMA, (0,)),
    ("llama3-8b", "hf-eager", dict(tp=1, pp=1, dp=1), dict(micro_batch=1, global_batch=2, lora_rank=8, qlora=True,
                                                         lora_targets=("all-linear",), recompute="full"), HF_LLAMA, (0,)),
    ("llama3-8b", "hf-sdpa", dict(tp=1, pp=1, dp=2, zero=3), dict(micro_batch=1, global_batch=2, lora_rank=16,
                                                                dp_stack="fsdp2", optimizer_impl="foreach"), HF_LLAMA, (0,)),
    # context parallelism: the attention's ring (p2p) or all-to-all buffers in the forward and the backward
    ("llama3-8b", "megatron", dict(tp=2, pp=2, dp=1, cp=2, sp=True), dict(micro_batch=1, global_batch=4),
     dict(num_layers=4, seq_length=4096), (0, 1)),
    ("llama3-8b", "megatron", dict(tp=1, pp=1, dp=2, cp=4, cp_comm_type="a2a", zero=1),
     dict(micro_batch=1, global_batch=2, recompute="selective"), dict(num_layers=4, seq_length=4096), (0,)),
    ("llama3-8b", "megatron", dict(tp=1, pp=1, dp=1, cp=2), dict(micro_batch=1, global_batch=2, recompute="full"),
     dict(num_layers=2, seq_length=4096), (0,)),
    # interleaved stages: Megatron-LM's interleaved 1F1B chunk order (M a multiple of p, at least 2p)
    ("llama3-8b", "megatron", dict(tp=2, pp=2, dp=1, vpp=2, sp=True), dict(micro_batch=1, global_batch=4),
     dict(num_layers=8), (0, 1)),
    ("llama3-8b", "megatron", dict(tp=2, pp=4, dp=1, vpp=2, sp=True),
     dict(micro_batch=1, global_batch=8, recompute="full", recompute_num_layers=1), dict(num_layers=16), (0, 1, 3)),
    ("llama3-8b", "megatron", dict(tp=1, pp=2, dp=2, vpp=3, zero=1),
     dict(micro_batch=1, global_batch=12, recompute="selective"), dict(num_layers=6), (0, 1)),
]


def config_of(preset, impl, par, tr, model):
    return make_config(load_model(preset), parallel=par, training=tr, model=model,
                       whole_model_per_rank=impl.startswith("hf-"))


def well_formed(stream):
    alive, seen = {}, set()
    for e in stream.events:
        if type(e) is Alloc:
            assert e.id not in seen, "tensor ids are unique"
            assert isinstance(e.size, int) and e.size > 0 and isinstance(e.bytes, int) and e.bytes >= 0
            assert e.kind in KINDS and e.stream == 0 and e.name
            seen.add(e.id)
            alive[e.id] = e
        else:
            assert type(e) is Free and e.id in alive, "every free matches an earlier allocation"
            del alive[e.id]
    return alive


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_stream_equals_the_timeline(case):
    preset, impl, par, tr, model, stages = case
    config = config_of(preset, impl, par, tr, model)
    inventory = training_inventory(config.model, impl, "cuda", config.training)
    for stage in stages:
        walk = step_peaks(config, inventory, walk=stage)[0]
        stream = allocation_stream(config, impl=impl, stage=stage)
        at = dict(stream.at_marks())
        for i, e in enumerate(walk.events):
            if e.bytes:  # an event off on this stage (the loss on another than the last) has no point
                assert at[i] == e.bytes, (stage, i, e.phase, e.layer, e.moment)
        assert stream.peak_bytes == walk.peak_bytes
        left = well_formed(stream)
        assert {e.kind for e in left.values()} <= {"parameter", "gradient", "optimizer_state"}
    stream = allocation_stream(config, impl=impl)  # the most loaded stage, as estimate picks it
    assert stream.peak_bytes == estimate(config, impl=impl).step.peak_bytes


def test_sizes_are_requested_bytes_and_their_polynomials():
    config = config_of("llama3-8b", "megatron", dict(tp=2, pp=1, dp=1, sp=True), dict(micro_batch=2, global_batch=2),
                       dict(num_layers=2, seq_length=1000))
    stream = allocation_stream(config)
    polys = [e for e in stream.events if type(e) is Alloc and e.poly is not None]
    assert polys
    for e in polys:  # requested bytes, before the 512 B rounding the timeline counts once
        assert e.poly.evaluate(dict(s=1000, b=2)) == e.size
        assert e.bytes == -(-e.size // 512) * 512
    assert any(e.bytes != e.size for e in polys)


def tiny(**training):
    model = ModelSpec(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16,
                      attention="flash", dropout=False, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
                      tied_embeddings=False, bias=False, ffn_hidden_size=16)
    return Config(model=model, parallel=ParallelSpec(),
                  training=TrainingSpec(**{"micro_batch": 1, "global_batch": 1, "precision": "bf16-mixed", **training}))


def test_one_layer_stream_by_hand():
    # Megatron-LM (Transformer Engine spec), CPU (no rounding), h = 8, a = g = 2, f = 16 (SwiGLU), v = 16, s = 4,
    # b = 1, untied, bf16 weights, fp32 main grads, fp32 master + 2 fp32 moments, fused AdamW, one step pair.
    # Model built (bf16, registration order): word embedding v h 2 = 256; layer 1: norm h 2 = 16, QKV 3h x h x 2 =
    # 384, output projection h h 2 = 128, norm 16, MLP input 2f x h x 2 = 512, MLP output h f 2 = 256; final norm
    # 16; output layer v h 2 = 256: 1,840 B of 920 parameters. Then the main-gradient buffer 920 x 4 = 3,680 and
    # the master copy, per tensor x 4 (3,680). Step 1: labels (8sb = 32) and loss mask (4sb = 16) held by the
    # loop, token ids (32); layer 1 saves (2 sbh = 64 unless said) ln1 input, its rstd (2sb = 8),
    # QKV input, Q and K (two storages of 64), V, attention output, log-sum-exp (8sb = 32), ln2 input, rstd (8),
    # fc1 input, gate/up (2f: 256), down-projection input (f: 128); the head's terms at the loss; the backward frees
    # them in reverse with each moment's transients in between; AdamW's exp_avg and exp_avg_sq (920 x 4 each) are
    # made after step 1's backward: persistent 1,840 + 3,680 + 3,680 + 7,360 = 16,560 B from then on.
    stream = allocation_stream(tiny(), device="cpu")
    allocs = [e for e in stream.events if type(e) is Alloc]
    params = [(e.name, e.size) for e in allocs if e.kind == "parameter"]
    assert [n for _, n in params] == [256, 16, 384, 128, 16, 512, 256, 16, 256]
    assert allocs[9].name.startswith("main-gradient buffer") and allocs[9].size == 3680
    assert sum(e.size for e in allocs[10:19]) == 3680 and all(e.name.startswith("master") for e in allocs[10:19])
    step1 = dict(stream.phases)["step 1"]
    first = [(e.name.split(" (")[0], e.size) for e in stream.events[step1:step1 + 16]]
    assert [n for _, n in first] == [32, 16, 32, 64, 8, 64, 64, 64, 64, 64, 32, 64, 8, 64, 256, 128]
    live = stream.live_bytes()
    moments = [i for i, e in enumerate(stream.events) if type(e) is Alloc and e.name.startswith("exp_avg")]
    assert len(moments) == 18 and moments[0] >= dict(stream.phases)["optimizer step 1"]
    # tensor by tensor (torch/optim/adamw.py _init_group: a parameter's exp_avg, then its exp_avg_sq, then the
    # next parameter's; apex / TE FusedAdam alike): the embedding's two (v h = 128 x 4 = 512 B each), then layer
    # 1's norm's (8 x 4)
    states = [(stream.events[i].name, stream.events[i].size) for i in moments]
    assert [n.split(" of ")[0] for n, _ in states[:4]] == ["exp_avg", "exp_avg_sq", "exp_avg", "exp_avg_sq"]
    assert [n for _, n in states[:4]] == [512, 512, 32, 32]
    assert live[dict(stream.phases)["step 2"] - 1] == 16560
    assert stream.peak_bytes == estimate(tiny(), impl="megatron", device="cpu").step.peak_bytes


def test_zero3_shards_and_gathered_layers_by_hand():
    # tiny() (test_one_layer_stream_by_hand's model) over d = 2 with ZeRO-3, memplan's own loop (no stack): each
    # parameter tensor's shard is half its bf16 bytes, [256, 16, 384, 128, 16, 512, 256, 16, 256] / 2; the gathered
    # parameters in flight are one layer's: 16 + 384 + 128 + 16 + 512 + 256 = 1,312 B, all-gathered at the first
    # forward (one unit), then freed and gathered again at the layer's forward and backward of every micro-batch:
    # 2 steps x 2 micro-batches x (forward + backward) = 8 more
    config = tiny(global_batch=4)
    config = config.model_copy(update={"parallel": ParallelSpec(dp=2, zero=3)})
    stream = allocation_stream(config, device="cpu")
    allocs = [e for e in stream.events if type(e) is Alloc]
    assert [e.size for e in allocs if e.kind == "parameter" and "shard" in e.name] == [
        128, 8, 192, 64, 8, 256, 128, 8, 128]
    gathered = [e for e in allocs if e.name.startswith("gathered parameters")]
    assert [e.size for e in gathered] == [1312] * 9
    assert gathered[0].id > dict(stream.phases)["step 1"] and gathered[0].name.endswith("(unit 1)")
    alive = well_formed(stream)
    assert sum(e.bytes for e in alive.values() if e.name.startswith("gathered")) == 1312  # one unit at a time
    assert stream.peak_bytes == estimate(config, impl="megatron", device="cpu").step.peak_bytes


def test_cp_buffers_by_hand():
    # tiny() (s = 4, b = 1, h = q = 8, a = g = 2, bf16 activations, CPU: no rounding) with cp = 2, Transformer
    # Engine's ring attention (p2p); each rank holds s/cp tokens and the buffers (memplan/memory/parallel.py
    # cp_transients, elements per sequence before the cp split): inside the attention forward the received K/V
    # chunks 2 cp s b q g/a / cp = 64 elements = 128 B, the ring steps' partial outputs s b q = 32 = 64 B, their
    # log-sum-exp (fp32) (cp a s b + a s b) / cp = 12 elements = 48 B, freed at the forward's end; in the attention
    # backward the double-buffered K/V and their gradients 4 s b q g/a / cp = 64 = 128 B and the dQ accumulator
    # s b q / cp = 16 = 32 B. One micro-batch, two steps: each twice
    config = tiny().model_copy(update={"parallel": ParallelSpec(cp=2)})
    stream = allocation_stream(config, device="cpu")
    names = {"K/V chunks received": 128, "partial attention outputs": 64, "log-sum-exp of the cp ring": 48,
             "double-buffered K/V": 128, "dQ accumulator": 32}
    found = [(k, e.size) for e in stream.events if type(e) is Alloc for k in names if e.name.startswith(k)]
    assert sorted(found) == sorted(list(names.items()) * 2)
    fwd = [i for i, e in enumerate(stream.events) if type(e) is Alloc and e.name.startswith("K/V chunks")]
    assert all(type(e) is Free for e in stream.events[fwd[0] + 3:fwd[0] + 6])  # gone after the attention forward
    assert stream.peak_bytes == estimate(config, impl="megatron", device="cpu").step.peak_bytes


def test_interleaved_schedule_by_hand():
    # megatron-core 0.16 schedules.py, p = 2, m = 2, M = 4, rank 0: get_schedule_table in groups of p micro-batches
    # (microbatch_group_size_per_vp_stage's default), chunk by chunk: (mb, chunk) (0,0) (1,0) (0,1) (1,1) (2,0) (3,0)
    # (2,1) (3,1); warm-up 2 (p - 1) + (m - 1) p = 4 forwards, then forward / backward pairs, the backward running
    # the table's chunk reversed (get_model_chunk_id), then the cool-down backwards
    F, B = (lambda mb, c: ("F", mb, c)), (lambda mb, c: ("B", mb, c))
    assert schedule(0, 2, 2, 4) == [F(0, 0), F(1, 0), F(0, 1), F(1, 1), F(2, 0), B(0, 1), F(3, 0), B(1, 1),
                                    F(2, 1), B(0, 0), F(3, 1), B(1, 0), B(2, 1), B(3, 1), B(2, 0), B(3, 0)]
    assert schedule(1, 2, 1, 3) == [F(0, 0), B(0, 0), F(1, 0), B(1, 0), F(2, 0), B(2, 0)]  # 1F1B, last stage
    # so at rank 0's backward of (0, 0) the chunk-0 forwards of micro-batches 0..3 = 2p are alive, each holding the
    # embedding's token ids (1F1B: p): the timeline counts 2p and the stream keeps them until each chunk-0 backward
    assert microbatches_in_flight(0, 2, 4, m=2) == 4 and microbatches_in_flight(0, 2, 4) == 2
    config = config_of("llama3-8b", "megatron", dict(tp=2, pp=2, dp=1, vpp=2, sp=True),
                       dict(micro_batch=1, global_batch=4), dict(num_layers=8))
    stream = allocation_stream(config, impl="megatron", stage=0)
    alive, most = set(), 0
    for e in stream.events:
        if type(e) is Alloc and e.name.startswith("token ids"):
            alive.add(e.id)
            assert e.name.endswith("chunk 0)")
        elif type(e) is Free:
            alive.discard(e.id)
        most = max(most, len(alive))
    assert most == 4
    layers = [e for e in stream.events if type(e) is Alloc and e.name.startswith("input of RMSNorm 1")]
    assert len(layers) == 2 * 4 * 2 * 2  # 2 steps x 4 micro-batches x 2 chunks x 2 layers per chunk
    # the steady state's (forward, backward) pairs the schedule above has, one after another: their positions
    pairs = [((2, 0), (0, 1)), ((3, 0), (1, 1)), ((2, 1), (0, 0)), ((3, 1), (1, 0))] * 2  # 2 steps
    assert len(stream.periods) == len(pairs)
    for k, ((start, end), pair) in enumerate(zip(stream.periods, pairs)):
        labels = {(int(mb), int(c)) for e in stream.events[start:end] if type(e) is Alloc
                  for mb, c in re.findall(r"micro-batch (\d+), chunk (\d+)\)$", e.name)}
        assert labels == set(pair)
        assert k % 4 == 3 or stream.periods[k + 1][0] == end


def test_first_step_at_another_length():
    config = config_of("llama3-8b", "hf-sdpa", dict(tp=1, pp=1, dp=1), dict(micro_batch=1, global_batch=1),
                       HF_LLAMA)
    plain = allocation_stream(config, impl="hf-sdpa")
    short = allocation_stream(config, impl="hf-sdpa", first_step_seq_len=256)
    assert short.at_marks() == [(i, b) for i, b in plain.at_marks()]  # step 2 is the same step
    step2 = dict(short.phases)["step 2"]
    sizes = {e.id: e.size for e in short.events if type(e) is Alloc}
    saved = [e for e in short.events[:step2] if type(e) is Alloc and e.kind == "saved_activation"]
    assert saved and all(e.poly.evaluate(dict(s=256, b=1)) == e.size for e in saved)
    assert short.live_bytes()[step2 - 1] == plain.live_bytes()[dict(plain.phases)["step 2"] - 1]
    assert len(sizes) == len({e.id for e in plain.events if type(e) is Alloc})


def test_workspace_and_refusals():
    # cuBLAS keeps one workspace per thread that runs matmuls: recorded on an H100 (torch 2.11; the small Llama runs of
    # `memplan validate --allocator --device cuda`, tests/data/alloc/cuda): two 32 MiB blocks, never freed, the first
    # at the forward's first matmul, the second at the backward's (autograd's device thread), right after the LM
    # head's weight gradient is made and before the gradient of its input
    for config, impl in ((tiny(), "megatron"), (tiny(precision="bf16-true"), "hf-sdpa")):
        events = allocation_stream(config, impl=impl, device="cpu", workspace_bytes=1 << 20).events
        ws = [k for k, e in enumerate(events) if type(e) is Alloc and e.kind == "workspace"]
        assert len(ws) == 2 and all(events[k].size == 1 << 20 and events[k].bytes == 0 for k in ws)
        assert not {events[k].id for k in ws} & {e.id for e in events if type(e) is not Alloc}
    assert events[ws[1] - 1].kind == "gradient" and "head" in events[ws[1] - 1].name
    assert events[ws[1] + 1].name.startswith("gradient of lm_head's input")
    with pytest.raises(MemplanError):
        allocation_stream(tiny(offload_activations=True), device="cpu")


def test_lora_stream_by_hand():
    # tiny() as transformers' Llama with peft LoRA r = 2 on q_proj and v_proj (peft's default), bf16 weights: the base
    # built first (bf16, transformers' separate linears: embedding v h 2 = 256; q h h 2 = 128, k and v (h g/a) h 2 =
    # 128 each, o 128, gate and up f h 2 = 256 each, down 256, two norms h 2 = 16; final norm 16; head 256), then
    # get_peft_model's adapters in module order, fp32: q_proj lora_A r h = 16 and lora_B h r = 16 parameters, v_proj
    # the same (g = a): 64 B each. Only the adapters get a .grad (4 x 64 B) and AdamW's two moments (fp32, per tensor
    # with ZeRO 0: 8 x 64 B); the frozen base none
    config = tiny(lora_rank=2, precision="bf16-true")
    stream = allocation_stream(config, impl="hf-sdpa", device="cpu")
    allocs = [e for e in stream.events if type(e) is Alloc]
    params = [(e.name, e.size) for e in allocs if e.kind == "parameter"]
    assert [n for _, n in params] == [256, 128, 128, 128, 128, 256, 256, 256, 16, 16, 16, 256, 64, 64, 64, 64]
    assert [name for name, _ in params[-4:]] == [f"{t} lora_{x} (layer 1)" for t in ("q_proj", "v_proj") for x in "AB"]
    grads = [(e.name, e.size) for e in allocs if e.kind == "gradient"]
    assert grads and all(n == 64 and ".grad" in name and "lora_" in name for name, n in grads)
    assert len(grads) == 8  # made in each of the two steps' backward, freed by zero_grad
    assert [e.size for e in allocs if e.kind == "optimizer_state"] == [64] * 8
    assert stream.peak_bytes == estimate(config, impl="hf-sdpa", device="cpu").step.peak_bytes
    lora = api_estimate("llama3-8b", impl="hf-sdpa", gpus=1, lora=16, seq_len=1024, precision="bf16-true")
    assert lora.estimate.reserved is not None and not not_streamed(lora.config.training,
                                                                   PlanValues.from_config(lora.config))


@st.composite
def plans(draw):
    """Small random plans (as tests/test_timeline.py draws them; 1F1B without interleaving, ZeRO 0-3)."""
    impl = draw(st.sampled_from(["megatron", "megatron-local", "torch", "hf-eager", "hf-sdpa"]))
    hf = impl.startswith("hf-")
    llama = impl != "torch" and draw(st.booleans())
    a = draw(st.sampled_from([4, 8]))
    h = a * draw(st.sampled_from([16, 32]))
    L = draw(st.sampled_from([2, 4, 6]))
    t = 1 if hf else draw(st.sampled_from([t for t in (1, 2, 4) if not llama or (a // 2) % t == 0]))
    p = 1 if hf else draw(st.sampled_from([d for d in (1, 2) if L % d == 0]))
    arch = dict(norm="rmsnorm", mlp="swiglu", position_embedding="rope", tied_embeddings=False, bias=False,
                num_kv_heads=a // 2, ffn_hidden_size=3 * h) if llama else {}
    attention = "flash" if impl == "hf-sdpa" else ("eager" if impl in ("torch", "hf-eager") else
                                                   draw(st.sampled_from(["eager", "flash"])))
    model = ModelSpec(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=64 * draw(st.integers(1, 8)),
                      vocab_size=draw(st.sampled_from([256, 1000])), attention=attention,
                      dropout=False if hf and attention == "flash" else draw(st.booleans()), **arch)
    recompute = draw(st.sampled_from(["none", "full"] + ([] if hf else ["selective"])))
    # transformers checkpoints every layer or none (hf-* refuses a partial count)
    k = draw(st.integers(1, L // p)) if recompute == "full" and not hf else None
    b, d, M = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2])), draw(st.integers(1, 4))
    training = TrainingSpec(micro_batch=b, global_batch=b * d * M, recompute=recompute, recompute_num_layers=k,
                            precision=draw(st.sampled_from(["bf16-mixed", "bf16-true", "32-true"])),
                            optimizer_impl=draw(st.sampled_from(["foreach", "fused"])))
    par = ParallelSpec(tp=t, pp=p, dp=d, sp=t > 1 and draw(st.booleans()), zero=draw(st.integers(0, 3)) if d > 1 else 0)
    return Config(model=model, parallel=par, training=training), impl, draw(st.sampled_from(["cuda", "cpu"]))


@settings(max_examples=60, deadline=None)
@given(plans())
def test_random_plans_equal_the_timeline(case):
    config, impl, device = case
    inventory = training_inventory(config.model, impl, device, config.training)
    for stage in range(config.parallel.pp):
        walk = step_peaks(config, inventory, walk=stage)[0]
        stream = allocation_stream(config, impl=impl, device=device, stage=stage)
        at = dict(stream.at_marks())
        assert [(i, at.get(i)) for i, e in enumerate(walk.events) if e.bytes] == [
            (i, e.bytes) for i, e in enumerate(walk.events) if e.bytes]
        assert stream.peak_bytes == walk.peak_bytes
        well_formed(stream)


def test_the_runs_history_reaches_the_replay():
    # --first-step-seq-len: step 1 (where fused AdamW creates its states) at 512 tokens, the later steps at 4,096. The
    # verdict's replay is the run of allocation_stream(..., first_step_seq_len=512) through the allocator, and the
    # history moves the reserved peak (the states land among other blocks than in the ordinary loop)
    plan = dict(impl="hf-sdpa", precision="bf16-true", gpus=1, micro_batch=1, recompute="full", optimizer_impl="fused",
                gpu="h100-80gb", frag_margin=0.0, global_batch=2, seq_len=4096)
    ordinary = api_estimate("llama3-8b", **plan).estimate
    warmed = api_estimate("llama3-8b", first_step_seq_len=512, **plan).estimate
    stream = allocation_stream(warmed.config, "hf-sdpa", first_step_seq_len=512,
                               workspace_bytes=warmed.gpu.workspace_bytes)
    direct = replay_run(stream, warmed.reserved.capacity_bytes, Replay(first_step_seq_len=512))
    assert warmed.reserved.result.reserved_peak_bytes == direct.result.reserved_peak_bytes
    assert warmed.reserved.result.reserved_peak_bytes != ordinary.reserved.result.reserved_peak_bytes
    assert warmed.reserved.label == "default; step 1 at s = 512" and ordinary.reserved.first_step_seq_len is None


def test_ops_replay_as_the_events():
    # the compact form the replay takes (stream.ops): allocations numbered in order from 0, so ~id frees; replayed it
    # gives what the checked replay of the events gives, here for an interleaved stage that dies mid-run and fits
    config = config_of("llama3-8b", "megatron", dict(tp=2, pp=2, dp=1, vpp=2, sp=True),
                       dict(micro_batch=1, global_batch=4), dict(num_layers=8))
    stream = allocation_stream(config, impl="megatron", stage=0)
    allocs = [e.id for e in stream.events if type(e) is Alloc]
    assert allocs == list(range(len(allocs)))
    events = [("alloc", e.id, e.size, 0) if type(e) is Alloc else ("free", e.id, 0, 0) for e in stream.events]
    results = []
    for capacity in (stream.peak_bytes, 4 * stream.peak_bytes):
        for conf in ("", "expandable_segments:True"):
            results.append(replay_ops(stream.ops(), capacity, parse_alloc_conf(conf)))
            assert results[-1] == replay(events, capacity, parse_alloc_conf(conf))
    assert not results[0].fits and results[-1].fits


def _both(config, impl, device="cuda", stage=0, first_step_seq_len=None):
    """The stage's stream made with its layers' templates (memplan/memory/stream_events.py) and afresh."""
    inventory = training_inventory(config.model, impl, device, config.training)
    plan = PlanValues.from_config(config)
    return [stream_for(config.model, inventory, config.training, plan, stage, steps=2, repeat=repeat,
                       first_step_seq_len=first_step_seq_len) for repeat in (True, False)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_copied_layers_are_the_layers_made_afresh(case):
    # the repeated layers are copies of a template: the same events (ids, sizes, kinds, names, polynomials), marks and
    # phases as made layer by layer (grads created in a first micro-batch, ZeRO-3, LoRA, MoE, MTP, cp, interleaving;
    # on a later stage step 1 at another length)
    preset, impl, par, tr, model, stages = case
    config = config_of(preset, impl, par, tr, model)
    for stage in stages:
        copied, afresh = _both(config, impl, stage=stage, first_step_seq_len=256 if stage else None)
        assert (copied.events, copied.marks, copied.phases) == (afresh.events, afresh.marks, afresh.phases)
        _same_ops(copied, afresh)


@settings(max_examples=25, deadline=None)
@given(plans())
def test_random_plans_copy_layers_exactly(case):
    config, impl, device = case
    for stage in range(config.parallel.pp):
        copied, afresh = _both(config, impl, device, stage)
        assert (copied.events, copied.marks, copied.phases) == (afresh.events, afresh.marks, afresh.phases)
        _same_ops(copied, afresh)


def _same_ops(copied, afresh):
    """The copies' compact form (a `Stamp`'s ops, made when stamped) is the one of the events they stand for."""
    expected = [e.size if type(e) is Alloc else ~e.id for e in afresh.events]
    assert not any(type(e) is Stamp for e in afresh.raw)
    assert copied.ops() == afresh.ops() == expected
    assert len(copied) == len(copied.raw) == len(afresh.events)


def test_copies_stand_as_stamps():
    # a 4-layer stage: its layers after the first of each shape are a template's copies, kept as `Stamp`s (one in each
    # of the copy's positions) until the events are asked for; a copy's ops free the tensors of the layer it copies
    config = config_of("llama3-8b", "megatron", dict(tp=2, pp=1, dp=1, sp=True), dict(micro_batch=1, global_batch=2),
                       L4)
    copied, afresh = _both(config, "megatron")
    stamps = {id(e): e for e in copied.raw if type(e) is Stamp}
    assert stamps and sum(len(e.template) for e in stamps.values()) == sum(type(e) is Stamp for e in copied.raw)
    for stamp in stamps.values():
        assert stamp.ops == [e.size if type(e) is Alloc else ~e.id for e in stamp.events()]
    _same_ops(copied, afresh)
