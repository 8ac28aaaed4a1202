"""Optimizers (issue 9 item 4): each one's states per parameter tensor and its step temporaries.

Expected bytes are derived by hand in the comments from the optimizers' code (torch 2.13
torch/optim/sgd.py, _adafactor.py, _muon.py, adam.py; bitsandbytes bitsandbytes/optim/optimizer.py;
lion-pytorch lion_pytorch.py), never copied from memplan's output. The CPU-runnable ones (SGD with and
without momentum, Adafactor, Muon, AdamW) are also measured with validation/step.py: the states byte
for byte, the temporaries of the optimizer step byte for byte, and the whole step's peak against
memplan's; every term, removed, makes a test fail. bitsandbytes' 8-bit Adam needs CUDA and torch has no
Lion: those two are derived from code only.

Notation: n = r x c elements of an r x c matrix, s bytes per state value, p bytes per stepped parameter.
"""

from __future__ import annotations

import json
import os

import pytest

from memplan.memory import optimizers, timeline
from memplan.plan.estimate import estimate
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues
from memplan.memory.optimizers import Tensor, state_bytes
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import OPTIMIZERS, OPTIMIZER_IMPLS_OF, TrainingSpec
from memplan.memory.shapes import weight_shapes
from memplan.memory.states import param_groups
from memplan.inventory.assemble import inventory_for

FP32, BF16 = 4, 2
LLAMA = dict(name="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, seq_length=16,
             vocab_size=256, ffn_hidden_size=192, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
             tied_embeddings=False, bias=False)
