"""A whole torchtitan 0.3.0 FSDP2 training step against memplan's step (--impl torchtitan --device cpu).

validation/titan_step.py runs torchtitan's own code on 2 gloo ranks: its ``parallelize_llama`` (FSDP2, bf16 params /
fp32 reduce, reshard_after_forward by its default policy, its AC wrappers), its ``OptimizersContainer`` (fused
AdamW), ``CrossEntropyLoss``, ``clip_grad_norm_``; two steps, the second measured: the live storages after every op,
by kind (the fp32 states, FSDP2's unsharded parameters, its flat all-gather outputs, its held reduce-scatter inputs,
buffers, the batch, the rest).  The tiny model: h 64, a 4, g 2, f 160 (head dim 16), 2 layers, v 256, s 32, b 2.
Recorded in tests/data/titan_step.json (rank 0; both ranks equal), re-measured opt-in:

    MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_step.py -k gloo        (~60 s an AC mode)
    PYTHONPATH=. python -m validation.titan_step --record tests/data/titan_step.json

Hand figures (bytes): a layer has 64 x 128 (wqkv) + 64 x 64 (wo) + 3 x 64 x 160 + 2 x 64 = 43,136 parameters, the
final norm + LM head 64 + 256 x 64 = 16,448, the embedding 16,384; 119,104 in all.  Per rank: fp32 parameters and
gradients 119,104 x 4 / 2 = 238,208 each, AdamW's moments 476,416.  bf16 unsharded: a layer 86,272, the head 32,896,
the embedding 32,768.  An fp32 reduce-scatter input: a layer's 172,544, the head's 65,792.

What memplan gets right (asserted): the states; every saved tensor and transient at the loss's forward and backward
and at each layer's backward moments (16 B apart: the all-reduced token count, the loss and its seed gradient); the
RoPE caches; the previous unit's held reduce-scatter input (a layer's, at the last layer the head's); FSDP2's
unsharded parameters at every compared moment (memplan/memory/dp_stack.py TITAN_HELD: 2 layers inside a layer, the
embedding in place of one at the first layer's backward, the head only at the loss, the next unit only at a layer's
reduce-scatter, the embedding in its backward, nothing at the optimizer step); so the step's peak, 84 B below the
measured (those 16 B and fused AdamW's 17 fp32 step counters).  What it does not (asserted as the measured
difference): after a layer's forward FSDP2 holds only its flat all-gather output (the layer resharded), where memplan's
"after layer j's forward" event keeps the 2 layers of the layer's inside (the forward is not the step's peak).
"""

import json
import os
from pathlib import Path

import pytest

from memplan import estimate
from memplan.core.model import ModelSpec
from memplan.inventory.titan import titan_inventory

DATA = json.loads((Path(__file__).parent / "data" / "titan_step.json").read_text())
LAYER, HEAD, EMB = 43_136, 16_448, 16_384
PARAMS = 2 * LAYER + HEAD + EMB
ROPE = 2 * 4 * 32 * 16  # a ComplexRoPE cache per layer: s x d/2 complex64 = 4 s d bytes (update_from_config: s)
SCALARS = 16  # the token count (int64, all-reduced), the loss and its seed gradient (fp32): not in memplan
ACS = ("none", "full", "selective-op")
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")

MODEL = dict(name="titan-tiny", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
             ffn_hidden_size=160, seq_length=32, vocab_size=256, norm="rmsnorm", mlp="swiglu",
             position_embedding="rope", tied_embeddings=False, dropout=False, bias=False, attention="flash")


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    import yaml

    path = tmp_path_factory.mktemp("titan_step") / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL}))
    return {ac: estimate(str(path), impl="torchtitan", gpus=2, ac=ac, device="cpu", seq_len=32, micro_batch=2,
                         global_batch=4).estimate.step for ac in ACS}


def measured_key(event) -> str | None:
    """The measured moment (validation/titan_step.py: phase/layer from 0/op) of a memplan step event."""
    j, name = event.layer, event.moment
    for start, key in (("loss forward", "loss/-/nll_loss_forward"),
                       ("loss backward", "backward/-/_log_softmax_backward_data"),
                       ("layer backward: SwiGLU", f"backward/{j and j - 1}/mul"),
                       ("layer backward: the attention", f"backward/{j and j - 1}/"
                                                         "_scaled_dot_product_flash_attention_for_cpu_backward"),
                       ("layer backward done", f"backward/{j and j - 1}/fsdp.chunk_cat"),
                       ("optimizer", "optimizer/-/_fused_adamw_")):
        if name.startswith(start):
            return key
    return None


