"""Memory of a whole training step (forward, loss, backward, optimizer step), phase by phase.

Method
------
A model (the K22 reference ``layers.GPTModel``, HF transformers GPT-2 / Llama built from a
config by ``hf.build_model``, or another transformers family built by ``trace_config.build_model`` from its
small config in ``trace_config.FAMILIES``: ``StepCase.family``) and an optimizer (torch AdamW; or SGD with /
without momentum, Adafactor, Muon beside an AdamW: ``StepCase.algorithm``, ``ALGORITHMS``) run TWO
full training steps; only the second is measured, so the optimizer states exist and everything lazy
was initialised in step one.

* Before the measured step: ``gc.collect()``, then ``persistent`` is read off the tensors that are
  alive, by category, each storage once (``untyped_storage().nbytes()``): ``weights`` (model
  parameters), ``buffers`` (module buffers, e.g. Llama's rotary ``inv_freq``), ``gradients``
  (Megatron loop: the fp32 main-grad buffer; torch loop: 0, grads are None after zero_grad),
  ``master_weights`` (Megatron loop: fp32 copies), ``optimizer_states`` (every tensor of the
  optimizers' state but the step counters: AdamW's exp_avg and exp_avg_sq, SGD's momentum_buffer,
  Adafactor's row_var / col_var / variance, Muon's momentum_buffer) and ``optimizer_steps`` (AdamW's
  and Adafactor's ``step`` counters: one fp32 scalar tensor per parameter, kept separate from
  ``optimizer_states``).
* The step runs inside ``StepTracker``, a ``measure.LiveTracker`` (a ``TorchDispatchMode`` that
  follows every storage first created as an op output inside the window until it is freed).
  After every aten op it samples the live bytes and labels the sample with the current
  (phase, layer, micro-batch).  Absolute bytes = ``persistent_total`` + live bytes.
* Labels.  ``phase``: ``"forward"`` (inputs, embedding: layer None; decoder layer ``i``: layer
  ``i``), ``"loss"`` (from the end of the last decoder layer's forward: final norm, LM head,
  logits, cross-entropy, the division by the number of micro-batches), ``"backward"`` (layer None
  for the loss / head / final norm part and for the embedding part; layer ``i`` from the moment
  the gradient of layer ``i``'s output is complete until that of its input is, which includes the
  recompute forward of a checkpointed layer and the AccumulateGrad of its parameters), and
  ``"optimizer"`` (``optimizer.step``, ``zero_grad``, and in the Megatron loop the fp32 -> bf16
  copy; micro-batch None).  Forward labels come from forward pre/post hooks on the decoder layers
  (ignored while the phase is "backward": that is a checkpoint recompute); backward labels from
  tensor hooks (``Tensor.register_hook``) registered in forward on each layer's output and on
  layer 0's input.  Tensor hooks do not change the autograd graph (module full-backward hooks
  would insert ``BackwardHookFunction`` nodes).
* ``timeline``: one ``Segment`` per contiguous run of samples with the same label, with the
  maximum and the final absolute bytes.  ``ops=True`` also keeps the op-level log.

Training loops (``StepCase.loop``)
----------------------------------
* ``"torch"`` ("bf16-true", HF fine-tuning with bf16 weights): bf16 parameters,
  ``torch.optim.AdamW(lr=1e-4, weight_decay=0.01, foreach= / fused=)`` on them (bf16 states; the
  other optimizers as ``_optimizers`` sets them up);
  per micro-batch forward + ``(loss / M).backward()``; then ``step()`` and
  ``zero_grad(set_to_none=True)``.
* ``"megatron"`` ("bf16-mixed", Megatron-LM's DDP + mixed-precision optimizer): bf16
  parameters; one contiguous fp32 main-grad buffer (allocated before the step, zeroed in place at
  the start of each step: labelled forward, micro-batch 0; it allocates nothing),
  ``param.main_grad`` a view into it; a post-accumulate-grad hook per
  parameter does ``main_grad.add_(grad); grad = None`` (the bf16 grad is transient); fp32 master
  copies whose ``.grad`` are the main-grad views; AdamW on the masters; ``_foreach_copy_``
  master -> bf16 parameters.  No gradient clipping, no loss scaling.

Backends: ``"live"`` (real CPU tensors), ``"fake"`` (everything, optimizer included, under
``FakeTensorMode``; HF through ``hf._fake_mode``), so paper-scale shapes run without allocating,
and ``"cuda"`` (models and inputs on the GPU through a ``torch.device("cuda")`` context; the peak is
``torch.cuda.max_memory_allocated()`` over the measured step, after ``reset_peak_memory_stats``:
allocator blocks, 512-byte rounding and kernels' internal workspaces included; the labelled
timeline still comes from the tracker). The cuda backend has not run on a GPU in this repository yet.

Limits
------
* Only storages created by aten ops inside the window are seen.  Scratch memory a CPU kernel
  allocates and frees internally (e.g. inside a fused AdamW kernel, a matmul's packing buffers,
  flash attention's per-thread buffers) is invisible, and so is the CUDA caching allocator's
  rounding and fragmentation: these are byte counts of tensors, not of an allocator.
* The peak is sampled after every op (and at label changes): a transient freed by the op that
  made it is not seen; a ``_foreach_*`` op is one sample that includes all its outputs.
* CPU code paths, not CUDA ones: e.g. HF sdpa on CPU reaches the CPU flash kernel only with
  dropout 0 (otherwise the fp32 math path); the k22 model uses ``native_dropout`` on purpose.

Nothing here computes a byte count from a formula; every number is read off a tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Literal

import torch
from torch.utils import _pytree as pytree

from .layers import LayerConfig, GPTModel
from .measure import LiveTracker, _forward_fresh
from .parallel import SimulatedComm

PHASES = ("forward", "loss", "backward", "optimizer")


@dataclass(frozen=True, kw_only=True)
class StepCase:
    """One training step to measure.  ``f`` None means 4h (pass Llama's explicitly; a family: its config's)."""

    model: Literal["k22", "gpt2", "llama", "family"]
    attn: Literal["eager", "sdpa"] = "eager"  # HF only; k22 always runs its own eager attention
    s: int
    b: int
    h: int
    a: int
    L: int = 2
    v: int = 512
    f: int | None = None
    g: int | None = None  # Llama KV heads (None: a)
    head_dim: int | None = None  # Llama width of one head (None: h/a)
    p_drop: float = 0.0  # every dropout of the model (HF sdpa on CPU needs 0 for the flash kernel)
    recompute: Literal["none", "selective", "full"] = "none"  # HF: "none" or "full"
    loop: Literal["torch", "megatron", "in-backward"] = "torch"
    optimizer: Literal["foreach", "fused", "for-loop"] = "foreach"  # the implementation (torch's foreach= / fused=)
    algorithm: Literal["adamw", "sgd", "sgd-nomomentum", "adafactor", "muon"] = "adamw"  # ALGORITHMS
    microbatches: int = 1  # gradient accumulation: M forward/backward passes, one optimizer step
    loss_chunks: int = 1  # > 1 computes LM head + loss in that many checkpointed chunks (losses.py)
    # HF Llama: MsT mini-sequences (validation/mst.py): the MLP of every layer in mst_mlp pieces, the LM head +
    # loss in mst_head pieces (0: that block as transformers runs it)
    mst_mlp: int = 0
    mst_head: int = 0
    backend: Literal["live", "fake", "cuda"] = "live"
    dtype: str = "bfloat16"
    seed: int = 0
    # model "family": a transformers family of validation/trace_config.py FAMILIES (qwen2, gemma2, ...), its small
    # config with this case's h, a, L, v (and f, g, head_dim where given); attn picks its implementation, and
    # gradient checkpointing is enabled as for Llama
    family: str | None = None
    lora: int = 0  # HF Llama: peft LoRA of this rank (validation/hf.py build_model), the base frozen; 0: none
    lora_targets: tuple[str, ...] = ()  # empty: peft's default for the family

    @property
    def ffn(self) -> int:
        return 4 * self.h if self.f is None else self.f

    def check(self) -> None:
        if self.model not in ("k22", "gpt2", "llama", "family"):
            raise ValueError("model must be 'k22', 'gpt2', 'llama' or 'family'")
        if (self.model == "family") != (self.family is not None):
            raise ValueError("model 'family' needs a family (validation.trace_config.FAMILIES), and only it takes one")
        if self.family is not None:
            from .trace_config import FAMILIES

            if self.family not in FAMILIES:
                raise ValueError(f"family must be one of {', '.join(FAMILIES)}")
            if self.loss_chunks > 1 or self.p_drop:
                raise ValueError("a family runs its own config's loss and dropout (loss_chunks 1, p_drop 0)")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError("recompute must be 'none', 'selective' or 'full'")
        if self.model != "k22" and self.recompute == "selective":
            raise ValueError("HF models support recompute 'none' or 'full' (gradient checkpointing)")
        if self.model == "k22" and self.g not in (None, self.a):
            raise ValueError("the k22 model has no grouped-query attention")
        if self.loop not in ("torch", "megatron", "in-backward") or self.optimizer not in ("foreach", "fused",
                                                                                          "for-loop"):
            raise ValueError("loop must be torch/megatron/in-backward and optimizer foreach/fused/for-loop")
        if self.loop == "in-backward" and (self.model != "llama" or self.algorithm != "adamw"
                                           or self.optimizer != "for-loop" or self.microbatches != 1):
            raise ValueError("the in-backward loop steps a for-loop AdamW per parameter of the HF Llama model, "
                             "one micro-batch")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}")
        if self.optimizer not in ALGORITHMS[self.algorithm] and self.loop != "in-backward":
            raise ValueError(f"{self.algorithm} runs {' or '.join(ALGORITHMS[self.algorithm])}, not {self.optimizer}")
        if self.backend not in ("live", "fake", "cuda") or self.microbatches < 1:
            raise ValueError("backend must be live/fake/cuda and microbatches >= 1")
        if self.loss_chunks < 1 or self.s % self.loss_chunks:
            raise ValueError("loss_chunks >= 1, dividing s")
        if (self.mst_mlp or self.mst_head) and (self.model != "llama" or self.loss_chunks > 1
                                                 or min(self.mst_mlp, self.mst_head) < 0):
            raise ValueError("MsT (mst_mlp, mst_head >= 0) runs on the HF Llama model, without loss_chunks")


@dataclass(frozen=True)
class Segment:
    """A contiguous run of samples with one label; bytes are absolute (persistent + live)."""

    phase: str
    layer: int | None
    microbatch: int | None
    max_bytes: int
    end_bytes: int
    n_ops: int


@dataclass(frozen=True)
class OpSample:
    """One aten op of the window: live bytes after it (absolute) and bytes of the new storages
    its outputs brought (``outputs`` describes those new storages: dtype[shape])."""

    phase: str
    layer: int | None
    microbatch: int | None
    op: str
    live_bytes: int
    allocated: int
    outputs: str


@dataclass
class StepMeasurement:
    case: StepCase
    persistent: dict[str, int]  # category -> bytes alive before the measured step
    persistent_total: int
    peak_bytes: int  # persistent_total + max live bytes in the window; cuda: torch.cuda.max_memory_allocated()
    peak_phase: str
    peak_layer: int | None
    peak_microbatch: int | None
    peak_op: str
    timeline: list[Segment]
    retained_after_forward: int  # live bytes in the window when micro-batch 0's loss is computed
    grad_bytes_at_end_of_backward: int  # model params' .grad storages after the last backward
    live_at_end: int  # live bytes in the window after the optimizer phase (0 in a steady state)
    ops: list[OpSample] | None = None
    notes: list[str] = field(default_factory=list)
    tracked_peak_bytes: int = 0  # persistent_total + the live tracker's max (equals peak_bytes off CUDA)

    def segments(self, phase: str | None = None, layer: int | None | str = "any",
                 microbatch: int | None | str = "any") -> list[Segment]:
        return [g for g in self.timeline if (phase is None or g.phase == phase)
                and (layer == "any" or g.layer == layer) and (microbatch == "any" or g.microbatch == microbatch)]

    def phase_peak(self, phase: str) -> int:
        """Largest absolute bytes over the segments of ``phase``."""
        return max(g.max_bytes for g in self.segments(phase))


# ---------------------------------------------------------------------------------------------
# the tracker


def _short_dtype(dt: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.int64: "i64",
            torch.bool: "bool"}.get(dt, str(dt).replace("torch.", ""))


class StepTracker(LiveTracker):
    """``LiveTracker`` that samples live bytes after every op under a (phase, layer, micro-batch)
    label, keeps the condensed timeline, the labelled peak and optionally an op-level log."""

    def __init__(self, base: int, keep_ops: bool = False) -> None:
        super().__init__()
        self.base = base  # persistent bytes, added to every recorded figure
        self.phase: str = "forward"
        self.layer: int | None = None
        self.microbatch: int | None = 0
        self.segments: list[list] = []  # [phase, layer, mb, max, end, n_ops]
        self.ops: list[OpSample] | None = [] if keep_ops else None
        self.max_live = 0
        self.peak_label: tuple = ("forward", None, 0, "-")
        self._new: list[torch.Tensor] = []

    @property
    def label(self) -> tuple:
        return (self.phase, self.layer, self.microbatch)

    def set(self, **label) -> None:
        """Change the label; the open segment first records the live bytes at this moment
        (frees since its last op)."""
        if self.segments and tuple(self.segments[-1][:3]) == self.label:
            seg = self.segments[-1]
            seg[4] = self.base + self.live
            seg[3] = max(seg[3], seg[4])
        for k, v in label.items():
            setattr(self, k, v)

    def _sample(self, op: str, allocated: int, outputs: str) -> None:
        absolute = self.base + self.live
        if self.segments and tuple(self.segments[-1][:3]) == self.label:
            seg = self.segments[-1]
            seg[3], seg[4], seg[5] = max(seg[3], absolute), absolute, seg[5] + 1
        else:
            self.segments.append([*self.label, absolute, absolute, 1])
        if self.live > self.max_live:
            self.max_live = self.live
            self.peak_label = (*self.label, op)
        if self.ops is not None:
            self.ops.append(OpSample(*self.label, op, absolute, allocated, outputs))

    def _see_output(self, t: torch.Tensor) -> None:
        before = self.live
        super()._see_output(t)
        if self.live != before:
            self._new.append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._new = []
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func.namespace == "prim":  # prim.device etc. (FakeTensorMode): no storage, no sample
            return out
        new, self._new = self._new, []
        allocated = sum(t.untyped_storage().nbytes() for t in new)
        desc = ""
        if self.ops is not None and new:
            desc = " ".join(f"{_short_dtype(t.dtype)}{list(t.shape)}" for t in new)
        self._sample(str(func.overloadpacket).replace("aten.", ""), allocated, desc)
        return out

    def timeline(self) -> list[Segment]:
        return [Segment(*s) for s in self.segments]


class _LayerHooks:
    """Phase / layer labels from forward hooks on the decoder layers and tensor hooks on their
    outputs (backward of layer i starts) and on layer 0's input (backward of the layers ends)."""

    def __init__(self, tracker: StepTracker, layers) -> None:
        self.tracker, self.n = tracker, len(layers)
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(partial(self._pre, i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(partial(self._post, i), with_kwargs=True))

    @staticmethod
    def _first_tensor(x) -> torch.Tensor | None:
        return next((t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)), None)

    def _pre(self, i, mod, args, kwargs):
        tr = self.tracker
        if tr.phase == "backward":  # a checkpointed layer's recompute: stays labelled backward, layer i
            return
        tr.set(phase="forward", layer=i)
        x = self._first_tensor((args, kwargs))
        if i == 0 and x is not None and x.requires_grad:
            x.register_hook(lambda g: tr.set(phase="backward", layer=None))

    def _post(self, i, mod, args, kwargs, out):
        tr = self.tracker
        if tr.phase == "backward":
            return
        y = self._first_tensor(out)
        if y is not None and y.requires_grad:
            y.register_hook(lambda g: tr.set(phase="backward", layer=i))
        tr.set(phase="loss" if i == self.n - 1 else "forward", layer=None)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


