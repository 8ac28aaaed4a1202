"""What HuggingFace transformers' real GPT-2 and Llama code saves for backward, labelled.

The models are built from a config (``AutoModelForCausalLM.from_config``: no weights, no network;
``HF_HUB_OFFLINE=1`` is set before transformers is imported), in bf16, in training mode, on CPU
(or under ``FakeTensorMode``), and measured with the saved-tensor ledger and the live-storage
tracker of ``validation.instruments``.

HF code cannot be tagged, so every saved storage is labelled from the context of its *first* save
(module, op, k-th saving call, j-th saved tensor) by the rule tables of ``validation.hf_rules``, which says how;
a storage no rule matches is labelled ``"unlabeled"`` (tests demand there are none).

Scopes:

* ``"layer"``: one decoder layer (``model.model.layers[0]`` / ``model.transformer.h[0]``) run on
  its own, with the inputs the model would give it built *inside* the measured window by the
  model's own code (embedding under ``no_grad`` then made a leaf that requires grad, rotary
  cos/sin, ``create_causal_mask``).  So the live tracker sees exactly one layer, and tensors the
  model shares between layers (rope cos/sin) are counted in the layer, as the reference harness
  counts its causal mask.  ``HFMeasurement.per_layer`` of a model run gives the same dictionaries
  (tests check it).  One artefact of running a layer alone: its input is a leaf, and a leaf that
  requires grad stays alive with the graph (its AccumulateGrad node holds it) even when nothing
  saves it, as in Llama, whose RMSNorm saves an fp32 copy instead.  So for Llama the live
  tracker's retained bytes are saved + loss + the input (2sbh); inside a model the input of a
  layer is an ordinary activation and is freed.
* ``"model"``: ``model(input_ids, labels=targets, use_cache=False).loss``; every storage once, so
  the shared cos/sin appear once.  ``per_layer[i]`` lists what layer ``i``'s modules saved
  (shared storages in every layer that saved them; their labels are in ``shared_labels``).

Written against transformers 5.23.0 and torch 2.13.0: the (module, op, k, j) tables follow that
code path; another version that saves differently shows up as ``"unlabeled"`` entries or a failing
hand derivation in tests/validation/test_hf.py.  CPU facts the tables encode: ``F.dropout`` saves a
bf16 bernoulli mask (not native_dropout's bool); sdpa with dropout 0 and no mask reaches
``_scaled_dot_product_flash_attention_for_cpu`` (saves q, k, v, output, fp32 logsumexp), with
dropout > 0 it falls back to the math path, which computes in fp32.  CUDA is not supported here.

Nothing here computes a byte count from a formula; every number is read off a tensor.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass, field
from typing import Literal

# Nothing here may touch the network (from_config needs no download anyway): set before
# transformers / huggingface_hub are imported, which read these at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

import torch  # noqa: E402

from .hf_rules import RULES, SDPA, split_module  # noqa: E402
from .instruments import LiveTracker, SavedEntry, _AtenLog, _CallRecorder, _HFLedger, _ModuleStack  # noqa: E402
from .measure import Case, Measurement  # noqa: E402
from .tags import PARAMETER, UNLABELED  # noqa: E402

Arch = Literal["gpt2", "llama"]
Attn = Literal["eager", "sdpa"]
HF_BACKENDS = ("ledger", "live", "fake")

# ---------------------------------------------------------------------------------------------
# the case


@dataclass(frozen=True)
class HFCase(Case):
    """A ``Case`` plus the HF model: ``arch``, ``attn`` and ``g`` (Llama KV heads; None = a).
    ``p_drop`` is every dropout probability of the config (GPT-2: attn / resid / embd; Llama:
    attention_dropout).  ``f`` None means 4h (GPT-2 ``n_inner``, Llama ``intermediate_size``)."""

    arch: str = "llama"
    attn: str = "sdpa"
    g: int | None = None
    head_dim: int | None = None  # Llama: width of one head (None = h/a)
    lora_r: int = 0  # peft LoRA rank (0: none); the base model frozen by peft
    lora_p: float = 0.0  # LoRA dropout
    lora_targets: tuple[str, ...] = ()  # target modules (empty: peft's default for the family)

    @property
    def kv_heads(self) -> int:
        return self.a if self.g is None else self.g

    def check(self) -> None:
        super().check()
        if self.arch not in RULES:
            raise ValueError(f"arch must be one of {tuple(RULES)}")
        if self.attn not in ("eager", "sdpa"):
            raise ValueError("attn must be 'eager' or 'sdpa'")
        if self.backend not in HF_BACKENDS:
            raise ValueError(f"HF measurements support backends {HF_BACKENDS}")
        if self.t != 1 or self.sp or self.recompute != "none":
            raise ValueError("HF measurements are single-rank, no recompute")
        if self.arch == "gpt2" and self.g is not None and self.g != self.a:
            raise ValueError("GPT-2 has no grouped-query attention")
        if self.arch == "gpt2" and self.head_dim is not None:
            raise ValueError("GPT-2 heads are h/a wide")
        if self.lora_r and self.arch != "llama":
            raise ValueError("LoRA measurements are for the Llama layout")
        if (self.h % self.a and self.head_dim is None) or self.a % self.kv_heads:
            raise ValueError("need a | h (or a head_dim) and g | a")


@dataclass
class HFMeasurement(Measurement):
    """``Measurement`` plus where each entry came from (same order as ``entries``)."""

    contexts: list[tuple[str, str, int, int]] = field(default_factory=list)  # (module, op, k, j)
    producers: list[str] = field(default_factory=list)  # "module:op" that created the storage
    savers: list[list[str]] = field(default_factory=list)  # every module that saved it
    per_layer: list[dict[str, int]] = field(default_factory=list)  # model scope: by layer
    shared_labels: tuple[str, ...] = ()  # labels of storages saved by more than one layer
    kernels: dict[str, list[str]] = field(default_factory=dict)  # torch op -> aten ops of interest


# ---------------------------------------------------------------------------------------------
# building and running the models


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def build_config(case: HFCase):
    tf = _transformers()
    f = case.ffn
    if case.arch == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=case.h, n_head=case.a, n_layer=case.L, n_positions=case.s, vocab_size=case.v, n_inner=f,
            resid_pdrop=case.p_drop, embd_pdrop=case.p_drop, attn_pdrop=case.p_drop,
            bos_token_id=0, eos_token_id=0,
        )
    else:
        cfg = tf.LlamaConfig(
            hidden_size=case.h, intermediate_size=f, num_attention_heads=case.a,
            num_key_value_heads=case.kv_heads, num_hidden_layers=case.L, vocab_size=case.v,
            max_position_embeddings=case.s, tie_word_embeddings=False, attention_dropout=case.p_drop,
            bos_token_id=0, eos_token_id=0, **({"head_dim": case.head_dim} if case.head_dim else {}),
        )
    cfg.loss_type = "ForCausalLM"
    return cfg


def build_model(case: HFCase):
    tf = _transformers()
    model = tf.AutoModelForCausalLM.from_config(
        build_config(case), dtype=getattr(torch, case.dtype), attn_implementation=case.attn)
    if case.lora_r:
        import peft

        # get_peft_model injects the adapters into `model` in place and freezes its own parameters; the
        # adapters are fp32 (autocast_adapter_dtype=True, peft's default, upcasts bf16 adapters)
        peft.get_peft_model(model, peft.LoraConfig(r=case.lora_r, lora_alpha=2 * case.lora_r, lora_dropout=case.lora_p,
                                                   target_modules=list(case.lora_targets) or None))
    return model.train()


def _base(model):
    return model.model if hasattr(model, "model") else model.transformer


def _decoder_layer(model):
    base = _base(model)
    return base.layers[0] if hasattr(base, "layers") else base.h[0]


def _layer_path(case: HFCase) -> str:
    return "model.layers.0" if case.arch == "llama" else "transformer.h.0"


def _forward_fresh(model, case: HFCase, scope: str) -> torch.Tensor:
    """This step's inputs are created here and die on return unless autograd saved them."""
    ids = torch.randint(0, case.v, (case.b, case.s))
    if scope == "model":
        targets = torch.randint(0, case.v, (case.b, case.s))
        return model(input_ids=ids, labels=targets, use_cache=False).loss
    from transformers.masking_utils import create_causal_mask

    base, layer = _base(model), _decoder_layer(model)
    pos = torch.arange(case.s).unsqueeze(0)  # what LlamaModel / GPT2Model build when given none
    with torch.no_grad():
        emb = base.embed_tokens(ids) if case.arch == "llama" else base.wte(ids) + base.wpe(pos)
    hidden = emb.detach().requires_grad_()
    mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None,
                              past_key_values=None, position_ids=pos)
    if case.arch == "llama":
        cos_sin = base.rotary_emb(hidden, position_ids=pos)
        out = layer(hidden, attention_mask=mask, position_embeddings=cos_sin, position_ids=pos, use_cache=False)
    else:
        out = layer(hidden, None, mask, use_cache=False, position_ids=pos)
    return out.sum()


