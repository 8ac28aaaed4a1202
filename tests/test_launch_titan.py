"""--emit torchtitan (memplan/launch/titan.py): the emitted module is loaded by torchtitan 0.3.0's own ConfigManager
(the code `torchtitan.train --module M --config F` runs) and the Trainer.Config it returns carries the plan; memplan's
table of torchtitan's Llama 3 flavours equals torchtitan's own model configs. Needs torchtitan (the test extra)."""

import sys

import pytest

from memplan.api.estimating import estimate
from memplan.api.searching import search
from memplan.cli import main
from memplan.launch.titan import EXPANDABLE, FLAVORS, FUNCTION, MODULE

pytest.importorskip("torchtitan")

from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC  # noqa: E402
from torchtitan.models.llama3 import llama3_configs  # noqa: E402


def _load(tmp_path, monkeypatch, text):
    """torchtitan's ConfigManager on the emitted module, as `torchtitan.train --module M --config F` parses it."""
    (tmp_path / f"{MODULE}.py").write_text(text + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return ConfigManager().parse_args(["--module", MODULE, "--config", FUNCTION])


@pytest.mark.parametrize("ac,replicate,cls", [("selective-op", None, SelectiveAC.Config), ("full", 2, FullAC.Config),
                                              ("none", None, type(None))])
def test_emitted_config_builds_in_torchtitan(tmp_path, monkeypatch, ac, replicate, cls):
    result = estimate("llama3-8b", impl="torchtitan", gpus=8, ac=ac, dp_replicate=replicate, seq_len=4096,
                      micro_batch=2, global_batch=32, emit="torchtitan")
    launch = result.launch
    assert launch.env == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}
    config = _load(tmp_path, monkeypatch, "\n".join(launch.args))
    par = config.parallelism
    # the plan: 8 GPUs, data-parallel only (HSDP: 2 replicas of 4 shards), local batch 2 of 4,096 tokens, 32 in all
    assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree) == ((replicate or 1), 8 // (replicate or 1))
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree, par.context_parallel_degree) == (1, 1, 1)
    assert (config.training.local_batch_size, config.training.global_batch_size, config.training.seq_len) == (2, 32, 4096)
    assert type(config.activation_checkpoint) is cls
    # eager, bf16 params / fp32 reduce (torchtitan's defaults, what memplan plans), no float8 converter, plain loss
    assert not config.compile.enable
    assert (config.training.mixed_precision_param, config.training.mixed_precision_reduce) == ("bfloat16", "float32")
    assert type(config.loss).__qualname__ == "CrossEntropyLoss.Config"
    assert len(config.model_spec.model.layers) == 32 and config.model_spec.flavor == "8B"


def test_the_whole_block_is_a_python_module(tmp_path, monkeypatch, capsys):
    # --emit-only prints the block alone: saved as is, it loads (the allocator setting is a comment in it)
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--model", "llama3-70b", "--impl", "torchtitan", "--gpus", "64", "--ac", "full",
              "--seq-len", "8192", "--emit", "torchtitan", "--emit-only"])
    out = capsys.readouterr()
    assert exit_.value.code == 0, out.err
    assert "# export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out.out and "note:" in out.err
    config = _load(tmp_path, monkeypatch, out.out)
    assert len(config.model_spec.model.layers) == 80 and config.parallelism.data_parallel_shard_degree == 64
    # the shipped llama3_70b sets TP 8; the plan has none
    assert config.parallelism.tensor_parallel_degree == 1


def test_flavours_equal_torchtitans_configs():
    for (layers, dim, heads, kv, ffn, vocab), (name, _) in FLAVORS.items():
        cfg = llama3_configs[name](attn_backend="flex")
        attn, ff = cfg.layers[0].attention, cfg.layers[0].feed_forward
        assert (len(cfg.layers), cfg.dim, attn.n_heads, attn.n_kv_heads, ff.w1.out_features, cfg.vocab_size) == (
            layers, dim, heads, kv, ffn, vocab)
    for model in ("llama3-8b", "llama3-70b", "llama3.1-405b"):  # memplan's presets are those flavours
        assert estimate(model, impl="torchtitan", gpus=8, global_batch=8, emit="torchtitan").launch.document["flavor"]