LayerHooks = _LayerHooks  # the labels, for other loops that drive the same tracker (validation/trainer_loop.py)


# ---------------------------------------------------------------------------------------------
# models, loops


def _hf():
    """``validation.hf``, imported on first use (it sets HF_HUB_OFFLINE for transformers)."""
    from . import hf

    return hf


def _hf_case(case: StepCase):
    return _hf().HFCase(s=case.s, b=case.b, h=case.h, a=case.a, f=case.ffn, v=case.v, L=case.L,
                        p_drop=case.p_drop, dtype=case.dtype, seed=case.seed, arch=case.model,
                        attn=case.attn, g=case.g, head_dim=case.head_dim, backend="live", lora_r=case.lora,
                        lora_targets=case.lora_targets)


def _build(case: StepCase):
    """(model, decoder layers, forward function returning the loss of one fresh micro-batch)."""
    dtype = getattr(torch, case.dtype)
    torch.manual_seed(case.seed)
    if case.model == "k22":
        cfg = LayerConfig(h=case.h, a=case.a, f=case.ffn, recompute=case.recompute, p_drop=case.p_drop)
        comm = SimulatedComm(0, 1)
        device = "cuda" if case.backend == "cuda" else "cpu"
        model = GPTModel(cfg, case.L, case.v, case.s, comm, dtype=dtype, device=device).train()
        model.loss_chunks = case.loss_chunks
        return model, list(model.layers), partial(_forward_fresh, model, case, "model", comm, dtype, device)
    hf = _hf()
    if case.family is not None:
        from . import trace_config

        config = family_config(case.family, case.h, case.a, case.L, case.v, case.f, case.g, case.head_dim)
        model = trace_config.build_model(config, f"hf-{case.attn}", case.dtype)
    else:
        hcase = _hf_case(case)
        model = hf.build_model(hcase)
    if case.recompute == "full":  # transformers 5.x renamed gradient_checkpointing_enable (deprecated alias)
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    base = hf._base(model)
    layers = list(base.layers if hasattr(base, "layers") else base.h)
    if case.family is not None:
        return model, layers, partial(_forward_family, model, case)
    if case.mst_mlp:
        from .mst import wrap_mlps

        wrap_mlps(layers, case.mst_mlp)
    if case.mst_head:
        return model, layers, partial(_forward_mst_loss, model, case)
    if case.loss_chunks > 1:
        return model, layers, partial(_forward_chunked_loss, model, case)
    return model, layers, partial(hf._forward_fresh, model, hcase, "model")


