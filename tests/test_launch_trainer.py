"""The HF Trainer stacks (--fsdp2, --deepspeed-zero N; memplan/memory/dp_stack.py) and their configs (--emit accelerate /
deepspeed; memplan/launch/trainer.py), loaded with accelerate's and DeepSpeed's own parsers.

The stacks' extra bytes are derived from their code (dp_stack.py says where), not measured; the expected values here
are hand derivations for Llama 3 8B (h = 4096, a = 32, g = 8, f = 14336, v = 128256, untied, RMSNorm):
one decoder layer holds q 4096^2 + k, v 2 x 4096 x 1024 + o 4096^2 + gate, up, down 3 x 4096 x 14336 + two norms
2 x 4096 = 218,112,000 parameters; FSDP2's tail unit the output layer 128256 x 4096 + final norm 4096 = 525,340,672.

The FSDP2 moments are measured with accelerate's own wrapping on CPU (validation/fsdp2.py) against a hand count of the
tiny Llama there (h 64, f 160, 4 heads of 16, 2 K/V heads, v 512): a layer q, o 2 x 64^2 + k, v 2 x 64 x 32 +
gate, up, down 3 x 64 x 160 + two norms 2 x 64 = 43,136 parameters = 86,272 B in bf16; the tail v h + h = 32,832 =
65,664 B (tied or not: tied, the tail unit holds the shared embedding once)."""

from __future__ import annotations

import gc
import importlib
import json

import pytest
import yaml

import memplan as api

LAYER, TAIL, H, F = 218_112_000, 525_340_672, 4096, 14336
PLAN = dict(impl="hf-sdpa", gpus=8, seq_len=1024, micro_batch=1, global_batch=16)


def _weights(**options) -> int:
    return int(api.estimate("llama3-8b", **PLAN, **options).estimate.stages[0].weights)


def test_stack_bytes_over_plain_zero():
    # FSDP2 keeps the larger of 3 layers (computing, prefetched, unsharded gradients) = 654,336,000 and the tail
    # (output layer + final norm, TAIL) with one layer = 743,452,672, where plain ZeRO 3 counts one layer:
    # TAIL x 2 B (bf16)
    assert _weights(fsdp2=True) - _weights(zero=3) == TAIL * 2 == 1_050_681_344
    # DeepSpeed ZeRO 2: one IPG bucket of h^2 bf16 elements (overlap_comm off below stage 3)
    assert _weights(deepspeed_zero=2) - _weights(zero=2) == H * H * 2 == 33_554_432
    # ZeRO 3: the largest submodule (h f) + the prefetch bucket int(0.9 h^2) instead of a layer, two IPG buckets
    gathered = H * F + int(0.9 * H * H)
    assert _weights(deepspeed_zero=3) - _weights(zero=3) == (gathered - LAYER) * 2 + 2 * H * H * 2 == -221_475_636


def test_stack_bytes_with_lora():
    # LoRA's states count no gathered copy under ZeRO 3 (memplan/memory/adapters.py); FSDP2's unsharded base is the
    # larger of 3 LAYER and LAYER + TAIL = 743,452,672 parameters, in bf16
    assert _weights(fsdp2=True, lora=8) - _weights(zero=3, lora=8) == (LAYER + TAIL) * 2


def _emit(run_cli, kind: str, *args: str) -> str:
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--impl", "hf-sdpa", "--gpus", "8", "--seq-len", "1024",
                             "--micro-batch", "2", "--global-batch", "64", "--emit", kind, "--emit-only", *args)
    assert code in (0, None), err
    return out


