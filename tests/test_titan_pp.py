"""torchtitan's pipeline parallelism (--impl torchtitan --pp P --pipeline-schedule 1F1B|GPipe): its stage split, the
micro-batches each stage holds, FSDP2's states under PP; what is not modelled refused. The measurement against
torch's real schedules over gloo (validation/titan_pp.py, ~20 s) is opt-in: MEMPLAN_TITAN_SLOW=1."""

import os

import pytest

from memplan.api.estimating import estimate
from memplan.cli.options import PIPELINE_SCHEDULES
from memplan.core.errors import MemplanError
from memplan.inventory.titan import layer_bytes, llama3_layer_terms
from memplan.memory.pipeline import TORCH_SCHEDULES, schedule, schedule_in_flight, titan_stage_layers

SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")

# Llama 3 8B by hand: a layer 4096 (4096 + 2 x 1024 + 4096) + 3 x 4096 x 14336 + 2 x 4096 = 218,112,000
# parameters, the embedding 128256 x 4096 = 525,336,576; stage 0 of torchtitan's p = 2 split (16 layers + the
# embedding) 525,336,576 + 16 x 218,112,000 = 4,015,128,576
STAGE0 = 4_015_128_576


def test_stage_split_by_hand():
    # torchtitan's _generate_llm_fqn_per_model_part: L + 2 "effective layers" dealt out, the first stages one more;
    # L = 32, p = 2: 17 + 17, less the embedding / the output: 16 + 16. p = 4: 34 = 9 + 9 + 8 + 8: 8, 9, 8, 7.
    # L = 4, p = 2 (the measured tiny model): 3 + 3: 2 + 2. L = 31, p = 2: 17 + 16: 16 + 15
    assert titan_stage_layers(2, 32) == (16, 16)
    assert titan_stage_layers(4, 32) == (8, 9, 8, 7)
    assert titan_stage_layers(2, 4) == (2, 2)
    assert titan_stage_layers(2, 31) == (16, 15)
    assert titan_stage_layers(1, 32) == (32,)
    with pytest.raises(ValueError):
        titan_stage_layers(8, 4)  # 6 effective layers over 8 stages: empty stages


def test_schedules_in_flight_and_order():
    # torch 2.13 Schedule1F1B: stage i runs min(M, p - i) forwards before its first backward; ScheduleGPipe all M
    assert [schedule_in_flight(i, 2, 1, 8)[0] for i in (0, 1)] == [2, 1]
    assert [schedule_in_flight(i, 2, 1, 8, "GPipe") for i in (0, 1)] == [(8, 8), (8, 8)]
    assert schedule(0, 2, 1, 3, "GPipe") == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0), ("B", 1, 0),
                                             ("B", 2, 0)]
    assert PIPELINE_SCHEDULES == TORCH_SCHEDULES  # the CLI's copy of the names


