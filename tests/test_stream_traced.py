"""memplan's allocation stream made from a traced step's order (memplan/memory/stream_traced.py), with the shipped
llama3-8b trace (configs/traced/llama3-8b/hf-sdpa-cuda.yaml, traced from transformers' Llama with CUDA's kernels):
which plans get it, and that the join keeps memplan's run around the steps. Against the H100 recordings:
tests/test_alloc_stream_cuda.py and tests/test_layer_order.py."""

import dataclasses

import memplan
from memplan.check.allocator import LLAMA3_8B_ORDER, MAX_SEQ_CASES, case_config
from memplan.inventory.assemble import training_inventory
from memplan.memory.reserved import allocation_stream
from memplan.memory.stage import stage_memory
from memplan.memory.stream import stream_for
from memplan.memory.stream_events import Alloc
from memplan.memory.stream_lengths import StreamLengths
from memplan.memory.stream_traced import run_stream
from memplan.memory.term_bytes import PlanValues
from memplan.plan.estimate import estimate as plan_estimate
from memplan.presets.catalog import load_gpu

WORKSPACE = 32 << 20


def _config(s: int = 2048, **training):
    config = case_config(dataclasses.replace(MAX_SEQ_CASES[1], s=s))  # foreach AdamW, full recompute
    fields = {k: v for k, v in config.training.model_dump(exclude_unset=True).items() if not k.endswith("_bytes")}
    rebuilt = type(config.training).model_validate({**fields, **training})
    assert config.model.inventory == str(LLAMA3_8B_ORDER)
    return config.model_copy(update={"training": rebuilt})


def _traced(stream) -> int:
    return sum(1 for e in stream.events if type(e) is Alloc and e.name.startswith("traced ("))


def test_the_plans_of_the_code_traced_get_the_traced_step():
    # one GPU, one micro-batch, bf16-true: each step's 4,661 traced allocations (the whole step of the checkpointed
    # run, validation/layer_order.py), two steps
    assert _traced(allocation_stream(_config(), "hf-sdpa", "cuda", workspace_bytes=WORKSPACE)) == 2 * 4661
    # two micro-batches (the second accumulates into the .grad tensors: not the code traced), mixed precision (fp32
    # weights and gradients), reentrant checkpointing (another inventory): memplan's derived stream
    for other in (dict(global_batch=2), dict(precision="bf16-mixed"), dict(checkpoint_reentrant=True)):
        config = _config(**other)
        assert _traced(allocation_stream(config, "hf-sdpa", "cuda", workspace_bytes=WORKSPACE)) == 0, other


def test_the_join_keeps_memplans_run_around_the_steps():
    # the model built, the optimizer created, AdamW's lazy states and temporaries, zero_grad: memplan's events, the
    # same sizes and names in the same order; of each step, cuBLAS's two 32 MiB workspaces, made once and kept
    config = _config()
    inventory = training_inventory(config.model, "hf-sdpa", "cuda", config.training)
    plan = PlanValues.from_config(config)
    mem = stage_memory(config.model, inventory.terms, config.training, plan, 0, granularity=inventory.granularity,
                       layout=inventory.weight_layout)
    derived = stream_for(config.model, inventory, config.training, plan, 0, mem, workspace_bytes=WORKSPACE)
    traced = run_stream(config.model, inventory, config.training, plan, 0, mem, workspace_bytes=WORKSPACE)

    def outside(stream) -> list:
        phases = stream.phases
        return [(name, [(e.size, e.name) for e in stream.events[a:b] if type(e) is Alloc
                        and (not name.startswith("step ") or e.kind == "workspace")])
                for (name, a), (_, b) in zip(phases, phases[1:])]

    assert outside(traced) == outside(derived)
    assert [e.size for e in traced.events if type(e) is Alloc and e.kind == "workspace"] == [WORKSPACE] * 2
    # every tensor the run makes in a step is freed by the step's end or by zero_grad: the same bytes alive after
    # each optimizer step (the parameters and AdamW's states)
    live = traced.live_bytes()
    ends = [b - 1 for name, b in traced.phases[1:] if name.startswith("step ") or name == "end"][1:]
    assert live[ends[0]] == live[ends[1]] > 0


