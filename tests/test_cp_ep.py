"""Context parallelism (cp) and expert parallelism (ep, etp), issue 11 items 3 and 4 (memplan/memory/parallel.py).

The expected values are derived by hand in the comments from the rules memplan/memory/parallel.py derives from
Megatron-LM's and Transformer Engine's code (nothing here is measured: there is no GPU run of either)."""

import pytest

from memplan.core.model import ModelSpec
from memplan.core.spec_base import build
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec
from memplan.inventory.assemble import inventory_for
from memplan.launch.megatron import megatron_args
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues, TermBytes
from memplan.memory.timeline import step_events
from memplan.plan.estimate import estimate
from memplan.plan.search import search
from memplan.plan.space import Fixed, plan_space
from memplan.presets.catalog import load_gpu, load_model
from memplan.timing.step import step_time

# A small Llama-like dense model: h = q = 64, a = 4 heads of 16, g = 2 key/value heads, s = 1024, flash attention.
DENSE = dict(name="tiny", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=160,
             seq_length=1024, vocab_size=256, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
             tied_embeddings=False, dropout=False, bias=False, attention="flash")
# A small MoE model: E = 8 routed experts of f_e = 32, top-2, MHA (g = a = 4), s = 128.
MOE = dict(DENSE, name="tiny-moe", num_kv_heads=4, seq_length=128, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32)


def config(model: dict, **parallel) -> Config:
    return build(Config, {"model": ModelSpec(**model), "parallel": parallel, "training": {"micro_batch": 1}})


def plan_of(cfg: Config):
    return PlanValues.from_config(cfg)


# --- context parallelism: activations -------------------------------------------------------------------------

def test_saved_terms_hold_the_rank_s_over_cp_tokens():
    # the QKV projection's input: s b h x 2 B on one GPU without cp; with cp = 4 the rank holds s/4 tokens:
    # 1024 x 1 x 64 x 2 / 4 = 32,768 B (t = 1)
    cfg = config(DENSE, cp=4)
    inv = inventory_for(cfg.model, "megatron", "cuda")
    mem = stage_memory(cfg.model, inv.terms, cfg.training, plan_of(cfg), 0)
    assert mem.unit_bytes["qkv_input"] == 32_768
    # the fp32 logits of the last stage: s b v x 4 / cp = 1024 x 256 x 4 / 4 = 262,144 B
    assert mem.unit_bytes["logits_fp32"] == 262_144


def _event(steps, name):
    return [e for e in steps.events if e.moment == name]


def test_ring_attention_forward_buffers_in_the_timeline():
    # cp = 4, t = 1, p = 1 (the last stage holds the batch's labels and loss mask):
    #   K/V chunks of the ring, cp of them: cp x 2 (s/cp) b q g/a x 2 B = 2 x 1024 x 64 x 2/4 x 2   = 131,072
    #   partial outputs of the cp steps:    cp x (s/cp) b q x 2 B        = 1024 x 64 x 2             = 131,072
    #   log-sum-exps, cp steps + the running one, fp32: (cp + 1) a (s/cp) b x 4 = 5 x 4 x 256 x 4   =  20,480
    #   held by the loop: labels 8 s b / cp + loss mask 4 s b / cp = 8 x 256 + 4 x 256              =   3,072
    cfg = config(DENSE, cp=4)
    inv = inventory_for(cfg.model, "megatron", "cuda")
    plan = plan_of(cfg)
    mem = stage_memory(cfg.model, inv.terms, cfg.training, plan, 0)
    steps = step_events(cfg.model, inv, cfg.training, plan, mem, 0)
    fwd = _event(steps, "attention forward: context-parallel p2p buffers")
    assert len(fwd) == cfg.model.num_layers
    assert all(e.parts["transient"] == 131_072 + 131_072 + 20_480 + 3_072 for e in fwd)
    # without cp there is no such moment
    plain = config(DENSE)
    mem1 = stage_memory(plain.model, inv.terms, plain.training, plan_of(plain), 0)
    assert not _event(step_events(plain.model, inv, plain.training, plan_of(plain), mem1, 0),
                      "attention forward: context-parallel p2p buffers")