def test_estimate_pp_states_and_activations():
    one_f_one_b = estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, global_batch=64, seq_len=1024)
    gpipe = estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, global_batch=64, seq_len=1024,
                     pipeline_schedule="GPipe")
    s0, g0 = one_f_one_b.estimate.stages[0], gpipe.estimate.stages[0]
    assert [int(st.layers) for st in one_f_one_b.estimate.stages] == [16, 16]
    # d = 8: the bf16 stage unsharded all step (2 B / parameter); gradients fp32 sharded (4 / 8) + accumulated
    # unsharded in fp32 (4): 4.5 B / parameter; AdamW fp32 master + 2 moments sharded: 12 / 8 B / parameter
    # each of its 16 layers' RoPE cache (s x d/2 complex64 = 4 s d B; measured in tests/test_titan_step.py)
    assert s0.states.weights == 2 * STAGE0 + 16 * 4 * 1024 * 128
    assert s0.states.gradients == 4 * STAGE0 // 8 + 4 * STAGE0
    assert s0.states.optimizer == 12 * STAGE0 // 8
    # stage 0 keeps p - 0 = 2 micro-batches' 16 layers under 1F1B, all M = 64 / 8 = 8 under GPipe; the layer's
    # activations are the same per micro-batch, the token ids (8 s b) per micro-batch in flight too; a layer keeps
    # 168,584 B per token on CUDA (tests/test_titan_cli.py PER_TOKEN, by hand), s b = 1024
    per_mb = 16 * 168_584 * 1024 + 8 * 1024
    assert s0.activations == 2 * per_mb and g0.activations == 8 * per_mb
    # the multi-stage schedules are estimated (tests/test_titan_multistage.py); torch's own limits refused: DualPipeV
    # needs M >= 2p = 4 micro-batches (global batch 16 over d = 8: M = 2)
    with pytest.raises(MemplanError, match="DualPipeV needs at least as many micro-batches as stages"):
        estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, global_batch=16, pipeline_schedule="DualPipeV")
    with pytest.raises(MemplanError, match="middle stages"):
        estimate("llama3-8b", impl="torchtitan", gpus=16, pp=4)  # 8, 9, 8, 7
    with pytest.raises(MemplanError, match="splits the stages itself"):
        estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, first_stage_layers=15)
    with pytest.raises(MemplanError, match="torchtitan's"):
        estimate("llama3-8b", gpus=16, pp=2, pipeline_schedule="GPipe")
    # selective-layer:N checkpoints every N-th layer of each stage in torchtitan, not L // N of the model: refused
    # (counted over the model, every layer of a 16-layer stage came out checkpointed: --ac full's peak)
    with pytest.raises(MemplanError, match="selective-layer with --pp"):
        estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, ac="selective-layer:2")


def test_search_refuses_pipeline_schedules_in_one_line(capsys):
    from memplan.cli import main
    for extra in (["--impl", "torchtitan", "--pp", "4"], ["--pipeline-schedule", "GPipe"]):  # 4: 8, 9, 8, 7
        with pytest.raises(SystemExit) as exit_:
            main(["search", "--model", "llama3-8b", "--gpus", "16", "--mem", "80GB"] + extra)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("memplan: error:") and err.count("\n") == 1, (extra, err)


@SLOW
@pytest.mark.parametrize("kind", ["1F1B", "GPipe"])
def test_stage_saved_peak_measured_over_gloo(kind):
    from validation.titan import Shape
    from validation.titan_pp import measure_pp

    shape, layers, vocab, s, b, m = Shape(), 4, 128, 16, 1, 4
    ranks = measure_pp(shape, layers, vocab, s, b, m, kind)
    split = titan_stage_layers(2, layers)
    assert [sum(n.startswith("layers.") for n in r["modules"]) for r in ranks] == list(split)
    layer = layer_bytes(llama3_layer_terms(shape.h, shape.a, shape.g, shape.f), "none", s, b)  # 3032 s b
    norm = sum(t.bytes_per_token for t in llama3_layer_terms(shape.h, 1, 1, 1, 1) if t.id.startswith("ffn_norm."))
    # what memplan counts per micro-batch in flight: stage 0 its layers (the token ids below); the last stage its
    # layers, the final norm (10 h + 4 per token on CPU), the fp32 log-softmax (4 v) of the loss
    first = layer * split[0]
    last = layer * split[1] + (norm + 4 * vocab) * s * b
    # + what the real run adds, not in memplan: the token ids / targets of every micro-batch are views of the local
    # batch (torch's split_args_kwargs_into_chunks), one storage of 8 s b M bytes; nll_loss's fp32 total_weight
    # scalar (4 B) per micro-batch in flight on the last stage
    flight = [schedule_in_flight(i, 2, 1, m, kind)[0] for i in (0, 1)]
    assert ranks[0]["saved_peak"] == flight[0] * first + 8 * s * b * m
    assert ranks[1]["saved_peak"] == flight[1] * (last + 4) + 8 * s * b * m
    assert all(r["saved_after"] == 0 for r in ranks)