@contextlib.contextmanager
def _fake_mode(enabled: bool):
    """FakeTensorMode, and one HF decision that reads tensor *values*, replayed.

    ``masking_utils.find_packed_sequence_indices`` looks at position_ids to detect packed
    sequences; with fake tensors it cannot read them and answers "packed", which materialises
    a mask that real runs never build (sdpa would then get an attn_mask instead of
    is_causal=True).  Our position ids are always ``arange(s)``: a real run returns None (not
    packed), so the fake run is told the same.  Tests check fake == real at small shapes.
    """
    if not enabled:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    import transformers.masking_utils as mu

    orig = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        with FakeTensorMode(allow_non_fake_inputs=False):
            yield
    finally:
        mu.find_packed_sequence_indices = orig


def _measure(case: HFCase, scope: str) -> HFMeasurement:
    case.check()
    if scope not in ("layer", "model"):
        raise ValueError("scope must be 'layer' or 'model'")
    with _fake_mode(case.backend == "fake"):
        torch.manual_seed(case.seed)
        model = build_model(case)
        if case.backend == "live":  # warm-up: lazy initialisation outside the window
            _forward_fresh(model, case, scope).backward()
            model.zero_grad(set_to_none=True)
            gc.collect()
        return _measure_step(model, case, scope)