def test_ring_attention_backward_buffers():
    # the attention backward adds the double-buffered K/V and their gradients, 4 (s/cp) b q g/a x 2 B
    # = 4 x 256 x 32 x 2 = 65,536, and the dQ accumulator (s/cp) b q x 2 B = 256 x 64 x 2 = 32,768: 98,304 B
    cfg = config(DENSE, cp=4)
    inv = inventory_for(cfg.model, "megatron", "cuda")
    plan = plan_of(cfg)
    mem = stage_memory(cfg.model, inv.terms, cfg.training, plan, 0)
    steps = step_events(cfg.model, inv, cfg.training, plan, mem, 0)
    moment = next(m for m in inv.moments if m.id == "attention_backward")
    sizes = TermBytes(cfg.model, plan, cfg.training.activation_bytes, inv.granularity)
    own = sum(sizes(t) for t in moment.transients if not t.only_full) + 3_072  # + labels and loss mask (above)
    events = _event(steps, moment.name)
    assert events and all(e.parts["transient"] == own + 98_304 for e in events)


def test_a2a_buffers():
    # Ulysses (a2a), cp = 2: forward Q, K, V after the all-to-all (s/cp) b (q + 2 q g/a) x 2 B = 512 x 128 x 2
    # = 131,072 and the output before its all-to-all back 512 x 64 x 2 = 65,536; + 8 x 512 + 4 x 512 = 6,144 held
    cfg = config(DENSE, cp=2, cp_comm_type="a2a")
    inv = inventory_for(cfg.model, "megatron", "cuda")
    plan = plan_of(cfg)
    mem = stage_memory(cfg.model, inv.terms, cfg.training, plan, 0)
    steps = step_events(cfg.model, inv, cfg.training, plan, mem, 0)
    fwd = _event(steps, "attention forward: context-parallel a2a buffers")
    assert fwd and all(e.parts["transient"] == 131_072 + 65_536 + 6_144 for e in fwd)


# --- context parallelism: states and step time -----------------------------------------------------------------

def test_distributed_optimizer_shards_over_d_times_cp():
    # ZeRO 1 with d = 2, cp = 2: the master weights and moments (12 B per parameter, bf16-mixed) over d x cp = 4
    # ranks; the same plan without cp (d = 2) over 2. Parameters of one GPU (t = 1, p = 1): per layer QKV 64 x 128
    # = 8,192, projection 4,096, MLP 3 x 64 x 160 = 30,720, norms 128 -> 43,136; x 2 layers + embedding 16,384 +
    # head 16,384 + final norm 64 = 119,104.
    for cp, shard in ((1, 2), (2, 4)):
        cfg = config(DENSE, dp=2, cp=cp, zero=1)
        mem = stage_memory(cfg.model, (), cfg.training, plan_of(cfg), 0)
        assert mem.params == 119_104
        assert mem.optimizer == 119_104 * 12 // shard


def test_cp_splits_the_compute_of_each_sequence():
    # two GPUs, global batch 8: d = 2 (4 sequences each) or cp = 2 (each GPU half of all 8): the same compute
    gpu = load_gpu("h100-80gb")
    times = []
    for par in (dict(dp=2), dict(cp=2)):
        cfg = build(Config, {"model": ModelSpec(**DENSE), "parallel": par,
                             "training": {"micro_batch": 1, "global_batch": 8}})
        times.append(step_time(cfg.model, cfg.training, gpu, plan_of(cfg), 8))
    assert times[0].compute_s == pytest.approx(times[1].compute_s, rel=1e-12)
    assert times[1].cp_ep_comm_exposed_s > 0  # the ring's K/V sends are not all hidden at s = 1024
    for t in times:  # the step is the sum of its exposed parts (StepTime), the K/V exchange included
        parts = (t.compute_s + t.memory_s + t.tp_comm_exposed_s + t.recompute_s + t.bubble_s + t.pp_comm_s
                 + t.dp_comm_exposed_s + t.zero3_gather_exposed_s + t.optimizer_s + t.host_copy_s
                 + t.cp_ep_comm_exposed_s)
        assert t.step_time_s == pytest.approx(parts, rel=1e-6)  # float32 sums


# --- expert parallelism -----------------------------------------------------------------------------------------

