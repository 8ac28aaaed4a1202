"""validation/trace.py: transformers models traced under FakeTensorMode with symbolic s and b.

Each traced polynomial is checked against what real code saves: memplan's hand-written, measured
GPT-2 / Llama inventories (memplan/inventory/hf.py), and real CPU runs of families memplan has no
hand inventory for (Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3, Mistral's sliding window,
Mixtral's MoE, DeepSeek-V3's latent attention and dense-then-MoE layers), exactly, per decoder layer, outside the layers and in total, at several (s, b).
"""

import json
import os
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from validation import trace as tr  # noqa: E402
from validation import trace_config as tc  # noqa: E402
from validation import trace_cuda as tcu  # noqa: E402
from validation import trace_measure as tm  # noqa: E402
from validation import trace_poly as tp  # noqa: E402
from validation import trace_run as trun  # noqa: E402
from validation.trace_config import FAMILIES  # noqa: E402

SHAPES = ((16, 2), (40, 3), (23, 5))  # (s, b) of the real runs: s >= every tiny sliding window, b >= 2


@pytest.fixture(scope="module")
def traced():
    cache = {}

    def get(name: str, **kw) -> dict:
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            cfg, impl = FAMILIES[name]
            cache[key] = tr.trace_hf_config(cfg, impl, **{"moments": False, **kw})  # saves only: fast
        return cache[key]

    return get


# ---------------------------------------------------------------------------------------------
# 1. against memplan's hand-written inventories (measured in tests/test_validate_hf.py)

HAND = [
    ("llama", "hf-sdpa", 2, None, 0.0),
    ("llama", "hf-eager", 2, None, 0.0),
    ("llama", "hf-sdpa", 2, 24, 0.0),  # heads wider in total than h (head_dim 24, q = 96 > h = 64)
    ("gpt2", "hf-sdpa", None, None, 0.0),
    ("gpt2", "hf-eager", None, None, 0.0),
    ("gpt2", "hf-eager", None, None, 0.1),  # dropout: bf16 bernoulli masks on CPU
]


@pytest.mark.parametrize("arch,impl,g,head_dim,dropout", HAND)
def test_trace_equals_hand_inventory(arch, impl, g, head_dim, dropout):
    from memplan.check.cases import ValidationCase
    from memplan.check.validate import predict
    from validation.hf import HFCase, build_config

    f = 256 if arch == "gpt2" else 160
    case = HFCase(s=32, b=2, h=64, a=4, f=f, v=512, L=2, p_drop=dropout, arch=arch, attn=impl.removeprefix("hf-"),
                  g=g, head_dim=head_dim)
    config = build_config(case).to_dict()  # the config validation/hf.py measures
    inv = tr.trace_hf_config(config, impl, moments=False)
    assert inv["conditions"] == ["s >= 2", "b >= 2"]
    assert [g_["layers"] for g_ in inv["layer_groups"]] == [[0, 1]]
    shared = [t["id"] for t in inv["layer_groups"][0]["terms"] if t["shared"]]
    # the rotary cos / sin tables: one storage each for all layers (the hand inventory's "chunk" terms)
    assert shared == (["self_attn.mul.0", "self_attn.mul#1.0"] if arch == "llama" else [])
    for s, b in ((32, 2), (48, 3), (7, 5)):
        def hand(scope):
            vc = ValidationCase("trace", scope, s, b, 64, 4, f, 1, False, "none", "ledger", impl=impl, arch=arch,
                                g=g, head_dim=head_dim, dropout=dropout, L=2)
            return sum(predict(vc, "cpu").values())

        got = tm.predicted_bytes(inv, s, b)
        # one layer: its own terms + the shared rope tables (terms_hf counts them in a layer's figure)
        assert got["layers"] == [hand("layer")] * 2, (s, b)
        # the model: 2 layers, rope once, embedding, final norm, LM head and loss
        assert got["total"] == hand("model"), (s, b)


# ---------------------------------------------------------------------------------------------
# 2. against real CPU runs of families with no hand inventory