def family_config(family: str, h: int, a: int, L: int, v: int, f: int | None = None, g: int | None = None,
                  head_dim: int | None = None) -> dict:
    """The config.json (a dict) of a family case: validation/trace_config.py FAMILIES' small config of
    ``family`` with h, a, L, v and, where given (not None), f, g and head_dim."""
    from .trace_config import FAMILIES

    cfg = dict(FAMILIES[family][0])
    cfg.update(hidden_size=h, num_attention_heads=a, num_hidden_layers=L, vocab_size=v)
    for key, value in (("intermediate_size", f), ("num_key_value_heads", g), ("head_dim", head_dim)):
        if value is not None:
            cfg[key] = value
    return cfg


def _forward_family(model, case: StepCase) -> torch.Tensor:
    """A family model's loss on fresh random ids and labels (transformers' own ForCausalLM loss)."""
    ids = torch.randint(0, case.v, (case.b, case.s))
    targets = torch.randint(0, case.v, (case.b, case.s))
    return model(input_ids=ids, labels=targets, use_cache=False).loss


def _forward_chunked_loss(model, case: StepCase) -> torch.Tensor:
    """A transformers model's forward up to the final norm, then the LM head and cross-entropy in
    ``case.loss_chunks`` checkpointed chunks (validation/losses.py) instead of ForCausalLMLoss."""
    from .losses import chunked_cross_entropy

    ids = torch.randint(0, case.v, (case.b, case.s))
    targets = torch.randint(0, case.v, (case.b, case.s))
    hidden = hf_base_forward(model, ids)
    return chunked_cross_entropy(hidden, model.lm_head.weight, targets, case.loss_chunks)


