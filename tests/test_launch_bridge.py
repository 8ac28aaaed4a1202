"""`--emit bridge`: the plan as Megatron-Bridge recipe overrides, every name a field of Megatron-Bridge 0.6.2's config
dataclasses (tests/data/megatron_bridge_fields.json, read from its wheel and megatron-core's bases), every
Megatron-LM flag memplan emits translated, and the same plan as --emit megatron gives."""

import json
import shlex
from pathlib import Path

import pytest

from memplan.core.model import ModelSpec
from memplan.core.spec_base import build
from memplan.core.specs import Config
from memplan.launch.bridge import OVERRIDES, bridge_launch, launch_for
from memplan.launch.megatron import megatron_launch
from test_cp_ep import MOE
from test_launch import GRID, LLAMA, MEGATRON_FLAGS, config

FIELDS = json.loads((Path(__file__).resolve().parent / "data" / "megatron_bridge_fields.json").read_text())
MODEL = set(FIELDS["model"]) | set(FIELDS["model_mla"])


def known(key):
    """Whether `section.field` names a field of Bridge's ConfigContainer (or is a section itself: mixed_precision)."""
    if "." not in key:
        return key in FIELDS[""]
    section, name = key.split(".", 1)
    return name in (MODEL if section == "model" else set(FIELDS[section]))


def overrides(launch):
    """{key: value} of the launch's overrides, after the shell's quoting."""
    out = {}
    for word in launch.args:
        (text,) = shlex.split(word)
        key, _, value = text.partition("=")
        assert key not in out, f"{key} given twice"
        out[key] = value
    return out


# context and expert parallelism's flags (tests/test_cp_ep.py checks them against Megatron-LM's)
CP_EP = {"--context-parallel-size", "--cp-comm-type", "--expert-model-parallel-size", "--expert-tensor-parallel-size"}
# --recompute-modules takes several values (nargs='*' in Megatron-LM's arguments.py), which test_launch's one-value
# parser does not read; tests/test_validate_mcore_recompute.py checks the module names
MULTI = {"--recompute-modules"}


def test_every_megatron_flag_has_an_override():
    assert set(OVERRIDES) == set(MEGATRON_FLAGS) | CP_EP | MULTI, set(OVERRIDES) ^ (set(MEGATRON_FLAGS) | CP_EP | MULTI)


def test_context_and_expert_parallelism():
    moe = build(Config, {"model": ModelSpec(**MOE), "parallel": dict(tp=2, sp=True, dp=4, ep=4, etp=1, cp=2,
                                                                     cp_comm_type="a2a"),
                         "training": {"micro_batch": 1}})
    bridge = launch_for(moe, "bridge")
    got = overrides(bridge)
    assert not any("no Megatron-Bridge override" in n for n in bridge.notes)
    assert (got["model.context_parallel_size"], got["model.cp_comm_type"], got["model.expert_model_parallel_size"],
            got["model.expert_tensor_parallel_size"]) == ("2", "a2a", "4", "1")


def test_every_override_names_a_bridge_field():
    keys = {key for pairs in OVERRIDES.values() for key, _ in pairs} | {"mixed_precision"}
    assert all(known(k) for k in keys), sorted(k for k in keys if not known(k))
    assert not known("model.no_such_field") and not known("train.tensor_model_parallel_size")  # the check can fail


@pytest.mark.parametrize("cfg", GRID, ids=range(len(GRID)))
def test_each_plan_translates_fully(cfg):
    megatron = megatron_launch(cfg)
    bridge = bridge_launch(cfg, megatron)
    got = overrides(bridge)
    assert all(known(k) for k in got), [k for k in got if not known(k)]
    assert not any("no Megatron-Bridge override" in n for n in bridge.notes)
    assert bridge.env == megatron.env and bridge.as_dict()["bridge"] == bridge.args
    par, tr = cfg.parallel, cfg.training
    assert got["model.tensor_model_parallel_size"] == str(par.tp)
    assert got["model.pipeline_model_parallel_size"] == str(par.pp)
    assert got["train.micro_batch_size"] == str(tr.micro_batch)
    assert got["train.global_batch_size"] == str(cfg.global_batch)
    assert got["model.seq_length"] == got["dataset.seq_length"] == str(cfg.model.seq_length)
    assert got.get("model.virtual_pipeline_model_parallel_size") == (str(par.vpp) if par.vpp > 1 else None)
    assert (got.get("ddp.use_distributed_optimizer") == "true") == (par.zero >= 1 or "--use-distributed-optimizer" in
                                                                    " ".join(megatron.args))
    if cfg.model.is_moe:
        freq = json.loads(got["model.moe_layer_freq"]) if "model.moe_layer_freq" in got else [1] * cfg.model.num_layers
        assert freq == [0] * cfg.model.moe_first_dense_layers + [1] * cfg.model.moe_layers


def test_precision_recipes():
    """Bridge's mixed-precision recipes (training/mixed_precision.py): bf16_mixed, fp16_mixed, and the FP8 ones."""
    assert overrides(launch_for(config(LLAMA), "bridge"))["mixed_precision"] == "bf16_mixed"
    assert overrides(launch_for(config(precision="16-mixed"), "bridge"))["mixed_precision"] == "fp16_mixed"
    assert overrides(launch_for(config(precision="32-true"), "bridge"))["mixed_precision"] == "null"
    fp8 = launch_for(config(LLAMA, tp=2, dp=4, zero=1, fp8="delayed"), "bridge")
    assert overrides(fp8)["mixed_precision"] == "bf16_with_fp8_delayed_scaling_mixed"
    assert any("mixed_precision recipe" in n for n in fp8.notes)


def test_window_and_model_settings():
    cfg = config(dict(LLAMA, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6, sliding_window=4096,
                      sliding_window_pattern=6), dp=2)
    got = overrides(launch_for(cfg, "bridge"))
    assert (got["model.window_size"], got["model.window_attn_skip_freq"]) == ("[4095,0]", "6")
    assert (got["model.rotary_base"], got["model.layernorm_epsilon"], got["model.add_qkv_bias"]) == (
        "1000000", "1e-06", "true")
    assert got["model.gated_linear_unit"] == "true" and got["model.share_embeddings_and_output_weights"] == "false"


def test_cli(run_cli):
    args = ("search", "--model", "llama3-8b", "--gpus", "8", "--mem", "80GB")
    code, out, err = run_cli(*args, "--emit", "bridge", "--emit-only")
    assert code == 0 and "model.tensor_model_parallel_size=" in out and "--num-layers" not in out
    code, doc, _ = run_cli(*args, "--emit", "bridge", "--json")
    launch = json.loads(doc)["launch"]
    assert set(launch) == {"bridge", "env", "notes"}
    code, out, _ = run_cli(*args, "--emit", "bridge")
    assert "# llama3-8b: best plan as Megatron-Bridge recipe overrides" in out