GPT2 = dict(name="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=256)


def one(optimizer: str, t: Tensor, **kw) -> int:
    return state_bytes(TrainingSpec(optimizer=optimizer, **kw), [(t, 1)])


# --- states per tensor, by hand -------------------------------------------------------------------

MATRIX = Tensor(4096, 11008, hidden=True)  # a Llama-7B MLP weight, n = 45,088,768


def test_adamw_two_moments():
    # torch/optim/adam.py: exp_avg and exp_avg_sq, each n values of s = 4 B: 2 x 45,088,768 x 4
    assert one("adamw", MATRIX) == 360_710_144


def test_sgd_momentum_buffer_and_none_without_momentum():
    # torch/optim/sgd.py:357-362: a momentum_buffer (grad.clone(): n values) only when momentum != 0
    assert one("sgd", MATRIX) == 45_088_768 * 4 == 180_355_072
    assert one("sgd-nomomentum", MATRIX) == 0


def test_adafactor_factored_second_moment():
    # torch/optim/_adafactor.py:100-113: row_var (r x 1) and col_var (1 x c) for a matrix, no first moment:
    # 4096 + 11008 = 15,104 fp32 values = 60,416 B instead of AdamW's 360,710,144
    assert one("adafactor", MATRIX) == (4096 + 11008) * 4 == 60_416
    # a vector keeps a full `variance`: 4096 fp32 values
    assert one("adafactor", Tensor(4096, None, hidden=False)) == 16_384
    # bf16-true: the states are in the parameters' dtype (grad.new_zeros): 2 B each
    assert one("adafactor", MATRIX, precision="bf16-true") == 15_104 * 2


def test_adam8bit_blockwise_states():
    # bitsandbytes/optim/optimizer.py:518-529: state1, state2 uint8 (n bytes each) and absmax1, absmax2
    # fp32, one per block of 256 (n = 45,088,768 = 176,128 blocks): 2 x 45,088,768 + 2 x 4 x 176,128, and the
    # optimizer's two 256-value fp32 quantile maps qmap1, qmap2 (optimizer.py:513-522: 2 x 1,024 B, once)
    assert one("adam8bit", MATRIX) == 90_177_536 + 1_409_024 + 2_048 == 91_588_608
    # a partial block counts whole: n = 257 -> 2 blocks; but 257 < min_8bit_size 4096 keeps fp32 states
    # (optimizer.py:502, 509-510): 2 x 4 x 257, no quantile maps
    assert one("adam8bit", Tensor(257, None, hidden=False)) == 2_056
    # exactly 4096 values is not below min_8bit_size: 8-bit, 16 blocks: 2 x 4096 + 2 x 4 x 16 + the maps
    assert one("adam8bit", Tensor(64, 64, hidden=True)) == 8_320 + 2_048
    # 8-bit Adam's bytes do not follow optimizer_state_bytes (uint8 and fp32 are fixed dtypes)
    assert one("adam8bit", MATRIX, precision="bf16-true") == 91_588_608
    # one optimizer for both tensors: the maps once; with the step in the backward one optimizer per tensor
    two = [(Tensor(64, 64, hidden=True), 1), (MATRIX, 1)]
    assert state_bytes(TrainingSpec(optimizer="adam8bit"), two) == 8_320 + 91_586_560 + 2_048
    assert state_bytes(TrainingSpec(optimizer="adam8bit", optimizer_in_backward=True), two) == \
        8_320 + 91_586_560 + 2 * 2_048


def test_muon_momentum_on_hidden_matrices_adamw_elsewhere():
    # torch/optim/_muon.py:156-158: a momentum_buffer per hidden 2-D weight: n x 4 B
    assert one("muon", MATRIX) == 180_355_072
    # an embedding (not hidden) and a vector go to AdamW: 2 moments
    assert one("muon", Tensor(32000, 4096, hidden=False)) == 2 * 32000 * 4096 * 4
    assert one("muon", Tensor(4096, None, hidden=False)) == 2 * 4096 * 4


def test_lion_one_moment():
    # lion_pytorch.py: state['exp_avg'] = torch.zeros_like(p)
    assert one("lion", MATRIX) == 180_355_072


def test_adam_is_read_as_adamw_and_unknown_names_are_refused():
    assert TrainingSpec(optimizer="adam").optimizer == "adamw"
    with pytest.raises(ValueError, match="known: adamw, sgd, sgd-nomomentum, adafactor, adam8bit, muon, lion"):
        TrainingSpec(optimizer="adagrad")
    with pytest.raises(ValueError, match="adafactor has no fused implementation"):
        TrainingSpec(optimizer="adafactor", optimizer_impl="fused")


# --- temporaries, by hand ----------------------------------------------------------------------------


def test_muon_newton_schulz_temporaries():
    # torch/optim/_muon.py:333-336 and 55-66 on a 4096 x 11008 matrix, fp32 master weights (p = 4):
    # the Nesterov update grad.lerp(buf) (n x 4 B) held while 5 Newton-Schulz iterations run on bf16:
    # old and new iterate (2 x n x 2 B), the Gram matrix X X^T and its polynomial (2 x 4096^2 x 2 B)
    n, m = 4096 * 11008, 4096
    assert optimizers.muon_newton_schulz_bytes(MATRIX, 4) == 4 * n + 2 * 2 * n + 2 * 2 * m * m == 427_819_008


def _temporaries(optimizer, impl, model=LLAMA, layout="separate", **training):
    model = ModelSpec(**model)
    tr = TrainingSpec(optimizer=optimizer, optimizer_impl=impl, precision="bf16-true", **training)
    config = Config(model=model, training=tr)
    mem = stage_memory(model, (), tr, PlanValues.from_config(config), 0, layout=layout)
    return int(optimizers.temporaries(tr, impl, mem.params, mem.tensors, 1)), int(mem.params)


def test_temporaries_by_optimizer():
    # the 2-layer Llama above: h = 64, q = 64, K/V rows 32, f = 192, v = 256 (gate/up/down 12,288 values each)
    temp, N = _temporaries("adamw", "foreach")
    assert temp == 2 * N  # foreach: one bf16 tensor per parameter (exp_avg_sq_sqrt)
    assert _temporaries("sgd", "foreach")[0] == 2 * N  # grad + weight_decay x param (sgd.py:429)
    assert _temporaries("sgd", "fused")[0] == 0
    assert _temporaries("adafactor", "foreach")[0] == 2 * N  # every matrix's var_estimate, then the vectors'
    # for-loop Adafactor: gate's var_estimate (192 x 64) is alive when up's is made, with up's row (192) and
    # column (64) means: (12,288 + 12,288 + 192 + 64) x 2 B
    assert _temporaries("adafactor", "for-loop")[0] == (12_288 + 12_288 + 192 + 64) * 2
    # Lion (lion_pytorch.py update_fn): exp_avg.clone() and its .add(grad) for the largest tensor, the
    # 256 x 64 embedding / LM head (16,384 values): 2 x 16,384 x 2 B
    assert _temporaries("lion", "for-loop")[0] == 2 * 16_384 * 2
    assert _temporaries("adam8bit", "fused")[0] == 0
    # Muon: Newton-Schulz on the largest hidden matrix (192 x 64, m = 64): 2 n + 4 n + 4 m^2 with n = 12,288 ...
    ns = 2 * 12_288 + 4 * 12_288 + 4 * 64 * 64
    assert _temporaries("muon", "fused")[0] == ns
    # ... or its foreach AdamW over the rest (embedding, LM head: 2 x 16,384; norms 5 x 64), whichever is larger
    assert _temporaries("muon", "foreach")[0] == max(ns, 2 * (2 * 16_384 + 5 * 64))


# --- shapes against the real modules --------------------------------------------------------------


def _hf_model(kind: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                       max_position_embeddings=16, tie_word_embeddings=False)
    else:
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=16)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _expanded(model: ModelSpec, layout: str) -> list[tuple[int, ...]]:
    """memplan's tensors in loop order: first, L x layer, last, head (untied), as (rows, cols) or (n,)."""
    shapes = weight_shapes(model, layout)
    v = model.symbols(t=1)
    seq = list(shapes["first"]) + list(shapes["layer"]) * model.num_layers + list(shapes["last"])
    seq += list(shapes["head"]) if not model.tied_embeddings else []
    return [(w.rows.evaluate(v),) if w.cols is None else (w.rows.evaluate(v), w.cols.evaluate(v))
            for w in seq for _ in range(w.count)]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_weight_shapes_are_the_transformers_modules(kind):
    model = _hf_model(kind)
    real = []
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if kind == "gpt2" and p.ndim == 2 and ".h." in name:
            shape = shape[::-1]  # GPT-2's Conv1D stores (in, out); memplan lists nn.Linear's (out, in)
        real.append(shape)
    spec = ModelSpec(**(LLAMA if kind == "llama" else GPT2))
    layout = inventory_for(spec, "hf-sdpa").weight_layout
    assert layout == ("separate" if kind == "llama" else "fused")
    # the same tensors in the same order (the order a for-loop optimizer visits them)
    assert _expanded(spec, layout) == real