def _measure_step(model, case: HFCase, scope: str) -> HFMeasurement:
    root = model if scope == "model" else _decoder_layer(model)
    modules = _ModuleStack(root, "" if scope == "model" else _layer_path(case))
    rec = _CallRecorder(modules)
    ledger = _HFLedger(list(model.parameters()), rec, modules)
    aten = _AtenLog(rec)
    tracker = LiveTracker() if case.backend in ("live", "fake") else None
    try:
        with (tracker or contextlib.nullcontext()):
            with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack), rec, aten:
                loss = _forward_fresh(model, case, scope)
            retained = tracker.live if tracker else None
            loss_bytes = loss.untyped_storage().nbytes()
            loss.backward()
            del loss
            peak = tracker.peak if tracker else None
    finally:
        modules.close()
    return _collect(case, scope, ledger, rec, aten, retained, peak, loss_bytes)


def _collect(case, scope, ledger: _HFLedger, rec, aten, retained, peak, loss_bytes) -> HFMeasurement:
    layer_rules, model_rules = RULES[case.arch]
    acts, params = [], []
    for key, r in ledger.records.items():
        module, op, k, j, call = ledger.ctx[key]
        module = module.lstrip(".")
        if op == SDPA:
            op = f"{SDPA}[{aten.kernel_tag(call)}]"
        layer, rel = split_module(module)
        rules = layer_rules if layer is not None else model_rules
        label = PARAMETER if r.is_param else rules.get((rel, op, k, j), UNLABELED)
        entry = SavedEntry(label, r.shape, r.dtype, r.nbytes, " + ".join(r.ops), module)
        item = (entry, (rel if layer is None else f"<layer>.{rel}".rstrip("."), op, k, j),
                rec.producers.get(key, "-").lstrip("."), [m.lstrip(".") for m in ledger.savers[key]])
        (params if r.is_param else acts).append(item)
    items = acts + params
    entries = [i[0] for i in items]
    by_label: dict[str, int] = {}
    for e in entries:
        if e.label != PARAMETER:
            by_label[e.label] = by_label.get(e.label, 0) + e.bytes
    per_layer: list[dict[str, int]] = []
    shared: list[str] = []
    if scope == "model":
        per_layer = [{} for _ in range(case.L)]
        for e, _, _, savers in acts:
            layers = sorted({split_module(m)[0] for m in savers} - {None})
            for i in layers:
                per_layer[i][e.label] = per_layer[i].get(e.label, 0) + e.bytes
            if len(layers) > 1 and e.label not in shared:
                shared.append(e.label)
    kernels: dict[str, list[str]] = {}
    for call, names in aten.by_call.items():
        op = aten.op_of_call[call]
        lst = kernels.setdefault(op, [])
        tag = [f"<{aten.kernel_tag(call)}>"] if op == SDPA else []
        for n in names + tag:
            if n not in lst:
                lst.append(n)
    return HFMeasurement(
        case=case,
        scope=scope,
        saved_bytes_by_label=by_label,
        entries=entries,
        saved_bytes_total=sum(by_label.values()),
        retained_after_forward_bytes=retained,
        peak_bytes=peak,
        loss_bytes=loss_bytes,
        saved_parameter_bytes=sum(e.bytes for e in entries if e.label == PARAMETER),
        notes=[f"{case.arch} attn={case.attn} g={case.kv_heads} transformers={_transformers().__version__}"],
        contexts=[i[1] for i in items],
        producers=[i[2] for i in items],
        savers=[i[3] for i in items],
        per_layer=per_layer,
        shared_labels=tuple(shared),
        kernels=kernels,
    )