def test_other_lengths_are_the_traced_sizes_evaluated():
    # --max-seq makes the stream at two lengths and evaluates the sizes' polynomials at the others
    # (memplan/memory/stream_lengths.py): the traced stream's sizes are polynomials, so the evaluated compact form at a
    # third length is the stream made there, op for op
    lengths = StreamLengths(1)

    def at(s: int):
        return allocation_stream(_config(s), "hf-sdpa", "cuda", workspace_bytes=WORKSPACE)

    for s in (2048, 4096):
        lengths.get(0, s, lambda s=s: at(s))
    _, ops = lengths.get(0, 6144, lambda: at(6144))
    assert lengths.made == 2 and ops == at(6144).ops()


def test_search_and_estimate_agree_on_a_traced_plan():
    # the replay alone decides a traced-order plan (no flat margin: memplan/memory/timeline.py device_memory with
    # step_order.runs_traced), in estimate and in search's vectorised bound alike: foreach AdamW with checkpointing
    # at 9,874 tokens, which trained on the H100 (tests/data/alloc/cuda/h100_runs.json), needs 80.4 GB allocated +
    # 8.0 GB of a 10 % margin + 0.8 GB runtime > 85.0 GB with the margin: both would say it does not fit
    args = dict(impl="hf-sdpa", gpus=1, global_batch=1, precision="bf16-true", recompute="full",
                optimizer_impl="foreach", seq_len=9874, gpu="h100-80gb", inventory=str(LLAMA3_8B_ORDER))
    estimated = memplan.estimate("llama3-8b", **args).estimate
    found = memplan.search("llama3-8b", **args).result
    assert estimated.fits and estimated.device.margin == 0
    assert found.feasible == 1 and len(found.listed()) == 1


def test_the_llama3_8b_preset_uses_its_shipped_trace_by_default():
    # no --inventory: llama3-8b with --impl hf-sdpa on one H100 (bf16-true, fused AdamW, full checkpointing, one
    # micro-batch) at 13,312 tokens, which trained on the H100 (tests/data/alloc/cuda/h100_runs.json, after one
    # retry). The shipped trace's stream replays through (tests/test_alloc_stream_cuda.py: 24 of 24 verdicts); the
    # hand-written inventory's derived stream dies there (its one verdict on the safe side, SAFE_SIDE): the same
    # model under another name (no shipped trace) gets that one
    args = dict(impl="hf-sdpa", gpus=1, global_batch=1, precision="bf16-true", recompute="full",
                optimizer_impl="fused", seq_len=13312, gpu="h100-80gb")
    result = memplan.estimate("llama3-8b", **args)
    assert result.fits and result.estimate.inventory.origin.startswith("traced from transformers")
    assert any(n.startswith("allocation stream: the traced step's") for n in result.notes)
    config = result.config.model_copy(update={"model": result.config.model.model_copy(update={"name": "custom"})})
    gpu = load_gpu("h100-80gb")
    hand = plan_estimate(config, gpu.process_memory_bytes, gpu, impl="hf-sdpa")
    assert not hand.fits and not hand.inventory.origin
    # other plans keep the hand-written inventory: two micro-batches per step, --impl hf-eager
    for other in (dict(args, global_batch=2), dict(args, impl="hf-eager")):
        assert not memplan.estimate("llama3-8b", **other).estimate.inventory.origin


def test_search_max_seq_settles_as_estimate_does():
    # llama3-8b, hf-sdpa, one H100, foreach AdamW, no checkpointing: the H100 run died at 2,633 tokens
    # (tests/data/alloc/cuda/h100_runs.json). The replay completes at 4,224 but dies at shorter lengths; search
    # --max-seq answered 4,224 (the bound's longest with a survivor) where estimate --max-seq settles below the
    # shorter deaths (limits.settled). Both now stay under the length that died, search to its 128-token step
    # of estimate's answer.
    args = dict(impl="hf-sdpa", gpus=1, tp=1, pp=1, dp=1, global_batch=1, micro_batch=1, precision="bf16-true",
                recompute="none", optimizer_impl="foreach", seq_len=1024, gpu="h100-80gb")
    longest = memplan.max_seq("llama3-8b", **args)
    found = memplan.search("llama3-8b", all_variants=True, max_seq=True, **args).result.max_seq_len
    assert longest < 2633 and found < 2633
    assert found <= longest < found + 128