@pytest.mark.parametrize("args", [["--impl", "megatron"], ["--impl", "torchtitan", "--model", "llama2-7b"],
                                  ["--impl", "torchtitan", "--ac", "selective-layer:2"]])
def test_refused_in_one_line(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--model", "llama3-8b", "--gpus", "8", "--emit", "torchtitan"] + args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("memplan: error:") and err.count("\n") == 1, err


def test_tp_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # --tp 2 on 8 GPUs: torchtitan's 2-D layout, dp_shard 4 x TP 2, with the DTensor backend memplan measured TP on
    result = estimate("llama3-8b", impl="torchtitan", gpus=8, tp=2, ac="selective-op", seq_len=4096, micro_batch=2,
                      global_batch=16, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    par = config.parallelism
    assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree, par.tensor_parallel_degree) == (1, 4, 2)
    assert par.enable_sequence_parallel and par.spmd_backend == "partial_dtensor"
    assert "--nproc_per_node=8" in result.launch.args[1]
    assert result.launch.document["parallelism.tensor_parallel_degree"] == 2


def test_a_searchs_best_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # search --impl torchtitan --emit torchtitan: the best plan (here compiled: the fastest at this budget) as the
    # module; torchtitan's ConfigManager builds it with the listed plan's settings, compile on the blocks only
    found = search("llama3-8b", impl="torchtitan", gpus=8, seq_len=4096, global_batch=32, gpu="h100-80gb",
                   mem=80 * 10**9, emit="torchtitan", top=3)
    best = found.result.row(found.result.top[0])["torchtitan"]
    config = _load(tmp_path, monkeypatch, "\n".join(found.launch["llama3-8b"].args))
    par = config.parallelism
    assert best["compile"] and config.compile.enable and config.compile.components == ["model"]
    assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree, par.tensor_parallel_degree) == (
        best["dp_replicate"], best["dp_shard"], best["tp"])
    assert config.training.local_batch_size == best["local_batch"] and config.training.global_batch_size == 32
    assert type(config.activation_checkpoint) is {"none": type(None), "full": FullAC.Config,
                                                  "selective-op": SelectiveAC.Config,
                                                  "budget": MemoryBudgetAC.Config}[best["ac"].split(":")[0]]


def test_float8_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # --float8 rowwise: the emitted model_registry(converters=[Float8LinearConverter.Config(...)]) runs torchtitan's own
    # converter while ConfigManager loads the module; its hardware check (SM89+) is the one thing a CPU fails, so it
    # is told the GPU has one. What the converter makes must be memplan's plan: each layer's wqkv, wo, w1, w2, w3
    # torchao Float8Linear with the rowwise recipe, the LM head a plain bf16 Linear (filter_fqns ["lm_head"])
    import torchtitan.components.quantization.float8 as titan_float8
    from torchao.float8.config import ScalingGranularity
    from torchtitan.models.common.linear import Linear

    monkeypatch.setattr(titan_float8, "has_cuda_capability", lambda *_: True)
    result = estimate("llama3-8b", impl="torchtitan", gpus=8, ac="selective-op", float8="rowwise", seq_len=4096,
                      micro_batch=2, global_batch=16, emit="torchtitan")
    model = _load(tmp_path, monkeypatch, "\n".join(result.launch.args)).model_spec.model
    converted = {name for name, cfg, *_ in model.traverse(Linear.Config) if isinstance(cfg, titan_float8.Float8Linear.Config)}
    assert converted == {f"layers.{i}.{m}" for i in range(32) for m in ("attention.qkv_linear.wqkv", "attention.wo",
                                                                       "feed_forward.w1", "feed_forward.w2",
                                                                       "feed_forward.w3")}
    recipe = model.layers[0].feed_forward.w1._torchao_config
    assert recipe.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
    assert not isinstance(model.lm_head, titan_float8.Float8Linear.Config)
    assert "float8 rowwise" in " ".join(result.launch.notes)


def test_float8_tensorwise_is_refused_for_torchtitan_0_3(capsys):
    # torchtitan 0.3.0's converter names rowwise / rowwise_with_gw_hp only: tensorwise (torchtitan <= 0.2's) has no config
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--float8", "tensorwise",
              "--emit", "torchtitan"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "rowwise" in err and err.count("\n") == 1, err