def _forward_mst_loss(model, case: StepCase) -> torch.Tensor:
    """A transformers model's forward up to the final norm, then MsT's LM head + loss in ``case.mst_head``
    pieces (validation/mst.py) instead of ForCausalLMLoss."""
    from .mst import mini_sequence_loss

    ids = torch.randint(0, case.v, (case.b, case.s))
    targets = torch.randint(0, case.v, (case.b, case.s))
    hidden = hf_base_forward(model, ids)
    return mini_sequence_loss(hidden, model.lm_head.weight, targets, case.mst_head)


def hf_base_forward(model, ids: torch.Tensor) -> torch.Tensor:
    return _hf()._base(model)(input_ids=ids, use_cache=False).last_hidden_state


def _unique_params(model) -> list[torch.nn.Parameter]:
    return list(model.parameters())  # nn.Module.parameters() already yields a tied weight once


# The optimizers a step can use and the implementations each has in torch 2.13 (torch/optim/):
# adamw.py / adam.py (foreach, fused), sgd.py (foreach, fused), _adafactor.py (for-loop, its default,
# or foreach; no fused), _muon.py (for-loop only: foreach raises; 2-D parameters only, so the
# embeddings, the LM head and the 1-D gains and biases go to an AdamW beside it, as Keller Jordan's
# MuonWithAuxAdam: the implementation named here is that AdamW's).
ALGORITHMS = {"adamw": ("foreach", "fused"), "sgd": ("foreach", "fused"), "sgd-nomomentum": ("foreach", "fused"),
              "adafactor": ("for-loop", "foreach"), "muon": ("foreach", "fused")}


