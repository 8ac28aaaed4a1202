"""torchtitan 0.3.0's multi-token prediction for DeepSeek-V3 (`--impl torchtitan --mtp N`, memplan/inventory/titan_mtp.py)
against torchtitan's own model: the parameters of its MTP layers on the meta device, what each MTP layer keeps measured
on CPU with MTPLoss (recorded; re-measured opt-in with MEMPLAN_TITAN_SLOW=1), the emitted config loaded by its
ConfigManager, and what torchtitan refuses (MTP with PP or CP); with TP and EP: tests/test_titan_mtp_tp.py.  Needs
torchtitan (the test extra)."""

import os

import pytest

from memplan.api.estimating import estimate
from memplan.core.errors import MemplanError
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.titan import titan_model
from memplan.inventory.titan_dsv3 import dsv3_inventory
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues

pytest.importorskip("torchtitan")

import torch  # noqa: E402
import yaml  # noqa: E402

from tests.test_titan_dsv3 import SHAPE, _model  # noqa: E402
from validation.titan_dsv3 import dsv3_model_config  # noqa: E402

SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
S, V = 16, 128


def _yaml(tmp_path):
    spec = _model(seq_length=S, vocab_size=V, name="tiny-dsv3").model_dump(exclude={"inventory"})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": spec}))
    return str(path)


@pytest.mark.parametrize("mtp", [1, 2])
def test_tiny_parameters_equal_torchtitans_model(mtp, tmp_path):
    # torchtitan's DeepSeekV3Model with _build_mtp_layers (as model_registry makes them) on the meta device; memplan's
    # one stage (ep 1) holds the same.  By hand an MTP layer is the MoE layer (24,528 + 98,304: tests/test_titan_dsv3.py)
    # + enorm, hnorm, mtp_norm (3 x 64) + eh_proj (128 x 64, no bias)
    with torch.device("meta"):
        real = [sum(p.numel() for p in dsv3_model_config(SHAPE, V, mtp=n).build().parameters()) for n in (0, mtp)]
    assert real[1] - real[0] == mtp * (24_528 + 98_304 + 3 * 64 + 2 * 64 * 64)
    est = estimate(_yaml(tmp_path), impl="torchtitan", gpus=1, mtp=mtp, micro_batch=1, global_batch=1,
                   ac="none").estimate
    assert int(est.stages[0].params) == real[1]


def test_671b_parameters_equal_torchtitans_model():
    # model_registry("671B", num_mtp_layers=1) on the meta device (~1 s): 671,026,404,352 + one MTP layer, 11,610,067,968
    from torchtitan.models.deepseek_v3 import model_registry
    with torch.device("meta"):
        real = sum(p.numel() for p in model_registry("671B", num_mtp_layers=1).model.build().parameters())
    est = estimate("deepseek-v3", impl="torchtitan", gpus=8, ep=1, mtp=1, seq_len=4096, micro_batch=1, global_batch=8,
                   ac="full").estimate
    assert int(est.stages[0].params) == real
    H, A, RQ, RKV, DN, DR, DV, FE, E = 7168, 128, 1536, 512, 128, 64, 128, 2048, 256
    attn = H * RQ + RQ + RQ * A * (DN + DR) + H * (RKV + DR) + RKV + RKV * A * (DN + DV) + A * DV * H + 2 * H
    assert real - 671_026_404_352 == attn + E * H + 3 * H * FE + 3 * E * H * FE + 3 * H + 2 * H * H


# torchtitan's DeepSeekV3Model (validation/titan_dsv3.py measure_dsv3_mtp: the 2-layer tiny model, layer 0 dense, layer 1
# MoE, SHAPE, vocabulary 128, with 0, 1 and 2 MTP layers; bf16, balanced routing, the dataloader's positions passed,
# MTPLoss; s b = 16 x 1): the bytes of saved tensors alive after the forward and the loss, by AC mode (torchtitan wraps
# model.layers only: each MTP layer adds the same under every mode):
#   MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_mtp.py -k measured   (~10 s)
RECORDED = {"none": [151332, 263912, 376492], "full": [22980, 135560, 248140]}