def test_weight_shapes_are_the_reference_model():
    pytest.importorskip("torch")
    from validation.layers import GPTModel, LayerConfig
    from validation.parallel import SimulatedComm

    model = GPTModel(LayerConfig(h=64, a=4, f=256), 2, 256, 16, SimulatedComm(0, 1))
    spec = ModelSpec(**GPT2)
    assert inventory_for(spec, "torch", "cpu").weight_layout == "fused"
    assert _expanded(spec, "fused") == [tuple(p.shape) for p in model.parameters()]


@pytest.mark.parametrize("kw", [dict(), dict(mlp="swiglu", num_kv_heads=2, head_dim=24),
                                dict(norm="rmsnorm", bias=False, position_embedding="rope", tied_embeddings=False),
                                dict(mlp="swiglu", bias=True, norm="rmsnorm", num_kv_heads=1)])
@pytest.mark.parametrize("layout", ["fused", "separate"])
def test_weight_shapes_add_up_to_the_parameter_groups(kw, layout):
    model = ModelSpec(**{**GPT2, "ffn_hidden_size": 160, **kw})
    v = model.symbols(t=1)
    got: dict[str, int] = {}
    for ws in weight_shapes(model, layout).values():
        for w in ws:
            got[w.group] = got.get(w.group, 0) + w.count * w.numel.evaluate(v)
    want = {g.name: g.count.evaluate(v) for g in param_groups(model)}
    want["output layer (LM head)"] = model.vocab_size * model.hidden_size
    assert got == want


# --- measured: states, temporaries and the peak of the step (validation/step.py) -------------------