def _adamw(params, case: StepCase) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=case.optimizer == "foreach",
                             fused=case.optimizer == "fused")


def _optimizers(params: list[torch.Tensor], hidden: set[int], case: StepCase) -> list[torch.optim.Optimizer]:
    """The case's optimizer(s) over ``params``; ``hidden``: ids of the 2-D weights inside the decoder
    layers (Muon's share). Settings: weight decay 0.01 everywhere (SGD's is coupled: it adds
    weight_decay x param to the gradient; the others decay the parameter in place), SGD momentum 0.9
    (0 for sgd-nomomentum: torch keeps no momentum_buffer then), Adafactor and Muon torch's defaults."""
    algo, impl = case.algorithm, case.optimizer
    if algo == "adamw":
        return [_adamw(params, case)]
    if algo in ("sgd", "sgd-nomomentum"):
        momentum = 0.9 if algo == "sgd" else 0.0
        return [torch.optim.SGD(params, lr=1e-4, momentum=momentum, weight_decay=0.01, foreach=impl == "foreach",
                                fused=impl == "fused")]
    if algo == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-2, weight_decay=0.01, foreach=impl == "foreach")]
    muon = [p for p in params if id(p) in hidden]
    rest = [p for p in params if id(p) not in hidden]
    return [torch.optim.Muon(muon, lr=0.02, weight_decay=0.01), _adamw(rest, case)]