def test_compiled_float8_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # --compile --float8 rowwise: torchtitan compiles the model (not the loss: memplan plans it eager) and the converter
    # is told so (model_compile_enabled)
    import torchtitan.components.quantization.float8 as titan_float8

    monkeypatch.setattr(titan_float8, "has_cuda_capability", lambda *_: True)
    result = estimate("llama3-8b", impl="torchtitan", gpus=8, ac="full", compile=True, float8="rowwise", seq_len=4096,
                      micro_batch=2, global_batch=16, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    assert config.compile.enable and config.compile.components == ["model"]
    assert "model_compile_enabled=True" in "\n".join(result.launch.args)
    assert isinstance(config.model_spec.model.layers[0].feed_forward.w2, titan_float8.Float8Linear.Config)


def test_memory_budget_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # --ac budget:F --compile: torchtitan's MemoryBudgetAC with the budget, the model compiled (its Trainer.Config
    # requires it); the search's budget plans emit the same (search --ac budget:F --emit torchtitan)
    result = estimate("llama3-8b", impl="torchtitan", gpus=8, ac="budget:0.3", compile=True, seq_len=4096,
                      micro_batch=2, global_batch=16, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    assert type(config.activation_checkpoint) is MemoryBudgetAC.Config
    assert config.activation_checkpoint.memory_budget == 0.3 and config.compile.enable
    found = search("llama3-8b", impl="torchtitan", gpus=8, ac="budget:0", seq_len=4096, global_batch=16,
                   mem="80GB", emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(found.launch["llama3-8b"].args))
    assert type(config.activation_checkpoint) is MemoryBudgetAC.Config
    assert config.activation_checkpoint.memory_budget == 0 and config.compile.enable


def test_cp_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # --cp 2 on 8 GPUs: dp_shard 4 x cp 2 (torchtitan folds cp into FSDP's mesh), on the partial_dtensor backend
    # whose apply_cp_to_forward memplan measured (validation/titan_cp.py); torchtitan's ParallelDims accepts it for
    # a world of 8 and shards FSDP over dp_shard x cp
    from torchtitan.distributed.parallel_dims import ParallelDims

    result = estimate("llama3-8b", impl="torchtitan", gpus=8, cp=2, seq_len=8192, micro_batch=1, global_batch=8,
                      emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    par = config.parallelism
    assert (par.data_parallel_shard_degree, par.context_parallel_degree, par.tensor_parallel_degree) == (4, 2, 1)
    assert par.spmd_backend == "partial_dtensor" and "--nproc_per_node=8" in result.launch.args[1]
    dims = ParallelDims.from_config(par, world_size=8)
    assert dims.cp_enabled and dims.dp_shard * dims.cp == 8


def test_pp_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # --pp 2 --pipeline-schedule GPipe on 16 GPUs, global batch 64: dp_shard 8 x pp 2; each data-parallel rank's
    # local batch is 64 / 8 = 8 sequences, the pipeline's 8 micro-batches of 1 (n_microbatches = 8 // 1)
    result = estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, pipeline_schedule="GPipe", seq_len=4096,
                      global_batch=64, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    par = config.parallelism
    assert (par.data_parallel_shard_degree, par.pipeline_parallel_degree) == (8, 2)
    assert (par.pipeline_parallel_schedule, par.pipeline_parallel_microbatch_size) == ("GPipe", 1)
    assert (config.training.local_batch_size, config.training.global_batch_size) == (8, 64)
    assert config.training.disable_cuda_graphs  # torchtitan's _validate_cuda_graphs refuses PP otherwise
    assert "--nproc_per_node=16" in result.launch.args[1]


def test_a_searched_pp_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # search --impl torchtitan --pp 2 --emit torchtitan: the best listed plan's module, loaded by torchtitan's
    # ConfigManager; its ParallelDims takes the degrees for a world of 16 and its pipeline settings are the row's
    from torchtitan.distributed.parallel_dims import ParallelDims

    found = search("llama3-8b", impl="torchtitan", gpus=16, pp=2, seq_len=1024, global_batch=32, mem=60 * 10**9,
                   gpu="h100-80gb", emit="torchtitan")
    dims = found.result.row(found.result.top[0])["torchtitan"]
    config = _load(tmp_path, monkeypatch, "\n".join(found.launch["llama3-8b"].args))
    par = config.parallelism
    assert (par.pipeline_parallel_degree, par.pipeline_parallel_schedule) == (2, dims["pipeline_schedule"])
    assert par.pipeline_parallel_microbatch_size == dims["pipeline_microbatch_size"]
    assert (config.training.local_batch_size, config.training.global_batch_size) == (dims["local_batch"], 32)
    world = ParallelDims.from_config(par, world_size=16)
    assert world.pp_enabled and world.pp == 2 and world.dp_shard * world.tp * world.pp == 16


@pytest.mark.parametrize("schedule,per_stage,stages", [("ZBVZeroBubble", None, 4), ("Interleaved1F1B", 6, 6)])
def test_multistage_pp_plan_builds_in_torchtitan(tmp_path, monkeypatch, schedule, per_stage, stages):
    # a multi-stage plan (2 stages a rank, or --pipeline-layers-per-stage 6: ceil(34 / 6) = 6 virtual stages, 3 a
    # rank at pp 2): torchtitan's own _get_pipeline_metadata on the loaded config makes the plan's virtual stages, and
    # its rank-to-stage mapping places them as memplan does
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import (_get_pipeline_metadata,
                                                          _get_pp_rank_to_stage_indices_mapping)

    from memplan.memory.pipeline_multi import rank_stages

    result = estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, pipeline_schedule=schedule, seq_len=1024,
                      global_batch=64, pipeline_layers_per_stage=per_stage, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    par = config.parallelism
    assert (par.pipeline_parallel_schedule, par.pipeline_parallel_layers_per_stage) == (schedule, per_stage)
    dims = ParallelDims.from_config(par, world_size=16)
    assert _get_pipeline_metadata(dims, par, config.model_spec.model)[:2] == (stages, 32)
    m = result.estimate.config.parallel.vpp
    assert m == stages // 2 and all(
        _get_pp_rank_to_stage_indices_mapping(r, 2, schedule, stages) == rank_stages(r, 2, m, schedule) for r in (0, 1))


def test_async_tp_plan_builds_in_torchtitan(tmp_path, monkeypatch):
    # --async-tp (--compile --tp 2): compile.enable_async_tensor_parallel=True, which torchtitan's CompileConfig takes
    # with the model compiled; without --async-tp the flag stays torchtitan's default, off
    plan = dict(impl="torchtitan", gpus=8, tp=2, ac="full", compile=True, seq_len=4096, micro_batch=2, global_batch=16)
    result = estimate("llama3-8b", async_tp=True, emit="torchtitan", **plan)
    assert result.launch.document["compile.enable_async_tensor_parallel"] is True
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    assert config.compile.enable and config.compile.components == ["model"]
    assert config.compile.enable_async_tensor_parallel is True and config.parallelism.tensor_parallel_degree == 2
    assert "async TP" in " ".join(result.launch.notes)
    plain = estimate("llama3-8b", emit="torchtitan", **plan)
    assert plain.launch.document["compile.enable_async_tensor_parallel"] is False
    assert not _load(tmp_path, monkeypatch, "\n".join(plain.launch.args)).compile.enable_async_tensor_parallel


def test_a_searchs_async_tp_plan_emits_the_flag(tmp_path, monkeypatch):
    # search --async-tp --emit torchtitan: the best row (pinned compiled at tp 2, so async TP on) emitted with the flag
    found = search("llama3-8b", impl="torchtitan", gpus=8, tp=2, compile=True, async_tp=True, ac="full", seq_len=4096,
                   global_batch=16, gpu="h100-80gb", mem=80 * 10**9, emit="torchtitan", top=1)
    best = found.result.row(found.result.top[0])["torchtitan"]
    assert best["async_tp"] and best["tp"] == 2 and best["compile"]
    config = _load(tmp_path, monkeypatch, "\n".join(found.launch["llama3-8b"].args))
    assert config.compile.enable_async_tensor_parallel is True