@pytest.mark.parametrize("name", list(FAMILIES))
def test_trace_equals_real_run(name, traced):
    cfg, impl = FAMILIES[name]
    inv = traced(name)
    for s, b in SHAPES:
        measured = tm.measure_hf_config(cfg, s, b, impl)
        assert tm.predicted_bytes(inv, s, b) == measured, (name, s, b)


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "deepseek-v3"])
def test_trace_equals_real_run_term_by_term(name, traced):
    """The same labels on a real run: every traced polynomial equals its storage's bytes."""
    cfg, impl = FAMILIES[name]
    inv = traced(name)
    s, b = 24, 3
    real = tm.saves_at(cfg, s, b, impl)
    assert [g["layers"] for g in real["layer_groups"]] == [g["layers"] for g in inv["layer_groups"]]
    for tg, rg in zip(inv["layer_groups"] + [{"terms": inv["outside"]}], real["layer_groups"] + [{"terms": real["outside"]}]):
        assert [t["id"] for t in tg["terms"]] == [t["id"] for t in rg["terms"]]
        for t, r in zip(tg["terms"], rg["terms"]):
            assert (t["dtype"], t["op"], t["shared"]) == (r["dtype"], r["op"], r["shared"]), t["id"]
            assert tp.evaluate(t["bytes"], s, b) == int(r["bytes"]), t["id"]
            assert tp.evaluate(t["elements"], s, b) * torch.empty((), dtype=getattr(torch, t["dtype"])).element_size() \
                == tp.evaluate(t["bytes"], s, b)


def test_layer_groups_follow_the_layer_kinds(traced):
    gemma3 = traced("gemma3")
    assert [g["layers"] for g in gemma3["layer_groups"]] == [[0, 2], [1, 3]]  # sliding, global, sliding, global
    local, global_ = ([t["id"] for t in g["terms"] if t["shared"]] for g in gemma3["layer_groups"])
    assert local == ["self_attn.mul.0", "self_attn.mul#1.0"]  # one storage per file and id
    assert global_ == ["self_attn.mul.0@1", "self_attn.mul#1.0@1"]
    sliding, full = (sum(tp.evaluate(t["bytes"], 32, 2) for t in g["terms"]) for g in gemma3["layer_groups"])
    assert sliding > full  # the sliding layers' sdpa keeps the s x s mask (as bf16)
    assert [g["layers"] for g in traced("mixtral")["layer_groups"]] == [[0, 1]]
    assert [g["layers"] for g in traced("deepseek-v3")["layer_groups"]] == [[0], [1, 2]]  # dense, then MoE


def test_qwen2_polynomials(traced):
    """Qwen2 sdpa, h = 64, g/a = 1/2, f = 160 (bf16 activations, fp32 RMSNorm statistics)."""
    inv = traced("qwen2")
    (group,) = inv["layer_groups"]
    own = [t["bytes"] for t in group["terms"] if not t["shared"]]
    assert sum(tp.evaluate(x, 1, 1) for x in own) == 2712  # 2712 s b per layer
    assert all(x.endswith("s b") for x in own)
    assert [t["bytes"] for t in group["terms"] if t["shared"]] == ["32 s", "32 s"]  # rope cos, sin: s x head_dim
    assert [t["bytes"] for t in inv["outside"]] == ["8 s b", "256 s b", "4 s b", "128 s b", "128 s b", "2048 s b",
                                                     "8 s b", "4"]


def test_sliding_window_conditions(traced):
    """A sliding window masks only when s >= window: the trace says which side it took, and each
    side's polynomial is exact there (and only there)."""
    cfg, impl = FAMILIES["mistral-window"]
    long_, short = traced("mistral-window"), traced("mistral-window", s_hint=8)
    assert long_["conditions"] == ["s >= 16", "b >= 2"]
    assert short["conditions"] == ["s >= 2", "s <= 15", "b >= 2"]
    for s, b in ((9, 2), (15, 3), (16, 2), (30, 2)):
        measured = tm.measure_hf_config(cfg, s, b, impl)
        inside = long_ if s >= 16 else short
        outside = short if s >= 16 else long_
        assert tm.predicted_bytes(inside, s, b) == measured
        assert tm.predicted_bytes(outside, s, b) != measured