def _memplan(mtp, ac):
    spec = titan_model(_model(seq_length=S, vocab_size=V), mtp)
    rec = {"none": Recompute.NONE, "full": Recompute.FULL}[ac]
    plan = PlanValues(t=1, p=1, d=1, m=1, sp=0, zero=3, shard=1, b=1, recompute=int(rec), recomputed_layers=2,
                      microbatches=1)
    training = TrainingSpec(micro_batch=1, recompute=rec, device="cpu")
    mem = stage_memory(spec, dsv3_inventory(spec, "cpu").terms, training, plan, 0, working_set=False)
    return mem.activations


@pytest.mark.parametrize("ac", sorted(RECORDED))
def test_recorded_mtp_layers_equal_memplan(ac):
    # each MTP layer = memplan's MTP terms (the MoE layer's terms under none whatever the AC mode, enorm / hnorm /
    # mtp_norm, eh_proj's input, the mask, the shifted ids and labels, the depth's fp32 log-softmax) + what memplan
    # leaves out everywhere: the grouped GEMMs' int32 offsets (4 E) and nll_loss's total_weight (4 B); the RoPE cache
    # rows gathered at the positions (s b d_r / 2 complex64 = 4 s b d_r) are the MoE layer's rope.gathered term
    unmodelled = 4 * SHAPE.E + 4
    got = RECORDED[ac]
    for n in (1, 2):
        assert got[n] - got[0] == _memplan(n, ac) - _memplan(0, ac) + n * unmodelled
    assert got[2] - got[1] == got[1] - got[0]


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", sorted(RECORDED))
def test_mtp_measured_equals_recorded(ac):
    from validation.titan_dsv3 import measure_dsv3_mtp
    assert [measure_dsv3_mtp(SHAPE, n, ac, S, 1) for n in (0, 1, 2)] == RECORDED[ac]


@pytest.mark.parametrize("kw,match", [(dict(pp=2), "pipeline"), (dict(cp=2), "context"),
                                      (dict(impl="megatron"), "--mtp N is torchtitan's")])
def test_refused(kw, match):
    base = dict(impl="torchtitan", gpus=16, ep=8, mtp=1, seq_len=4096, micro_batch=1, global_batch=16, ac="full")
    with pytest.raises(MemplanError, match=match):
        estimate("deepseek-v3", **{**base, **kw})


def test_refused_elsewhere():
    with pytest.raises(MemplanError, match="DeepSeek-V3 only"):
        estimate("qwen3-30b-a3b", impl="torchtitan", gpus=8, mtp=1, global_batch=8)
    from memplan.api.searching import search
    with pytest.raises(MemplanError, match="DeepSeek-V3 only"):
        search("qwen3-30b-a3b", impl="torchtitan", gpus=8, mtp=1, global_batch=8, mem="80GB")
    # search and estimate refuse it for the other impls with the one check (api/values.py mtp_layers)
    with pytest.raises(MemplanError, match="--mtp N is torchtitan's"):
        search("llama3-8b", gpus=8, mtp=1)


@pytest.mark.parametrize("tp", [1, 2])
def test_emitted_mtp_plan_loads_in_torchtitan(tp, tmp_path, monkeypatch):
    # as torchtitan's own deepseek_v3_debugmodel_mtp: model_registry(..., num_mtp_layers=N) and MTPLoss (with TP too:
    # tests/test_titan_mtp_tp.py)
    from tests.test_launch_titan import _load
    result = estimate("deepseek-v3", impl="torchtitan", gpus=16, ep=8, tp=tp, mtp=1, ac="full", seq_len=4096,
                      micro_batch=1, global_batch=16 // tp, emit="torchtitan")
    config = _load(tmp_path, monkeypatch, "\n".join(result.launch.args))
    assert len(config.model_spec.model.mtp_layers) == 1 and config.parallelism.tensor_parallel_degree == tp
    assert type(config.loss).__qualname__ == "MTPLoss.Config"
    one = estimate("deepseek-v3", impl="torchtitan", gpus=16, ep=8, tp=tp, ac="full", seq_len=4096, micro_batch=1,
                   global_batch=16 // tp).estimate
    assert result.estimate.stages[0].activations > one.stages[0].activations