def unsharded_key(event) -> str | None:
    """The measured moment whose FSDP2 bytes memplan's event stands for: measured_key's, the embedding's backward, and
    for the LM head's backward the final norm's (the same unit's backward, after the head's pre-backward hook: the LM
    head's own matmul backward is not recorded)."""
    for start, key in (("lm_head backward", "backward/-/mul"),
                       ("embedding backward", "backward/-/embedding_dense_backward")):
        if event.moment.startswith(start):
            return key
    if event.moment.startswith("layer backward done") and event.layer == 1:
        return None  # labelled with the embedding's backward (test_activations_equal_the_measured_at_every_moment)
    return measured_key(event)


def fsdp(kinds) -> int:
    return kinds["unsharded"] + kinds["all-gather"]


def test_hand_figures():
    assert PARAMS == 119_104 and 2 * LAYER == 86_272 and 2 * HEAD == 32_896 and 4 * HEAD == 65_792


@pytest.mark.parametrize("ac", ACS)
def test_states_equal_the_measured(steps, ac):
    r = DATA[ac]
    assert (r["params"], r["grads"], r["adam"]) == (4 * PARAMS // 2, 4 * PARAMS // 2, 8 * PARAMS // 2)
    for e in steps[ac].events:
        assert e.parts["optimizer"] + e.parts["gradients"] == r["params"] + r["grads"] + r["adam"]
    # fused AdamW's step counters (one fp32 scalar per parameter tensor: 17) are not in memplan
    assert r["adam_steps"] == 17 * 4


@pytest.mark.parametrize("ac", ACS)
def test_rope_caches_equal_the_measured(steps, ac):
    # the two layers' RoPE caches are the only buffers; memplan counts them with the weights, alone at the optimizer
    # step (FSDP2 holds no unsharded parameter there: test_unsharded_parameters_in_flight)
    assert DATA[ac]["buffers"] == ROPE == 4096
    assert steps[ac].events[-1].phase == "optimizer" and steps[ac].events[-1].parts["weights"] == ROPE


@pytest.mark.parametrize("ac", ACS)
def test_activations_equal_the_measured_at_every_moment(steps, ac):
    # saved + transient (memplan) against the storages that are neither states, FSDP2's unsharded parameters nor
    # buffers (measured, the held reduce-scatter input included): the loss's forward and backward, each layer's SwiGLU
    # and attention backward and FSDP2's reduce-scatter copy-in
    seen = 0
    for e in steps[ac].events:
        key = measured_key(e)
        if key is None or key.startswith("optimizer") or key == "backward/0/fsdp.chunk_cat":
            continue  # the first layer's reduce-scatter runs as its input's gradient completes: labelled after it
        m = DATA[ac]["moments"][key]
        ours = e.parts["saved"] + e.parts["transient"]
        assert m["step"] + m["batch"] + m["reduce-scatter"] - ours == SCALARS, (ac, e.moment, e.layer)
        seen += 1
    assert seen == 7  # 2 loss moments, 3 moments of the last layer, 2 of the first


@pytest.mark.parametrize("ac", ACS)
def test_reduce_scatter_input_held_through_the_next_layer(steps, ac):
    # torch 2.13's post_backward keeps the previous unit's fp32 reduce-scatter input until the next one's: below the
    # last layer a layer's (memplan's term), at the last layer the head's (memplan/memory/timeline.py swaps it in;
    # equal byte for byte in test_activations_equal_the_measured_at_every_moment)
    mom = DATA[ac]["moments"]
    for op in ("mul", "_scaled_dot_product_flash_attention_for_cpu_backward"):
        assert mom[f"backward/0/{op}"]["reduce-scatter"] == 4 * LAYER
        assert mom[f"backward/1/{op}"]["reduce-scatter"] == 4 * HEAD
    assert mom["backward/-/embedding_dense_backward"]["reduce-scatter"] == 4 * LAYER
    # memplan's term (memplan/inventory/titan_moments.py) in each of the layer's backward moments but the last
    inventory = titan_inventory(ModelSpec(**MODEL), "cpu")
    held = {m.id: sum(int(t.elements.evaluate({"s": 32, "b": 2, "t": 1, "cp": 1})) * 4 for t in m.transients
                      if t.id.startswith("rs_held")) for m in inventory.moments if m.scope == "layer"}
    assert held == {"rerun_w2_reduce_scatter": 4 * LAYER, "swiglu_backward": 4 * LAYER,
                    "ffn_norm_backward": 4 * LAYER, "attention_backward": 4 * LAYER,
                    "attention_norm_backward": 4 * LAYER, "fsdp_reduce_scatter": 0}


@pytest.mark.parametrize("ac", ACS)
def test_unsharded_parameters_in_flight(steps, ac):
    mom = DATA[ac]["moments"]
    two = 2 * 2 * LAYER
    for j in (0, 1):  # inside a layer's forward: its unsharded parameters and its flat all-gather output
        assert fsdp(mom[f"forward/{j}/mul"]) == two
    assert fsdp(mom["loss/-/nll_loss_forward"]) == fsdp(mom["backward/-/_log_softmax_backward_data"]) == 2 * HEAD
    assert fsdp(mom["backward/1/mul"]) == two  # the last layer and the prefetched one
    assert fsdp(mom["backward/0/mul"]) == 2 * LAYER + 2 * EMB  # the first layer and the prefetched embedding
    assert fsdp(mom["optimizer/-/_fused_adamw_"]) == 0
    assert fsdp(mom["backward/-/mul"]) == 2 * HEAD + 2 * LAYER  # the head's backward: the last layer prefetched
    assert fsdp(mom["backward/1/fsdp.chunk_cat"]) == 2 * LAYER  # the layer resharded, the next one prefetched
    assert fsdp(mom["backward/-/embedding_dense_backward"]) == 2 * EMB
    # memplan's weights (the RoPE caches apart) at each event equal FSDP2's bytes at its measured moment
    seen = set()
    for e in steps[ac].events:
        if (key := unsharded_key(e)) is not None:
            assert e.parts["weights"] - ROPE == fsdp(mom[key]), (ac, e.moment, e.layer)
            seen.add(key)
    assert len(seen) == 10  # the loss's 2, the head's, 3 of each layer but the first's copy-in, the embedding's, AdamW's
    # after a layer's forward only its flat all-gather output (measured); memplan keeps the layer's inside: 2 layers
    for e in steps[ac].events[:2]:
        assert fsdp(mom[f"forward/{e.layer - 1}/end"]) == 2 * LAYER == e.parts["weights"] - ROPE - 2 * LAYER


@pytest.mark.parametrize("ac", ACS)
def test_step_peak_equals_the_measured(steps, ac):
    # the measured peak (gloo's reduce-scatter scratch apart: NCCL makes none) against memplan's: below it by the 16 B
    # of scalars and fused AdamW's 17 fp32 step counters (test_states_equal_the_measured), nothing else; at the same
    # layer's backward (none, selective-op: the last layer's, full: the first layer's)
    peak, ours = DATA[ac]["peak"], steps[ac].peak_bytes
    assert peak - ours == SCALARS + DATA[ac]["adam_steps"] == 84, (peak, ours)
    assert DATA[ac]["peak_at"][0] == steps[ac].peak_event.phase == "backward"
    assert DATA[ac]["peak_at"][1] + 1 == steps[ac].peak_event.layer


def test_step_ends_with_the_states_and_buffers():
    for ac in ACS:
        r = DATA[ac]
        assert r["start"] == r["end"] == r["params"] + r["grads"] + r["adam"] + r["adam_steps"] + ROPE


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", ACS)
def test_whole_step_measured_over_gloo(ac):
    pytest.importorskip("torchtitan")
    from validation.titan import Shape
    from validation.titan_step import measure_step, summary

    ranks = [summary(m) for m in measure_step(Shape(), 2, 256, 32, 2, ac)]
    assert ranks[0] == ranks[1] == DATA[ac]