def test_without_the_eager_decisions_a_mask_appears(monkeypatch, traced):
    """transformers treats fake tensors as tracing: left alone, find_packed_sequence_indices says
    "packed" and every layer's sdpa gets (and keeps) an s x s mask that a real run never builds."""
    import contextlib

    cfg, impl = FAMILIES["qwen2"]
    monkeypatch.setattr(trun, "eager_decisions", contextlib.nullcontext)
    raw = tr.trace_hf_config(cfg, impl, moments=False)
    extra = [t["bytes"] for t in raw["layer_groups"][0]["terms"] if "s^2" in t["bytes"]]
    assert extra == ["2 s^2 b"]
    assert not any("s^2" in t["bytes"] for t in traced("qwen2")["layer_groups"][0]["terms"])
    assert tm.predicted_bytes(traced("qwen2"), 16, 2) == tm.measure_hf_config(cfg, 16, 2, impl)


def test_b1_is_outside_the_trace(traced):
    """torch specialises sizes 1: a trace holds for b >= 2. At b = 1 the loss keeps the padded
    labels (s + 1 ids) instead of a copy of the shifted ones (s ids): 8 bytes more."""
    cfg, impl = FAMILIES["qwen2"]
    inv = traced("qwen2")
    measured = tm.measure_hf_config(cfg, 9, 1, impl)
    predicted = tm.predicted_bytes(inv, 9, 1)
    assert measured["layers"] == predicted["layers"]
    assert measured["outside"] - predicted["outside"] == 8


# ---------------------------------------------------------------------------------------------
# 3. refusals: a trace that specialised s or b is not trusted


class _Reads(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))
        self.how = how

    def forward(self, x):
        if self.how == "int":
            n = int(x.shape[1])  # a Python int: s becomes the traced value
            x = x[:, : n - 1]
        elif self.how == "compare":
            if x.shape[1] == 4096:  # branches on s == 4096 (the hint): a guard that pins s
                x = x * 2
        elif self.how == "range":
            if x.shape[1] >= 1024:  # a range guard: allowed, kept as a condition
                x = x * 2
        return (x * self.w).sum()


def _toy(how: str):
    return trun.symbolic_saves(lambda: _Reads(how), lambda m, x: m(x), lambda s, b: (torch.randn(b, s, 8),))


@pytest.mark.parametrize("how,needle", [("int", "replacement s -> 4096"), ("compare", "guard Eq(s, 4096)")])
def test_specialising_trace_is_refused(how, needle):
    with pytest.raises(tp.TraceRefused, match="specialised") as err:
        _toy(how)
    assert needle in str(err.value)


def test_range_guard_is_a_condition():
    _, storages, conditions = _toy("range")
    assert conditions == ["s >= 1024", "b >= 2"]
    assert [tp.poly_text(st["nbytes"]) for st in storages] == ["32 s b"]  # fp32 x * 2, saved by the mul


def test_real_model_without_the_python_dispatcher_is_refused():
    """Without the python dispatcher torch's C++ matmul reads s and b as ints (eager attention's
    QK^T): the ShapeEnv pins both, and the trace is refused."""
    cfg, _ = FAMILIES["qwen2"]
    with pytest.raises(tp.TraceRefused, match=r"replacement (s|b) -> "):
        tr.trace_hf_config(cfg, "hf-eager", python_dispatcher=False, moments=False)


def test_data_dependent_forward_is_refused():
    """Mixtral with transformers' expert loop (experts_implementation="eager") iterates over the
    experts that received tokens: data-dependent, refused (its grouped_mm default traces)."""
    cfg, _ = FAMILIES["mixtral"]
    with pytest.raises(tp.TraceRefused, match="depends on tensor values"):
        tr.trace_hf_config(cfg, experts="eager", moments=False)


# ---------------------------------------------------------------------------------------------
# the file, the CLI