def test_experts_split_over_ep_and_sharded_over_the_expert_data_parallel_group():
    # Parameters: per layer QKV 3 x 64 x 64 = 12,288, projection 4,096, router 8 x 64 = 512, norms 128 -> 17,024
    # outside the experts; x 2 layers + embedding 16,384 + head 16,384 + final norm 64 = 66,880. Routed experts
    # 2 layers x 8 x 3 x 64 x 32 = 98,304, of which a GPU holds 1/(ep etp).
    # ep = 4, etp = 1, t = 1, d = 4, ZeRO 1: edp = t cp d / (etp ep) = 1, so the experts' optimizer states are not
    # sharded, the others' over d = 4: 66,880 x 12 / 4 + 24,576 x 12 = 200,640 + 294,912 = 495,552 B;
    # weights (66,880 + 24,576) x 2 = 182,912 B; gradients x 4 = 365,824 B.
    cfg = config(MOE, dp=4, ep=4, zero=1)
    assert cfg.parallel.edp == 1
    mem = stage_memory(cfg.model, (), cfg.training, plan_of(cfg), 0)
    assert (mem.params, mem.expert_params) == (66_880 + 24_576, 24_576)
    assert (mem.weights, mem.gradients, mem.optimizer) == (182_912, 365_824, 495_552)
    # ep = 1: every GPU holds all experts and edp = d = 4: (66,880 + 98,304) x 12 / 4 = 495,552 too
    one = config(MOE, dp=4, zero=1)
    assert stage_memory(one.model, (), one.training, plan_of(one), 0).optimizer == 495_552
    # ep = 2, etp = 2 over t = 2, d = 2 (SP on): experts 98,304 / 4 = 24,576 per GPU, edp = 2 x 2 / 4 = 1; the
    # rest split by t: QKV, projection, embedding, head / 2 -> 2 x (8,192 + 512 + 128) + 8,192 + 8,192 + 64 = 34,112;
    # optimizer 34,112 x 12 / 2 + 24,576 x 12 = 204,672 + 294,912 = 499,584 B
    two = config(MOE, tp=2, sp=True, dp=2, ep=2, etp=2, zero=1)
    mem2 = stage_memory(two.model, (), two.training, plan_of(two), 0)
    assert (mem2.params, mem2.optimizer) == (34_112 + 24_576, 499_584)


def test_expert_token_terms_scale_as_derived():
    # the dispatcher's gathered tokens k s b h etp / t (etp_gathered): k = 2, s = 128, h = 64, t = 2, etp = 2:
    # 2 x 128 x 64 x 2 / 2 x 2 B = 32,768; an f_e-wide expert term k s b f_e / t: 2 x 128 x 32 / 2 x 2 B = 8,192
    from memplan.inventory.types import saved

    gathered = saved("x", "gathered tokens", "MLP", "k s b h", tp=True, src="test", etp_gathered=True)
    wide = saved("y", "expert activation", "MLP", "k s b fe", tp=True, src="test")
    cfg = config(MOE, tp=2, sp=True, dp=2, ep=2, etp=2)
    sizes = TermBytes(cfg.model, plan_of(cfg), 2)
    sizes.values["k"] = 2
    assert (sizes(gathered), sizes(wide)) == (32_768, 8_192)


def test_plan_space_has_ep_and_etp_for_moe_models_only():
    # 8 GPUs, L = 2: ep divides E = 8 and ep x etp divides t cp d = 8 / p; etp in {1, t}
    space = plan_space(ModelSpec(**MOE), 8, 8)
    r = space.rows
    combos = {(int(t), int(p), int(d), int(e), int(x)) for t, p, d, e, x in zip(r["t"], r["p"], r["d"], r["ep"],
                                                                             r["etp"])}
    assert (1, 1, 8, 8, 1) in combos and (2, 1, 4, 4, 2) in combos and (2, 1, 4, 4, 1) in combos
    assert all((t * d) % (e * x) == 0 and 8 % e == 0 for t, p, d, e, x in combos)
    assert (2, 2, 2, 4, 2) not in combos  # 4 x 2 does not divide t d = 4
    assert set(r["sp"][r["t"] > 1].tolist()) == {1}  # MoE with t > 1 needs SP
    dense = plan_space(ModelSpec(**DENSE), 8, 8)
    assert set(dense.rows["ep"].tolist()) == {1} and set(dense.rows["cp"].tolist()) == {1}  # s = 1024 < 8192