STEP = dict(model="llama", attn="sdpa", s=16, b=1, h=128, a=4, g=2, f=384, v=256, L=2)
K22 = dict(model="k22", s=16, b=1, h=128, a=4, v=256, L=2, p_drop=0.1)
GPT2_STEP = dict(model="gpt2", attn="eager", s=16, b=1, h=256, a=4, v=256, L=2)
# for-loop AdamW's temporaries follow megatron-core's parameter order (memplan/memory/optimizers.py): measured on its
# whole step (tests/test_validate_mcore_step.py), not on these torch loops
MEASURED = [(algo, impl) for algo in ("adamw", "sgd", "sgd-nomomentum", "adafactor", "muon")
            for impl in OPTIMIZER_IMPLS_OF[algo] if (algo, impl) != ("adamw", "for-loop")]


@pytest.fixture(scope="module")
def measured(announce, peak_steps):
    """Each step's measurement (validation/step.py); measured once with tests/test_validate_peak.py's grid (the
    session's `peak_steps`), which has all of these steps but GPT-2's AdamW at h = 256."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from memplan.check.peak import PeakCase, peak_grid, step_fields

    def key(case):
        return tuple(step_fields(case).items())

    grid = {key(c): c for c in peak_grid(fake=False)}
    cases = {}
    for algo, impl in MEASURED:
        for name, shape in (("llama", STEP), ("k22", K22), ("gpt2", GPT2_STEP)):
            case = PeakCase(name, **shape, optimizer=impl, algorithm=algo)
            cases[name, algo, impl] = grid.get(key(case), case)
    with announce(f"measuring {len(cases)} training steps with SGD, Adafactor, Muon and AdamW"):
        return {k: r.measurement for k, r in zip(cases, peak_steps(list(cases.values())))}


def _predicted_stage(name: str, algo: str, impl: str):
    from memplan.check.peak import PeakCase, peak_config

    shape = {"llama": STEP, "k22": K22, "gpt2": GPT2_STEP}[name]
    case = PeakCase(name, **shape, optimizer=impl, algorithm=algo)
    config = peak_config(case)
    inv = inventory_for(config.model, case.impl, "cpu")
    return stage_memory(config.model, inv.terms, config.training, PlanValues.from_config(config), 0,
                        layout=inv.weight_layout)


@pytest.mark.parametrize("name", ["llama", "k22", "gpt2"])
@pytest.mark.parametrize("algo,impl", MEASURED)
def test_states_equal_the_measured_optimizer_states(measured, name, algo, impl):
    # master weights + everything in optimizer.state but the step counters, byte for byte
    m = measured[name, algo, impl]
    stage = _predicted_stage(name, algo, impl)
    assert int(stage.optimizer) == m.persistent["master_weights"] + m.persistent["optimizer_states"]


def test_measured_states_by_hand(measured):
    # Llama above (bf16 states): N = 2 x (q 16,384 + k, v 2 x 8,192 + o 16,384 + gate, up, down 3 x 49,152 + 2 norms
    # x 128) + embedding, head 2 x 32,768 + norm 128 = 459,392
    N = 459_392
    st = {algo: measured["llama", algo, impls[0]].persistent["optimizer_states"]
          for algo, *impls in [("adamw", "foreach"), ("sgd", "foreach"), ("sgd-nomomentum", "foreach"),
                               ("adafactor", "for-loop"), ("muon", "fused")]}
    assert st["adamw"] == 2 * N * BF16
    assert st["sgd"] == N * BF16
    assert st["sgd-nomomentum"] == 0
    # Adafactor: r + c per matrix: embedding, head 2 x (256 + 128); per layer q, o 2 x 256, k, v 2 x 192,
    # gate, up, down 3 x 512, norms 2 x 128: 2,688; final norm 128 -> 768 + 2 x 2,688 + 128 = 6,272 values
    assert st["adafactor"] == 6_272 * BF16
    # Muon: the hidden matrices once (2 x 196,608), the rest twice (2 x (65,536 + 640))
    assert st["muon"] == (2 * 196_608 + 2 * (65_536 + 640)) * BF16


def _step_temporaries(m) -> int:
    """The optimizer phase's largest live bytes above the states and the gradients it steps."""
    return m.phase_peak("optimizer") - m.persistent_total - m.grad_bytes_at_end_of_backward