def _in_backward(model, params: list[torch.Tensor]) -> list[torch.optim.Optimizer]:
    """The optimizer step inside the backward (PyTorch's "optimizer step in backward" recipe, as MsT's
    scripts/benchmark_minis.py runs it): one for-loop AdamW per parameter, stepped by a post-accumulate-grad
    hook that then frees the parameter's .grad; the LM head's step waits for the embedding's (MsT: "Delay
    optimizer.step() in lm_head to reduce peak memory"), which the embedding's hook runs after its own."""
    opts = {id(p): torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, foreach=False, fused=False) for p in params}
    head, embedding = model.lm_head.weight, model.get_input_embeddings().weight

    def step(p: torch.Tensor) -> None:
        if p is head:
            return
        for q in (p, head) if p is embedding else (p,):
            if q.grad is not None:
                opts[id(q)].step()
                q.grad = None

    for p in params:
        p.register_post_accumulate_grad_hook(step)
    return list(opts.values())


def _accumulate_main_grad(p: torch.Tensor) -> None:
    """Megatron DDP's grad hook: fold the (transient) bf16 grad into the fp32 main grad."""
    p.main_grad.add_(p.grad)
    p.grad = None


class _Loop:
    """The training loop: ``step(tracker)`` runs one full step (``tracker`` None: warm-up)."""

    def __init__(self, case: StepCase, model, forward: Callable[[], torch.Tensor], layers=()) -> None:
        self.case, self.model, self.forward = case, model, forward
        self.params = _unique_params(model)
        hidden = {id(p) for layer in layers for p in layer.parameters() if p.ndim == 2}
        self.main_grad: torch.Tensor | None = None
        self.masters: list[torch.Tensor] = []
        if case.loop == "in-backward":
            self.opts = _in_backward(model, self.params)
        elif case.loop == "megatron":
            n = sum(p.numel() for p in self.params)
            self.main_grad = torch.zeros(n, dtype=torch.float32)
            off = 0
            for p in self.params:
                p.main_grad = self.main_grad[off:off + p.numel()].view_as(p)
                off += p.numel()
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)
                master = p.detach().float()  # a new fp32 tensor (not a view)
                master.grad = p.main_grad
                self.masters.append(master)
            hidden = {id(m) for p, m in zip(self.params, self.masters) if id(p) in hidden}
            self.opts = _optimizers(self.masters, hidden, case)
        else:
            self.opts = _optimizers(self.params, hidden, case)
        self.retained_after_forward = 0
        self.grad_bytes_at_end_of_backward = 0

    def step(self, tr: StepTracker | None) -> None:
        label = tr.set if tr is not None else (lambda **kw: None)
        M = self.case.microbatches
        label(phase="forward", layer=None, microbatch=0)
        if self.main_grad is not None:
            self.main_grad.zero_()
        for mb in range(M):
            label(phase="forward", layer=None, microbatch=mb)
            loss = self.forward()
            label(phase="loss", layer=None)
            if mb == 0 and tr is not None:
                self.retained_after_forward = tr.live
            if M > 1:
                loss = loss / M
            label(phase="backward", layer=None)
            loss.backward()
            del loss
        label(phase="backward", layer=None)  # records the end of the last backward
        self.grad_bytes_at_end_of_backward = _storage_bytes(p.grad for p in self.params)
        label(phase="optimizer", layer=None, microbatch=None)
        if self.case.loop == "in-backward":  # every parameter was stepped (and its .grad freed) in the backward
            label(phase="optimizer", layer=None, microbatch=None)
            return
        for opt in self.opts:
            opt.step()
        if self.main_grad is None:
            for opt in self.opts:
                opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        label(phase="optimizer", layer=None, microbatch=None)