def test_search_tries_cp_for_long_sequences_and_agrees_with_estimate():
    model = load_model("llama3-8b").model.model_copy(update={"seq_length": 65536})
    gpu = load_gpu("h100-80gb")
    result = search(model, TrainingSpec(), 16, 16, 80 * 10**9, gpu=gpu, top=3, fixed=Fixed(tp=8, pp=1))
    cps = {int(c) for c in result.space.rows["cp"]}
    assert cps == {1, 2}  # t = 8, p = 1: cp x d = 2
    row = next(i for i in range(result.space.count) if int(result.space.take([i]).cp[0]) == 2)
    cfg = result.config(row)
    assert cfg.parallel.cp == 2
    assert result.numbers(row)["device_bytes"] == estimate(cfg, gpu=gpu).flat_total


# --- launch flags and bad input ----------------------------------------------------------------------------------

def test_megatron_flags():
    args = megatron_args(config(DENSE, cp=2, cp_comm_type="a2a"))
    assert "--context-parallel-size 2" in args and "--cp-comm-type a2a" in args
    moe = megatron_args(config(MOE, tp=2, sp=True, dp=4, ep=4, etp=1))
    assert "--expert-model-parallel-size 4" in moe and "--expert-tensor-parallel-size 1" in moe
    assert not any(a.startswith(("--context", "--expert")) for a in megatron_args(config(DENSE)))


BAD = [
    (["--model", "llama3-8b", "--ep", "2"], "needs a mixture-of-experts model"),
    (["--model", "llama3-8b", "--cp", "3"], "2*cp = 6 to divide the sequence length"),
    (["--model", "llama3-8b", "--cp", "2", "--gpus", "6"], "not divisible by t*p*cp"),
    (["--model", "llama3-8b", "--cp", "2", "--attention", "eager"], "needs flash attention"),
    (["--model", "llama3-8b", "--tp", "8", "--cp", "2", "--cp-comm-type", "a2a", "--gpus", "16"],
     "--cp-comm-type a2a needs cp=2 to divide"),
    (["--model", "llama3-8b", "--cp", "2", "--impl", "hf-sdpa"], "modelled for Megatron-LM"),
]


@pytest.mark.parametrize("args,fragment", BAD, ids=[" ".join(a[2:]) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(args, fragment, forked_cli):
    p = forked_cli(["estimate", *args], timeout=120)  # a new process (tests/conftest.py)
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and fragment in p.stderr, p.stderr


def test_moe_spec_errors():
    with pytest.raises(Exception, match="does not divide the experts E=8"):
        config(MOE, dp=3, ep=3)
    with pytest.raises(Exception, match="ep\\*etp = 4\\*1 does not divide t\\*cp\\*d"):
        ParallelSpec(dp=2, ep=4, etp=1)
    with pytest.raises(Exception, match="needs sequence parallelism"):
        config(MOE, tp=2, dp=2)


def test_optimizer_offload_host_bytes_follow_the_d_times_cp_shard():
    # ZeRO 1 with optimizer offload: a GPU's offloaded states are its 1/(d cp) shard, so d = 8 and d = 2, cp = 4 (both
    # 8 GPUs) keep the same host memory per GPU: 119,104 parameters / 8 = 14,888 x (4 + 8) B = 178,656 B of states
    from memplan.memory.offload import host_bytes

    out = []
    for par in (dict(dp=8, zero=1), dict(dp=2, cp=4, zero=1)):
        cfg = build(Config, {"model": ModelSpec(**DENSE), "parallel": par,
                             "training": {"micro_batch": 1, "offload_optimizer_fraction": 1.0}})
        inv = inventory_for(cfg.model, "megatron", "cuda")
        mem = stage_memory(cfg.model, inv.terms, cfg.training, plan_of(cfg), 0)
        out.append(host_bytes(cfg.model, inv.terms, cfg.training, plan_of(cfg), mem))
    assert out[0].optimizer == out[1].optimizer == 178_656
    assert out[0].staging == out[1].staging