def test_measured_temporaries_by_hand(measured):
    N = 459_392
    t = {(algo, impl): _step_temporaries(measured["llama", algo, impl]) for algo, impl in MEASURED}
    assert t["adamw", "foreach"] == N * BF16  # exp_avg_sq_sqrt
    assert t["sgd", "foreach"] == t["sgd-nomomentum", "foreach"] == N * BF16  # grad + weight_decay x param
    assert t["sgd", "fused"] == t["sgd-nomomentum", "fused"] == t["adamw", "fused"] == 0
    assert t["adafactor", "foreach"] == N * BF16  # the matrices' var_estimates, then the norms' grad^2 beside them
    # for-loop: gate's var_estimate (384 x 128) beside up's, up's row (384) and column (128) means, the last
    # norm's grad^2 (128) and a 1 x 1 row_var mean: (2 x 49,152 + 384 + 128 + 128 + 1) x 2 B
    assert t["adafactor", "for-loop"] == (2 * 49_152 + 384 + 128 + 128 + 1) * BF16 == 197_890
    # Muon on gate (384 x 128, m = 128): the update and two bf16 iterates (3 n) and two 128 x 128 matrices
    assert t["muon", "foreach"] == t["muon", "fused"] == (3 * 49_152 + 2 * 128 * 128) * BF16 == 360_448


@pytest.fixture(scope="module")
def peaks(measured):
    from memplan.check.peak import PeakCase

    out = {}
    for (name, algo, impl), m in measured.items():
        shape = {"llama": STEP, "k22": K22, "gpt2": GPT2_STEP}[name]
        out[name, algo, impl] = (PeakCase(name, **shape, optimizer=impl, algorithm=algo), m)
    return out


def _errors(peaks, predict) -> dict:
    errors = {}
    for key, (case, m) in peaks.items():
        step = predict(case)
        errors[key] = (int(step.peak_bytes) - m.peak_bytes) / m.peak_bytes
    return errors


def test_measured_peaks_match(peaks):
    from memplan.check.peak import PEAK_TOLERANCE, predict_peak

    errors = _errors(peaks, predict_peak)
    assert all(abs(e) <= PEAK_TOLERANCE for e in errors.values()), errors
    # and the optimizer step is where most of these short steps peak, as measured
    at = {key: predict_peak(case).peak_event.phase for key, (case, _) in peaks.items()}
    assert {k for k, v in at.items() if v == "optimizer"} == {k for k, (_, m) in peaks.items()
                                                               if m.peak_phase == "optimizer"}


def _fails(peaks, keys, monkeypatch, **patches) -> bool:
    from memplan.check.peak import PEAK_TOLERANCE, predict_peak

    for target, value in patches.items():
        module, attr = target.split("__")
        monkeypatch.setattr({"optimizers": optimizers, "timeline": timeline}[module], attr, value)
    errors = _errors({k: peaks[k] for k in keys}, predict_peak)
    return all(abs(e) > PEAK_TOLERANCE for e in errors.values())


def test_without_each_temporary_the_peak_misses(peaks, monkeypatch):
    real = optimizers.temporaries

    def without(names):
        return lambda training, impl, *a: 0 if training.optimizer in names else real(training, impl, *a)

    with monkeypatch.context() as mp:
        assert _fails(peaks, [("llama", "sgd", "foreach"), ("llama", "sgd-nomomentum", "foreach"),
                              ("k22", "sgd", "foreach"), ("gpt2", "sgd", "foreach")], mp,
                      optimizers__temporaries=without({"sgd", "sgd-nomomentum"}))
    with monkeypatch.context() as mp:
        assert _fails(peaks, [("llama", "adafactor", "for-loop"), ("llama", "adafactor", "foreach"),
                              ("gpt2", "adafactor", "for-loop"), ("k22", "adafactor", "foreach")], mp,
                      optimizers__temporaries=without({"adafactor"}))
    with monkeypatch.context() as mp:  # Muon's Newton-Schulz
        assert _fails(peaks, [("llama", "muon", "fused"), ("k22", "muon", "fused"), ("gpt2", "muon", "fused")], mp,
                      optimizers__muon_newton_schulz_bytes=lambda t, p: 0 * t.rows)