def test_deepspeed_json_loads_in_deepspeed(run_cli):
    doc = json.loads(_emit(run_cli, "deepspeed", "--deepspeed-zero", "3", "--offload", "optimizer"))
    doc2 = json.loads(_emit(run_cli, "deepspeed", "--deepspeed-zero", "2"))
    config = pytest.importorskip("deepspeed.runtime.config")  # after the CLI runs: its import prints to stdout
    ds = config.DeepSpeedConfig(doc)  # world size 1 outside torch.distributed: the batch is micro x accumulation
    zero = ds.zero_config
    assert (ds.zero_optimization_stage, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (3, 2, 4)
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == \
        (H * H, int(0.9 * H * H), 10 * H)
    assert zero.overlap_comm and zero.contiguous_gradients and zero.offload_optimizer.device == "cpu"
    assert ds.bfloat16_config.enabled
    stage2 = config.DeepSpeedConfig(doc2)
    assert stage2.zero_optimization_stage == 2 and not stage2.zero_config.overlap_comm


def test_accelerate_yaml_loads_in_accelerate(run_cli, tmp_path):
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    from accelerate.utils import FullyShardedDataParallelPlugin

    path = tmp_path / "fsdp2.yaml"
    path.write_text(_emit(run_cli, "accelerate", "--fsdp2", "--recompute", "full"))
    cluster = config_args.ClusterConfig.from_yaml_file(str(path))
    assert (cluster.distributed_type, cluster.num_processes, cluster.mixed_precision) == ("FSDP", 8, "bf16")
    fsdp = cluster.fsdp_config
    # accelerate's launcher hands fsdp_<name> to FullyShardedDataParallelPlugin as <name> (fsdp_offload_params as
    # cpu_offload); the plugin checks the FSDP2 combination
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp["fsdp_version"], auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"].lower(),
        reshard_after_forward=fsdp["fsdp_reshard_after_forward"], cpu_offload=fsdp["fsdp_offload_params"],
        state_dict_type=fsdp["fsdp_state_dict_type"], cpu_ram_efficient_loading=fsdp["fsdp_cpu_ram_efficient_loading"],
        activation_checkpointing=fsdp["fsdp_activation_checkpointing"])
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True and plugin.activation_checkpointing
    path.write_text(_emit(run_cli, "accelerate", "--deepspeed-zero", "3"))
    cluster = config_args.ClusterConfig.from_yaml_file(str(path))
    assert cluster.distributed_type == "DEEPSPEED"
    assert cluster.deepspeed_config == dict(zero_stage=3, gradient_accumulation_steps=4, offload_optimizer_device="none",
                                            offload_param_device="none", zero3_init_flag=True)


def test_json_report_carries_the_document():
    launch = api.estimate("llama3-8b", **PLAN, deepspeed_zero=1, emit="deepspeed").to_dict()["launch"]
    assert launch["deepspeed"]["zero_optimization"]["stage"] == 1
    assert any("derived" in n for n in api.estimate("llama3-8b", **PLAN, deepspeed_zero=1).notes)
    assert yaml.safe_load("\n".join(api.estimate("llama3-8b", **PLAN, fsdp2=True, emit="accelerate").launch.args)
                          )["fsdp_config"]["fsdp_version"] == 2


@pytest.mark.parametrize("args, message", [
    (["--fsdp2"], "--fsdp2 runs the HF Trainer's transformers model: plan it with --impl hf-sdpa"),
    (["--impl", "hf-sdpa", "--fsdp2", "--deepspeed-zero", "2"], "two data-parallel stacks"),
    (["--impl", "hf-sdpa", "--deepspeed-zero", "2", "--zero", "3"], "ZeRO stage 2; it conflicts with --zero 3"),
    (["--impl", "hf-sdpa", "--fsdp2", "--emit", "deepspeed"], "--emit deepspeed writes a DeepSpeed config"),
    (["--impl", "hf-sdpa", "--emit", "accelerate"], "give --fsdp2 or --deepspeed-zero N"),
    (["--emit", "accelerate"], "--emit accelerate configures the HF Trainer"),
    (["--impl", "hf-sdpa", "--deepspeed-zero", "3", "--zero-shard", "4", "--emit", "deepspeed"], "drop --zero-shard"),
    (["--impl", "hf-sdpa", "--deepspeed-zero", "2", "--precision", "bf16-true", "--emit", "deepspeed"],
     "plan it with --precision bf16-mixed"),
])
def test_bad_stack_input(run_cli, args, message):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--gpus", "8", *args)
    assert code == 2 and out == "", err
    assert message in err and len(err.strip().splitlines()) == 1 and err.startswith("memplan: error:")


@pytest.fixture()
def one_rank(tmp_path):
    """A gloo process group of one rank in this process (FSDP2 all-gathers and frees as with more), torn down after."""
    dist = pytest.importorskip("torch.distributed")
    pytest.importorskip("accelerate")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    # before the group exists, so its functions' default group is not pinned past the test (validation/ranks.py)
    importlib.import_module("torch.distributed.nn")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # the FSDP2 model's cycles hold the group
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp2_unsharded_moments_measured(one_rank, tied):
    from validation.fsdp2 import unsharded_moments

    # one layer while it computes (no prefetch on CPU), the tail from its forward to its backward, nothing after;
    # tied, the tail (with the shared embedding) is gathered from the first forward: 86,272 + 65,664 B in the layers
    layer = 86_272 + 65_664 * tied
    assert unsharded_moments(tied) == {"layer forward": layer, "after forward": 65_664, "layer backward": layer,
                                       "after backward": 0}