def _storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the distinct storages of ``tensors`` (None skipped; ``seen`` shared across calls)."""
    seen = set() if seen is None else seen
    n = 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            n += st.nbytes()
    return n


def _persistent(loop: _Loop) -> dict[str, int]:
    seen: set = set()
    states = [opt.state[p] for opt in loop.opts for g in opt.param_groups for p in g["params"] if p in opt.state]
    grads = [p.grad for p in loop.params] + [m.grad for m in loop.masters]
    return {
        "weights": _storage_bytes(loop.params, seen),
        "buffers": _storage_bytes(loop.model.buffers(), seen),
        "gradients": _storage_bytes([loop.main_grad] + grads, seen),
        "master_weights": _storage_bytes(loop.masters, seen),
        "optimizer_states": _storage_bytes((v for s in states for k, v in s.items()
                                            if k != "step" and isinstance(v, torch.Tensor)), seen),
        "optimizer_steps": _storage_bytes((s["step"] for s in states if isinstance(s.get("step"), torch.Tensor)), seen),
    }


def _mode(case: StepCase):
    if case.backend == "cuda":  # models, inputs and buffers made by factory calls go to the GPU
        return torch.device("cuda")
    if case.backend != "fake":
        return contextlib.nullcontext()
    if case.model != "k22":
        return _hf()._fake_mode(True)
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


# ---------------------------------------------------------------------------------------------
# public API


def measure_step(case: StepCase, ops: bool = False) -> StepMeasurement:
    """Run two training steps of ``case``; measure the second (see the module docstring)."""
    case.check()
    with _mode(case):
        model, layers, forward = _build(case)
        loop = _Loop(case, model, forward, layers)
        loop.step(None)  # warm-up: optimizer states, lazy initialisation
        gc.collect()
        persistent = _persistent(loop)
        total = sum(persistent.values())
        tracker = StepTracker(total, keep_ops=ops)
        hooks = _LayerHooks(tracker, layers)
        cuda = case.backend == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:
            with tracker:
                loop.step(tracker)
        finally:
            hooks.close()
        allocator_peak = None
        if cuda:
            torch.cuda.synchronize()
            allocator_peak = torch.cuda.max_memory_allocated()
    phase, layer, mb, op = tracker.peak_label
    notes = [f"torch {torch.__version__}"]
    if case.model != "k22":
        notes.append(f"transformers {_hf()._transformers().__version__}")
    return StepMeasurement(
        case=case, persistent=persistent, persistent_total=total,
        peak_bytes=allocator_peak if cuda else total + tracker.max_live, tracked_peak_bytes=total + tracker.max_live,
        peak_phase=phase, peak_layer=layer, peak_microbatch=mb, peak_op=op, timeline=tracker.timeline(),
        retained_after_forward=loop.retained_after_forward,
        grad_bytes_at_end_of_backward=loop.grad_bytes_at_end_of_backward, live_at_end=tracker.live,
        ops=tracker.ops, notes=notes,
    )


# ---------------------------------------------------------------------------------------------
# CLI


def _fmt_label(phase, layer, mb) -> str:
    return f"{phase:<9} {'-' if layer is None else layer:>5} {'-' if mb is None else mb:>3}"


def format_report(m: StepMeasurement, ops: bool = False, phase: str | None = None,
                  layer: int | None | str = "any") -> str:
    lines = [f"{m.case}", *(f"note: {n}" for n in m.notes), "", "persistent (before the step):"]
    lines += [f"  {k:<18} {v:>16,}" for k, v in m.persistent.items()]
    lines.append(f"  {'total':<18} {m.persistent_total:>16,}")
    lines += ["", "timeline (absolute bytes = persistent + live in the step):",
              f"  {'phase':<9} {'layer':>5} {'mb':>3} {'max':>16} {'end':>16} {'ops':>6}"]
    lines += [f"  {_fmt_label(g.phase, g.layer, g.microbatch)} {g.max_bytes:>16,} {g.end_bytes:>16,} {g.n_ops:>6}"
              for g in m.timeline]
    lines += ["", f"peak {m.peak_bytes:,} = persistent {m.persistent_total:,} + {m.peak_bytes - m.persistent_total:,}"
              f" at {m.peak_phase} layer {m.peak_layer} mb {m.peak_microbatch} after {m.peak_op}",
              f"retained after forward (mb 0, live in step) {m.retained_after_forward:,}",
              f"grad bytes at end of backward {m.grad_bytes_at_end_of_backward:,}",
              f"live at end of step {m.live_at_end:,}"]
    if ops and m.ops is not None:
        lines += ["", "op log (live = absolute bytes after the op; new = bytes of new output storages):",
                  f"  {'phase':<9} {'layer':>5} {'mb':>3} {'op':<40} {'live':>14} {'new':>12}  outputs"]
        for o in m.ops:
            if (phase is None or o.phase == phase) and (layer == "any" or o.layer == layer):
                lines.append(f"  {_fmt_label(o.phase, o.layer, o.microbatch)} {o.op:<40} {o.live_bytes:>14,}"
                             f" {o.allocated:>12,}  {o.outputs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m validation.step", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("k22", "gpt2", "llama"), default="llama")
    p.add_argument("--family", default=None, help="a transformers family of validation/trace_config.py FAMILIES "
                   "(qwen2, gemma2, ...) instead of --model: its small config, with h, a, L, v, f, g, head_dim where given")
    p.add_argument("--attn", choices=("eager", "sdpa"), default="eager")
    for name, default in (("s", 64), ("b", 1), ("M", 1), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("h", 64), ("a", 4), ("L", 2), ("v", 512)):
        p.add_argument(f"--{name}", type=int, default=None, help=f"default {default} (--family: its config's)")
    p.add_argument("--f", type=int, default=None)
    p.add_argument("--g", type=int, default=None)
    p.add_argument("--head_dim", type=int, default=None)
    p.add_argument("--loss_chunks", type=int, default=1, help="LM head + loss in this many checkpointed chunks")
    p.add_argument("--mst_mlp", type=int, default=0, help="HF Llama: MsT, the MLP in this many pieces")
    p.add_argument("--mst_head", type=int, default=0, help="HF Llama: MsT, the LM head + loss in this many pieces")
    p.add_argument("--p_drop", type=float, default=0.0)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--loop", choices=("torch", "megatron", "in-backward"), default="torch")
    p.add_argument("--optimizer", choices=("foreach", "fused", "for-loop"), default="foreach",
                   help="the implementation")
    p.add_argument("--algorithm", choices=tuple(ALGORITHMS), default="adamw")
    p.add_argument("--backend", choices=("live", "fake", "cuda"), default="live")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ops", action="store_true", help="print the op-level log")
    p.add_argument("--phase", choices=PHASES, default=None, help="with --ops: only this phase")
    p.add_argument("--layer", default="any", help="with --ops: only this layer ('none' for no layer)")
    a = p.parse_args(argv)
    shape = {"h": 64, "a": 4, "L": 2, "v": 512}
    if a.family is not None:
        from .trace_config import FAMILIES

        cfg = FAMILIES[a.family][0]
        shape = {"h": cfg["hidden_size"], "a": cfg["num_attention_heads"], "L": cfg["num_hidden_layers"],
                 "v": cfg["vocab_size"]}
    for name in shape:
        if getattr(a, name) is None:
            setattr(a, name, shape[name])
    case = StepCase(model="family" if a.family else a.model, family=a.family, attn=a.attn, s=a.s, b=a.b, h=a.h,
                    a=a.a, L=a.L, v=a.v, f=a.f, g=a.g,
                    head_dim=a.head_dim, loss_chunks=a.loss_chunks, mst_mlp=a.mst_mlp, mst_head=a.mst_head, p_drop=a.p_drop, recompute=a.recompute, loop=a.loop, optimizer=a.optimizer,
                    algorithm=a.algorithm, microbatches=a.M, backend=a.backend, dtype=a.dtype, seed=a.seed)
    layer = a.layer if a.layer == "any" else (None if a.layer == "none" else int(a.layer))
    print(format_report(measure_step(case, ops=a.ops), ops=a.ops, phase=a.phase, layer=layer))


if __name__ == "__main__":
    main()