# ---------------------------------------------------------------------------------------------
# public API


def measure_hf(
    arch: Arch,
    attn: Attn,
    s: int,
    b: int,
    h: int,
    a: int,
    f: int | None = None,
    g: int | None = None,
    head_dim: int | None = None,
    v: int = 512,
    L: int = 1,
    dropout: float = 0.0,
    scope: Literal["layer", "model"] = "layer",
    backend: Literal["ledger", "live", "fake"] = "ledger",
    seed: int = 0,
    lora: tuple[int, float, tuple[str, ...]] = (0, 0.0, ()),
) -> HFMeasurement:
    """Saved tensors of one decoder layer (``scope="layer"``) or of the whole ``*ForCausalLM``
    (``scope="model"``, loss included) of HF ``arch`` with ``attn_implementation=attn``, bf16,
    training mode, CPU (``backend="fake"``: FakeTensorMode, nothing allocated)."""
    case = HFCase(s=s, b=b, h=h, a=a, f=f, v=v, L=L, p_drop=dropout, backend=backend, seed=seed,
                  arch=arch, attn=attn, g=g, head_dim=head_dim, lora_r=lora[0], lora_p=lora[1], lora_targets=lora[2])
    return _measure(case, scope)


def format_table(m: HFMeasurement) -> str:
    rows = [("label", "shape", "dtype", "bytes", "saved by", "context (module, op, k, j)", "producer")]
    for e, ctx, prod in zip(m.entries, m.contexts, m.producers):
        if e.label == PARAMETER:
            continue
        rows.append((e.label, "x".join(map(str, e.shape)), e.dtype, str(e.bytes), f"{e.module}: {e.op}",
                     f"{ctx[0]} | {ctx[1]} | {ctx[2]} | {ctx[3]}", prod))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"saved total {m.saved_bytes_total:,}  retained {m.retained_after_forward_bytes}  "
                 f"peak {m.peak_bytes}  loss {m.loss_bytes}")
    lines.append(f"kernels: {m.kernels}")
    if m.shared_labels:
        lines.append(f"shared by layers: {m.shared_labels}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m validation.hf", description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=tuple(RULES), default="llama")
    p.add_argument("--attn", choices=("eager", "sdpa"), default="sdpa")
    p.add_argument("--scope", choices=("layer", "model"), default="layer")
    p.add_argument("--backend", choices=HF_BACKENDS, default="live")
    for name, default in (("s", 32), ("b", 2), ("h", 64), ("a", 4), ("v", 256), ("L", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--f", type=int, default=None)
    p.add_argument("--g", type=int, default=None)
    p.add_argument("--dropout", type=float, default=0.0)
    a = p.parse_args(argv)
    m = measure_hf(a.arch, a.attn, a.s, a.b, a.h, a.a, f=a.f, g=a.g, v=a.v, L=a.L, dropout=a.dropout, scope=a.scope,
                   backend=a.backend)
    print(m.notes[0], m.scope)
    print(format_table(m))


if __name__ == "__main__":
    main()