def test_file_format(traced, tmp_path):
    from memplan.inventory.traced_file import TracedFile, config_sha256

    cfg, _ = FAMILIES["gemma3"]
    inv = traced("gemma3")
    TracedFile.model_validate(inv)  # memplan's reader accepts it
    assert inv["origin"] == {"transformers": __import__("transformers").__version__,
                             "torch": torch.__version__.split("+")[0], "config_sha256": config_sha256(cfg),
                             "architecture": "Gemma3ForCausalLM", "model_type": "gemma3_text", "impl": "hf-sdpa",
                             "kernels": "cpu", "dtype": "bfloat16"}
    import yaml

    text = tr.to_yaml(inv)
    assert "layers: [0, 2]" in text and "&id" not in text
    assert yaml.safe_load(text) == inv
    for group in inv["layer_groups"]:
        ids = [t["id"] for t in group["terms"]]
        assert len(ids) == len(set(ids))


def test_cli(tmp_path, capsys):
    cfg, _ = FAMILIES["qwen2"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "inv.yaml"
    assert tr.main(["--hf-config", str(path), "--impl", "hf-eager", "--out", str(out)]) == 0
    import yaml

    data = yaml.safe_load(out.read_text())
    assert data["origin"]["impl"] == "hf-eager" and data["num_layers"] == 2
    assert tr.main(["--hf-config", str(path), "--kernels", "cuda"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["origin"]["kernels"] == "cuda"
    path.write_text(json.dumps({"hidden_size": 64}))
    assert tr.main(["--hf-config", str(path)]) == 2
    assert "no model_type" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# --kernels cuda: the CUDA kernels' saves, emulated on fake CPU tensors


@pytest.mark.parametrize("arch,impl,dropout,sdpa", [("llama", "hf-sdpa", 0.0, "cudnn"), ("llama", "hf-eager", 0.0, ""),
                                                    ("gpt2", "hf-sdpa", 0.1, "flash"), ("gpt2", "hf-eager", 0.1, "")])
def test_cuda_kernels_equal_hand_cuda_inventory(arch, impl, dropout, sdpa):
    """terms_hf's CUDA inventories (derived from torch's kernels: bool dropout masks, fp32
    layer-norm statistics, FlashAttention even with dropout) plus, per sdpa call, the Philox RNG
    state, which terms_hf leaves out: cuDNN attention's int64 seed and offset [] (16 bytes), the
    kernel torch picks first on an H100 (validation/trace_cuda.py SDPA_ORDER), keeping what flash keeps
    otherwise (its logsumexp [b, a, s, 1], its output in q's layout [b, s, a, d]); flash's own
    state (uint64 [2] and [], 24 bytes) where cuDNN is not preferred."""
    from memplan.check.cases import ValidationCase
    from memplan.check.validate import predict
    from validation.hf import HFCase, build_config

    f, g = (256, None) if arch == "gpt2" else (160, 2)
    case = HFCase(s=32, b=2, h=64, a=4, f=f, v=512, L=2, p_drop=dropout, arch=arch, attn=impl.removeprefix("hf-"), g=g)
    order = tcu.SDPA_ORDER[tcu.SDPA_ORDER.index(sdpa or "cudnn"):]  # cudnn: torch's H100 order; flash: without cuDNN
    inv = tr.trace_hf_config(build_config(case).to_dict(), impl, kernels="cuda", moments=False, sdpa=order)
    assert inv["origin"]["kernels"] == "cuda" and inv["conditions"] == ["s >= 2", "b >= 2"]
    (group,) = inv["layer_groups"]
    rng = {"cudnn": 16, "flash": 24, "": 0}[sdpa]
    assert sum(tp.evaluate(t["bytes"], 0, 0) for t in group["terms"]) == rng
    for s, b in ((32, 2), (64, 3)):
        vc = ValidationCase("trace", "layer", s, b, 64, 4, f, 1, False, "none", "ledger", impl=impl, arch=arch, g=g,
                            dropout=dropout)
        assert tm.predicted_bytes(inv, s, b)["layers"] == [sum(predict(vc, "cuda").values()) + rng] * 2
    ops = {t["op"] for t in group["terms"]}
    if impl == "hf-sdpa":
        assert f"torch.nn.functional.scaled_dot_product_attention[{sdpa}]" in ops
    masks = [t for t in group["terms"] if t["op"].endswith("dropout")]
    assert all(t["dtype"] == "bool" for t in masks) and len(masks) == (3 if impl == "hf-eager" and dropout else
                                                                        2 if dropout else 0)
    stats = [t for t in group["terms"] if t["op"].endswith("layer_norm") and t["bytes"].endswith(" s b")
             and not t["bytes"].startswith("128")]
    assert all(t["dtype"] == "float32" for t in stats) and len(stats) == (4 if arch == "gpt2" else 0)


def test_cuda_kernels_with_a_mask_use_efficient_attention():
    """Mistral's sliding window (s >= window): a mask, so no FlashAttention; where cuDNN is not
    preferred (an A100, cuDNN <= 9.15) the memory-efficient kernel keeps the additive bf16 mask and a
    logsumexp padded to a multiple of 32 along s."""
    cfg, impl = FAMILIES["mistral-window"]
    inv = tr.trace_hf_config(cfg, impl, kernels="cuda", moments=False, sdpa=("flash", "efficient", "math"))
    assert inv["conditions"] == ["s >= 16", "b >= 2", "s % 32 == 0"]
    sdpa = [t for t in inv["layer_groups"][0]["terms"] if "scaled_dot_product" in t["op"]]
    assert {t["op"] for t in sdpa} == {"torch.nn.functional.scaled_dot_product_attention[efficient]"}
    assert [t["bytes"] for t in sdpa] == ["2 s^2 b", "128 s b", "128 s b", "128 s b", "16 s b", "128 s b", "8", "8"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["qwen2", "gemma", "mistral-window"])
def test_cuda_kernels_equal_a_real_gpu_run(name):
    """On a GPU: the emulated CUDA trace against the real kernels' saved storages (up to the
    Philox RNG state, which a real run may keep as host tensors)."""
    cfg, impl = FAMILIES[name]
    inv = tr.trace_hf_config(cfg, impl, kernels="cuda", moments=False)
    for s, b in ((32, 2), (64, 3)):
        measured = tm.measure_hf_config(cfg, s, b, impl, device="cuda")
        predicted = tm.predicted_bytes(inv, s, b)
        assert predicted["outside"] == measured["outside"]
        for p, m in zip(predicted["layers"], measured["layers"]):
            assert abs(p - m) <= 64, (name, s, b, p, m)


# ---------------------------------------------------------------------------------------------
# 4. a real-size config: seconds under FakeTensorMode


LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
             "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}


@pytest.mark.slow
def test_llama3_8b_traces_in_seconds(capsys):
    start = time.perf_counter()
    inv = tr.trace_hf_config(LLAMA3_8B, moments=False)
    seconds = time.perf_counter() - start
    with capsys.disabled():
        print(f"\n[trace] Llama-3-8B config (32 layers, v = 128256) traced in {seconds:.1f} s")
    (group,) = inv["layer_groups"]
    assert group["layers"] == list(range(32))
    # per layer: 200840 s b (sdpa, GQA 32/8, f = 14336) + the rope tables 2 x 256 s, as terms_hf has it
    assert sum(tp.evaluate(t["bytes"], 1, 1) for t in group["terms"] if not t["shared"]) == 200840
    assert [t["bytes"] for t in group["terms"] if t["shared"]] == ["256 s", "256 s"]
    assert next(t for t in inv["outside"] if t["op"].endswith("cross_entropy"))["bytes"] == "513024 s b"


def test_the_two_keys_agree():
    """validation/ (which does not import memplan) keys a trace as memplan finds it (tests/test_traced_key.py)."""
    from memplan.inventory import traced_file
    from memplan.presets.files import configs_dir

    assert tc.METADATA_KEYS == traced_file.METADATA_KEYS
    for d in sorted(configs_dir().glob("traced/*/config.json")):
        data = {**json.loads(d.read_text()), "transformers_version": "4.57.1", "rope_theta": 10000}
        assert tc.config_sha256(data) == traced_file.config_sha256(data), d


# ---------------------------------------------------------------------------------------------
# the composed trace (validation/compose.py) against the whole model's

# (family, changes, with the step's moments): a dense model (layers 0, 3, 4 of 5 run); Gemma 3's sliding / global
# layers (1 : 1, two kinds, each with its rotary tables, global 1, 3, 5: 0, 1, 2, 5, 6 of 7 run, the global layer 5
# standing for 3); DeepSeek-V3's dense first layers before its MoE ones (routed + shared experts). A full-size dense
# model with its moments: tests/test_traced.py re-traces qwen2.5-7b (3 of 28 layers run) and compares it with the
# shipped file, traced from every layer.
COMPOSED = [("qwen2", {"num_hidden_layers": 5}, False),
            ("gemma3", {"num_hidden_layers": 7, "sliding_window_pattern": 2}, False),
            ("deepseek-v3", {"num_hidden_layers": 6}, False)]


@pytest.mark.parametrize("family, changes, moments", COMPOSED)
def test_composed_trace_equals_the_whole_model_trace(family, changes, moments):
    """Tracing the first and a middle layer of each kind and the model's last two and composing the model from them gives, term by
    term, the inventory of the whole model's trace. Saves only, for the test's time: the moments (which hold the
    ends of a kind apart) are compared on qwen2.5-7b in tests/test_traced.py."""
    cfg, impl = FAMILIES[family]
    cfg = {**cfg, **changes}
    layers = cfg["num_hidden_layers"]
    told: list[str] = []
    composed = tr.trace_hf_config(cfg, impl, moments=moments, progress=told.append)
    whole = tr.trace_hf_config(cfg, impl, moments=moments, compose=False)
    assert len(told) == 1 and f"of {layers} decoder layers" in told[0]
    assert int(told[0].split(": ")[1].split()[0]) < layers  # fewer layers ran than the model has
    assert [g["layers"] for g in composed["layer_groups"]] == [g["layers"] for g in whole["layer_groups"]]
    for mine, theirs in zip(composed["layer_groups"], whole["layer_groups"]):
        assert len(mine["terms"]) == len(theirs["terms"])
        for a, b in zip(mine["terms"], theirs["terms"]):
            assert a == b
    assert composed["outside"] == whole["outside"]
    assert composed["conditions"] == whole["conditions"]
    if moments:
        assert composed["checkpoint"] == whole["checkpoint"]
        assert len(composed["moments"]) == len(whole["moments"])
        for a, b in zip(composed["moments"], whole["moments"]):
            assert a == b
    assert composed == whole


# with the step's moments, where the layers not traced are the ones the rule leaves out (validation/compose.py
# ``representatives``): Gemma 3 at 9 layers, 1 : 1 (global layers 1, 3, 5, 7: the global 7, the model's second-last,
# stands for 3 and 5, no kind starting between them; the sliding 4, 6 are not traced), DeepSeek-V3 with three dense
# layers (the last, 2, under the MoE ones, not traced) and four MoE ones (5, the second-last, stands for 4). The
# file's bytes are compared, as `memplan trace --out` writes them. Opt-in (MEMPLAN_TRACE_SLOW=1; ~85 s, the whole
# models' moments): the suite runs the same composition on saves only (COMPOSED above, with gemma3 at 1 : 1).
COMPOSED_MOMENTS = [("gemma3", {"num_hidden_layers": 9, "sliding_window_pattern": 2}, [0, 1, 2, 7, 8]),
                    ("deepseek-v3", {"num_hidden_layers": 7, "first_k_dense_replace": 3}, [0, 1, 3, 5, 6])]


@pytest.mark.skipif(not os.environ.get("MEMPLAN_TRACE_SLOW"), reason="set MEMPLAN_TRACE_SLOW=1 to run")
@pytest.mark.parametrize("family, changes, traced", COMPOSED_MOMENTS)
def test_composed_moments_equal_the_whole_model_trace(family, changes, traced):
    """Of each kind the first layer and one in the middle, and the model's last two: the composed file, moments
    included, is the whole model's byte for byte, though the last layers of a kind in the middle of the model are
    not traced and the model's second-last layer stands for the middle of its kind."""
    cfg, impl = FAMILIES[family]
    cfg = {**cfg, **changes}
    told: list[str] = []
    composed = tr.trace_hf_config(cfg, impl, progress=told.append)
    assert f"{len(traced)} of {cfg['num_hidden_layers']} decoder layers" in told[0]
    whole = tr.trace_hf_config(cfg, impl, compose=False)
    assert composed["moments"] and tr.to_yaml(composed) == tr.to_yaml(whole)


def test_a_frozen_parameter_gets_no_gradient_hook():
    """AFMoE's expert_bias and Laguna's e_score_correction_bias are parameters with requires_grad false: torch refuses
    a gradient hook on them, so the step's trace hooks the trainable ones only (it failed on both models)."""
    model = torch.nn.Linear(3, 2)
    model.register_parameter("frozen", torch.nn.Parameter(torch.zeros(4), requires_grad=False))
    made = []
    live = type("Live", (), {"grad_made": lambda self, p, name: made.append(name)})()
    handles = trun.grad_hooks(model, live)
    assert len(handles) == 2  # weight, bias
    model(torch.ones(1, 3)).sum().backward()
    assert sorted(made) == ["bias", "weight"]


@pytest.mark.skipif(not os.environ.get("MEMPLAN_TRACE_SLOW"), reason="set MEMPLAN_TRACE_SLOW=1 to run")
def test_a_stand_in_layer_has_the_moments_of_its_trace(monkeypatch):
    """Gemma 3 at 8 layers, 2 : 1 (sliding 0, 1, 3, 4, 6, 7; global 2, 5): the global layers start between the
    sliding 1 and 6, the model's second-last, so 1 is not traced and takes 6's moments less the global rotary
    tables that the checkpointed layers are given from layer 2 on (compose.stand_ins). The file is the one that
    traces layer 1, byte for byte. Opt-in (~25 s): the suite checks the rule (the test below)."""
    from validation import compose

    cfg, impl = FAMILIES["gemma3"]
    cfg = {**cfg, "num_hidden_layers": 8, "sliding_window_pattern": 3}
    told: list[str] = []
    standing = tr.trace_hf_config(cfg, impl, progress=told.append)
    assert "5 of 8 decoder layers" in told[0]
    rule, stands = compose.representatives, compose.stand_ins
    monkeypatch.setattr(compose, "representatives", lambda kinds: sorted({*rule(kinds), *stands(kinds)}))
    monkeypatch.setattr(compose, "stand_ins", lambda kinds: {})
    told.clear()
    traced = tr.trace_hf_config(cfg, impl, progress=told.append)
    assert "6 of 8 decoder layers" in told[0]
    assert standing["checkpoint"]["kept"][4:] and tr.to_yaml(standing) == tr.to_yaml(traced)


def test_representatives_keep_one_middle_layer_per_kind():
    """The rule of validation/compose.py by hand: the model's last two layers, each kind's first, and one middle
    layer of each kind: the model's second-last where it is of the kind (standing in for the kind's second layer
    where another kind starts between them), else the kind's second layer."""
    from validation import compose

    dense = [list(range(80))]  # Llama 3 70B: 0, then 78 stands for 1..77
    assert compose.representatives(dense) == [0, 78, 79]
    assert compose.copies(dense) == {i: 78 for i in range(1, 78)}
    dense_first = [[0, 1, 2], list(range(3, 61))]  # DeepSeek-V3: the dense kind's middle is 1, the MoE kind's 59
    assert compose.representatives(dense_first) == [0, 1, 3, 59, 60]
    assert compose.copies(dense_first) == {2: 1, **{i: 59 for i in range(4, 59)}}
    # Gemma 3 1B: global layers 5, 11, 17, 23 start at 5, between the sliding kind's second layer (1) and 24: 24
    # stands in for 1
    gemma = [[i for i in range(26) if i % 6 != 5], [5, 11, 17, 23]]
    assert compose.representatives(gemma) == [0, 5, 11, 24, 25] and compose.stand_ins(gemma) == {1: 24}
    assert compose.copies(gemma)[2] == 24 and compose.copies(gemma)[22] == 24 and compose.copies(gemma)[23] == 11
    # alternating kinds: the top layer (7) is never a middle; 6, of the other kind, stands for 2 and 4
    assert compose.representatives([[0, 2, 4, 6], [1, 3, 5, 7]]) == [0, 1, 3, 6, 7]
    assert compose.stand_ins([[0, 2, 4, 6], [1, 3, 5, 7]]) == compose.stand_ins(dense_first) == {}
    assert compose.copies([[0, 2, 4, 6], [1, 3, 5, 7]]) == {2: 6, 4: 6, 5: 3}