def test_without_each_state_the_peak_or_the_states_miss(peaks, measured, monkeypatch):
    # SGD's momentum buffer is a quarter of these steps' peak
    with monkeypatch.context() as mp:
        mp.setattr(TrainingSpec, "optimizer_moments", property(lambda self: 0 if self.optimizer == "sgd" else 2))
        assert _fails(peaks, [("llama", "sgd", "foreach"), ("k22", "sgd", "fused")], mp)
    # SGD without momentum keeps none: giving it SGD's buffer misses
    with monkeypatch.context() as mp:
        mp.setattr(TrainingSpec, "optimizer_moments", property(lambda self: 1 if self.optimizer.startswith("sgd") else 2))
        assert _fails(peaks, [("llama", "sgd-nomomentum", "foreach"), ("k22", "sgd-nomomentum", "fused")], mp)
    # Muon's AdamW share and momentum buffers are a third of the peak
    with monkeypatch.context() as mp:
        assert _fails(peaks, [("llama", "muon", "fused"), ("gpt2", "muon", "foreach")], mp,
                      optimizers__state_bytes=lambda training, tensors: 0)
    # Adafactor's factored moment is 0.6 % of the step: too small for the peak, exact in the states
    real = optimizers.state_bytes
    with monkeypatch.context() as mp:
        mp.setattr(optimizers, "state_bytes", lambda tr, ts: 0 if tr.optimizer == "adafactor" else real(tr, ts))
        for name in ("llama", "k22", "gpt2"):
            m = measured[name, "adafactor", "for-loop"]
            stage = _predicted_stage(name, "adafactor", "for-loop")
            assert int(stage.optimizer) != m.persistent["master_weights"] + m.persistent["optimizer_states"]


# --- the command line ----------------------------------------------------------------------------


def test_cli_choices_are_the_specs_optimizers():
    from memplan.cli import options as cli

    assert cli.OPTIMIZERS == OPTIMIZERS


def test_cli_choices_are_the_allocator_models():
    from memplan.cli import options as cli
    from memplan.memory.reserved import ALLOCATORS

    assert cli.ALLOCATORS == ALLOCATORS


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_estimate_names_the_optimizer(run_cli, optimizer):
    args = ("estimate", "--model", "llama3-8b", "--impl", "hf-sdpa", "--gpu", "h100-80gb", "--optimizer", optimizer)
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["optimizer"]["name"] == data["config"]["training"]["optimizer"] == optimizer
    label = optimizers.states_label(TrainingSpec(optimizer=optimizer, precision=data["config"]["training"]["precision"]))
    assert data["optimizer"]["label"] == label
    code, out, _ = run_cli(*args)
    assert code == 0 and label.split(":")[0] in out  # the states row: "optimizer (Adafactor: ..."
    if optimizer in ("adam8bit", "lion"):
        assert "not measured" in out


def test_adafactor_states_on_a_llama_7b_matrix_shape_in_estimate():
    # Llama 2 7B (h = 4096, f = 11008, 32 layers, v = 32000, untied, bf16-mixed, one GPU): Adafactor's states
    # per layer: q, k, v, o (4096 + 4096) x 4, gate, up (11008 + 4096) x 2, down (4096 + 11008), 2 norms 4096
    # -> 4 x 8,192 + 3 x 15,104 + 8,192 = 86,272 fp32 values; embedding and head 2 x (32000 + 4096); final norm
    model = ModelSpec(name="llama2-7b", num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096,
                      vocab_size=32000, ffn_hidden_size=11008, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
                      tied_embeddings=False, bias=False, attention="flash")
    est = estimate(Config(model=model, training=TrainingSpec(optimizer="adafactor")), impl="hf-sdpa")
    values = 32 * 86_272 + 2 * (32_000 + 4096) + 4096  # 2,836,992 values = 11,347,968 B (AdamW: 53.9 GB)
    assert int(est.peak.optimizer) == est.total_params * 4 + values * 4  # fp32 master + the factored states


def test_search_keeps_the_optimizer_and_equals_estimate(run_cli):
    from memplan.plan.search import search
    from memplan.presets.batch import search_inputs
    from memplan.presets.catalog import load_gpu, load_model

    gpu = load_gpu("h100-80gb")
    for optimizer in ("adafactor", "adam8bit", "muon", "lion"):
        for impl in ("megatron", "hf-sdpa"):
            model, training, gb = search_inputs(load_model("llama3-8b"), 16, training=dict(optimizer=optimizer))
            assert training.optimizer == optimizer
            result = search(model, training, 16, gb, 10**15, gpu=gpu, top=1, impl=impl)
            for i in range(0, result.candidates, max(1, result.candidates // 7)):
                assert result.config(i).training.optimizer == optimizer  # pinned, not searched
                est = estimate(result.config(i), gpu=gpu, impl=impl)
                assert int(result.evaluated.peak_bytes[i]) == int(est.step.peak_bytes)
                assert int(result.evaluated.device_bytes[i]) == int(est.flat_total)


def test_bad_optimizer_is_one_line_exit_2():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "memplan.cli", "estimate", "--model", "gpt-22b", "--optimizer", "adagrad"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1
    assert all(name in p.stderr for name in OPTIMIZERS)


def test_yaml_optimizer_adam_alias_and_unknown(tmp_path, run_cli):
    base = ("model:\n  num_layers: 2\n  hidden_size: 64\n  num_attention_heads: 4\n  seq_length: 16\n"
            "  vocab_size: 256\ntraining:\n  optimizer: {}\n")
    (tmp_path / "adam.yaml").write_text(base.format("adam"))
    code, out, err = run_cli("estimate", "--model", str(tmp_path / "adam.yaml"), "--json")
    assert code == 0 and json.loads(out)["optimizer"]["name"] == "adamw"
    (tmp_path / "bad.yaml").write_text(base.format("adagrad"))
    code, out, err = run_cli("estimate", "--model", str(tmp_path / "bad.yaml"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown optimizer 'adagrad'; known: adamw, sgd, sgd-nomomentum, adafactor, adam8bit, muon, lion" in err


def test_impls_says_what_is_measured(run_cli):
    code, out, _ = run_cli("impls")
    lines = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in OPTIMIZERS}
    assert set(lines) == set(OPTIMIZERS)
    assert "measured on CPU with bitsandbytes 0.50.2 (its states" in lines["adam8bit"]
    assert "not measured" in lines["lion"]
    assert all("measured on CPU" in lines[o] for o in ("adamw", "sgd", "sgd-nomomentum", "adafactor", "muon"))


def test_emit_megatron_optimizer(run_cli):
    from memplan.launch.megatron import megatron_launch

    model = ModelSpec(**{**GPT2, "num_layers": 4})

    def launch(optimizer, zero=0):
        return megatron_launch(Config(model=model, parallel=ParallelSpec(dp=4, zero=zero),
                                      training=TrainingSpec(optimizer=optimizer)))

    assert "--optimizer sgd" in launch("sgd").args and "--sgd-momentum 0.0" not in launch("sgd").args
    assert {"--optimizer sgd", "--sgd-momentum 0.0"} <= set(launch("sgd-nomomentum").args)
    assert not any(a.startswith("--optimizer") for a in launch("adamw").args)
    # Megatron-LM's Muon refuses overlapped gradient reduction and the distributed optimizer
    assert "--optimizer muon" in launch("muon").args and "--overlap-grad-reduce" not in launch("muon").args
    assert not any(a.startswith("--optimizer") for a in launch("muon", zero=1).args)
    assert any("refuses the distributed optimizer" in n for n in launch("muon", zero=1).notes)
    for name in ("adafactor", "adam8bit", "lion"):
        plan = launch(name)
        assert not any(a.startswith("--optimizer") for a in plan.args)
        assert any(f"has no {name} optimizer" in n for n in plan.notes)
    code, out, _ = run_cli("search", "--model", "gpt-22b", "--gpus", "8", "--optimizer", "sgd", "--emit", "megatron",
                           "--emit-only")
    assert code == 0 and "--optimizer sgd" in out
    code, out, _ = run_cli("search", "--model", "gpt-22b", "--gpus", "8", "--optimizer", "adafactor", "--json")
    data = json.loads(out)
    assert code == 0 and data["optimizer"] == "adafactor" and any("Adafactor" in n for n in data["notes"])
