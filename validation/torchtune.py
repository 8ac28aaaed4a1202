"""What torchtune 0.6.1's Llama saves for backward: traced with memplan's tracer (validation/trace.py) and
measured in a real CPU run (``measure_torchtune_llama``).

torchtune's ``llama3_2`` builder (the same TransformerDecoder as llama3 / 3.1) is built under FakeTensorMode in
bf16 (torchtune's recipes build under ``set_default_dtype(bfloat16)``) and run forward + cross-entropy on the
logits with symbolic s and b, as its recipes' _loss_step
computes a torch.nn.CrossEntropyLoss. One change to its code: ``Llama3ScaledRoPE.apply_scaling`` reads the
frequencies' values (a data-dependent branch under fake tensors), so the trace skips the scaling: it changes
the cache's values, not its shape, and the cache is a buffer (never counted as saved).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from unittest import mock

import torch

from validation.instruments import LiveTracker, saved_storages
from validation.trace_poly import poly_text
from validation.trace_run import symbolic_saves


@contextlib.contextmanager
def _bf16_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def import_torchtune():
    """torchtune's modules import ``torchao.dtypes.nf4tensor`` (for QLoRA), which torchao 0.12+ moved to
    ``torchao.quantization.quantize_.workflows.nf4.nf4_tensor``; peft (the test extra) needs torchao > 0.16, so
    the old name is pointed at the new module (NF4Tensor is not used by the full-weight model measured here)."""
    try:
        importlib.import_module("torchao.dtypes.nf4tensor")
    except ImportError:
        sys.modules["torchao.dtypes.nf4tensor"] = importlib.import_module(
            "torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    return importlib.import_module("torchtune")


# memplan's LoRA target names -> torchtune's (lora_attn_modules; the MLP's w1 / w3 / w2)
TUNE_NAMES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "output_proj",
              "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _build(vocab, layers, heads, kv_heads, hidden, ffn, checkpoint, lora=None):
    """torchtune's llama3_2 builder in bf16; ``lora``: dict(rank, targets (memplan's names), dropout, qlora) builds
    its lora_llama3_2 instead (LoRALinear on the targets; every layer linear NF4 with qlora) with only the adapters
    trainable (set_trainable_params(get_adapter_params), as lora_finetune_single_device)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import_torchtune()
    from torchtune.models.llama3_2 import llama3_2, lora_llama3_2
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    shape = dict(vocab_size=vocab, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, embed_dim=hidden,
                 max_seq_len=4096, intermediate_dim=ffn, tie_word_embeddings=False)
    with _bf16_default():
        if lora is None:
            model = llama3_2(**shape)
        else:
            targets = set(lora["targets"])
            mlp = {"gate_proj", "up_proj", "down_proj"}
            if targets & mlp and not mlp <= targets:
                raise ValueError("torchtune's apply_lora_to_mlp adapts w1, w2 and w3 together")
            model = lora_llama3_2([TUNE_NAMES[t] for t in sorted(targets - mlp)], apply_lora_to_mlp=bool(targets & mlp),
                                  lora_rank=lora["rank"], lora_alpha=2 * lora["rank"], lora_dropout=lora["dropout"],
                                  quantize_base=lora.get("qlora", False), **shape)
            set_trainable_params(model, get_adapter_params(model))
    if checkpoint:
        # what torchtune.training.set_activation_checkpointing does (torchtune/training/memory.py; that package
        # imports torchao's quantization APIs of before 0.12): non-reentrant checkpoint_wrapper per layer
        apply_activation_checkpointing(model, auto_wrap_policy=ModuleWrapPolicy({TransformerSelfAttentionLayer}))
    return model.train()


def _forward(model, tokens, labels):
    """full_finetune_single_device's _loss_step with a torch.nn.CrossEntropyLoss loss (TransformerDecoder returns
    the output projection's logits upcast to fp32, so the loss keeps an fp32 log-softmax)."""
    logits = model(tokens)
    return torch.nn.CrossEntropyLoss()(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def measure_torchtune_llama(s: int, b: int, vocab: int, layers: int, heads: int, kv_heads: int, hidden: int,
                            ffn: int, checkpoint: bool = False, lora: dict | None = None) -> int:
    """Bytes of the distinct storages a real CPU forward + loss saves for backward (parameters and buffers not
    counted; views of one storage once); ``lora``: torchtune's LoRA model (``_build``)."""
    torch.manual_seed(0)
    model = _build(vocab, layers, heads, kv_heads, hidden, ffn, checkpoint, lora)
    saved, loss = _saved_forward(model, s, b, vocab)
    del loss
    return saved


def _saved_forward(model, s: int, b: int, vocab: int):
    """(bytes of the storages one forward + loss saves, the loss)."""
    # an NF4Tensor parameter (QLoRA) is saved by LinearNF4 as itself: its wrapper's storage is the parameter's too
    saved, pack = saved_storages([*_plain_tensors(model), *model.parameters()])

    tokens = torch.randint(0, vocab, (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _forward(model, tokens, torch.randint(0, vocab, (b, s)))
    return sum(saved.values()), loss


def _plain_tensors(model, buffers: bool = True) -> list:
    """The model's parameters (and buffers), an NF4Tensor by its inner tensors (its own storage is not real)."""
    out = []
    for t in [*model.parameters(), *(model.buffers() if buffers else ())]:
        data = t.data
        if hasattr(data, "__tensor_flatten__"):
            out += [getattr(data, name) for name in data.__tensor_flatten__()[0]]
        else:
            out.append(t)
    return out


def measure_torchtune_step(s: int, b: int, vocab: int, layers: int, heads: int, kv_heads: int, hidden: int, ffn: int,
                           lora: dict | None = None) -> dict[str, int]:
    """One real CPU step of torchtune's model (``lora``: its LoRA / QLoRA one): the bytes its forward + loss saves
    (``saved``, as ``measure_torchtune_llama``), of the model's weights (an NF4Tensor by its inner tensors), of the
    trainable parameters' gradients and of torch AdamW's (fused) states after the step (``step`` counters left out)."""
    torch.manual_seed(0)
    model = _build(vocab, layers, heads, kv_heads, hidden, ffn, False, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    saved, loss = _saved_forward(model, s, b, vocab)
    loss.backward()
    optimizer.step()
    states = [t for st in optimizer.state.values() for k, t in st.items() if k != "step"]
    return {"saved": saved, "weights": sum(t.untyped_storage().nbytes() for t in _plain_tensors(model, buffers=False)),
            "gradients": sum(p.grad.untyped_storage().nbytes() for p in trainable),
            "optimizer": sum(t.untyped_storage().nbytes() for t in states)}


def trace_torchtune_llama(vocab: int, layers: int, heads: int, kv_heads: int, hidden: int, ffn: int,
                          checkpoint: bool = False) -> list[dict]:
    """The saved storages of one forward + loss of torchtune's Llama: dicts with module, op, dtype (str) and
    nbytes (memplan's Poly text in s and b). `checkpoint`: its recipes' enable_activation_checkpointing
    (set_activation_checkpointing around every TransformerSelfAttentionLayer)."""
    import_torchtune()
    from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE

    def inputs(s, b):
        return torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long)

    with mock.patch.object(Llama3ScaledRoPE, "apply_scaling", lambda self, freqs, *a, **k: freqs):
        _, storages, _ = symbolic_saves(
            lambda: _build(vocab, layers, heads, kv_heads, hidden, ffn, checkpoint), _forward, inputs, s_hint=128, b_hint=3)
    return [{"module": st["module"], "op": st["op"], "dtype": str(st["dtype"]).removeprefix("torch."),
             "nbytes": poly_text(st["nbytes"])} for st in storages]


class _OpLog(LiveTracker):
    """LiveTracker that also logs (op, live bytes) after every op while ``log`` is a list."""

    log: list | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.log is not None:
            self.log.append((str(func), self.live))
        return out


def measure_torchtune_loss(s: int, b: int, vocab: int, layers: int, heads: int, kv_heads: int, hidden: int, ffn: int,
                           chunks: int = 1, lora: dict | None = None) -> dict[str, int]:
    """torchtune's loss as full_finetune_single_device's ``_loss_step`` runs it (chunks > 1: the model's
    ``set_num_output_chunks(N)`` and ``CEWithChunkedOutputLoss(N)``; 1: ``torch.nn.CrossEntropyLoss`` on the fp32
    logits), measured in a real CPU forward + backward with a ``LiveTracker`` (the bytes of every storage made inside
    the window: parameters and the batch's labels are not counted, the token ids are). Returns ``saved`` (the
    distinct storages autograd saves), ``loss_forward`` (the live peak from the model's output to the loss), and the
    live peaks of the backward's ops before the output projection's first ``mm`` / ``bmm`` (``loss_backward``), from it up to
    its first weight-gradient ``add`` (``head_backward``, none with one chunk: up to the final norm's backward) and at
    that ``add`` (``head_weight_sum``, chunks > 1; with ``lora`` the output projection is frozen: no weight
    gradient, ``head_backward`` runs to the final norm's backward)."""
    import_torchtune()
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    torch.manual_seed(0)
    model = _build(vocab, layers, heads, kv_heads, hidden, ffn, False, lora)
    loss_fn = CEWithChunkedOutputLoss(chunks) if chunks > 1 else torch.nn.CrossEntropyLoss()
    if chunks > 1:
        model.set_num_output_chunks(chunks)
    saved, pack = saved_storages([*_plain_tensors(model), *model.parameters()])

    batch_labels = torch.randint(0, vocab, (b, s))
    ignore = torch.full((b, 1), -100, dtype=torch.long)
    tracker = _OpLog()
    head_done: list[int] = []  # the op count when the final norm's output gradient is complete

    def on_norm(_module, _args, out):
        out.register_hook(lambda _g: head_done.append(len(tracker.log)))

    model.norm.register_forward_hook(on_norm)
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(torch.randint(0, vocab, (b, s)))
            tracker.log = []
            labels = torch.hstack((batch_labels[..., 1:], ignore))  # the recipe's shifted labels
            if not isinstance(logits, list):
                labels, logits = labels.reshape(-1), logits.reshape(-1, logits.size(-1))
            loss = loss_fn(logits, labels)
            del logits, labels  # _loss_step returns
        forward = max(live for _, live in tracker.log)
        tracker.log = []
        loss.backward()
    ops = tracker.log
    first_mm = next(i for i, (op, _) in enumerate(ops) if op in ("aten.mm.default", "aten.bmm.default"))
    result = {"saved": sum(saved.values()), "loss_forward": forward,
              "loss_backward": max(live for _, live in ops[:first_mm])}
    if chunks > 1 and lora is None:
        first_add = next(i for i, (op, _) in enumerate(ops) if op.startswith("aten.add.Tensor") and i > first_mm)
        result["head_backward"] = max(live for _, live in ops[first_mm:first_add])
        result["head_weight_sum"] = ops[first_add][1]
    else:
        result["head_backward"] = max(live for _, live in ops[first_mm:head_done[0]])
    return result


def torchtune_head_grad_in_backward(s: int, b: int, vocab: int, layers: int, heads: int, kv_heads: int, hidden: int,
                                    ffn: int) -> int:
    """Bytes of the .grad tensors alive when the final norm's output gradient is complete (the output projection's
    backward done) in a real CPU step with the optimizer step in the backward as torchtune's recipes set it up
    (optimizer_in_bwd: one fused AdamW per parameter, stepped and zeroed in that parameter's own
    post-accumulate-grad hook: training.register_optim_in_bwd_hooks, whose package does not import with torchao 0.18,
    so the two-line hook is set here)."""
    torch.manual_seed(0)
    model = _build(vocab, layers, heads, kv_heads, hidden, ffn, False)
    optimizers = {p: torch.optim.AdamW([p], lr=1e-4, fused=True) for p in model.parameters()}

    def optim_step(param) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(optim_step)
    alive: list[int] = []

    def on_norm(_module, _args, out):
        out.register_hook(lambda _g: alive.append(sum(p.grad.untyped_storage().nbytes() for p in model.parameters()
                                                      if p.grad is not None)))

    model.norm.register_forward_hook(on_norm)
    _forward(model, torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s))).backward()
    return alive[0]


def measure_torchtune_8bit_states(s: int, b: int, vocab: int, layers: int, heads: int, kv_heads: int, hidden: int,
                                  ffn: int, paged: bool = False) -> dict[str, int]:
    """One real CPU step of torchtune's model with bitsandbytes' AdamW8bit (``paged``: PagedAdamW8bit, which falls
    back to ordinary CPU tensors on CPU) stepped in the backward as its recipes' ``optimizer_in_bwd`` sets it up (one
    optimizer per parameter, stepped and zeroed in that parameter's post-accumulate-grad hook, as
    ``torchtune_head_grad_in_backward``). Returns the bytes of the optimizer states after the step (``optimizer``:
    the distinct storages of every state tensor, the quantile maps each optimizer shares among its tensors counted
    once per optimizer; the ``step`` counters are ints) and of the ``.grad`` tensors alive after the backward
    (``gradients``)."""
    import bitsandbytes as bnb
    from torch.multiprocessing.reductions import StorageWeakRef

    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    torch.manual_seed(0)
    model = _build(vocab, layers, heads, kv_heads, hidden, ffn, False)
    optimizers = {p: cls([p], lr=1e-4) for p in model.parameters()}

    def optim_step(param) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(optim_step)
    _forward(model, torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s))).backward()
    storages = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes()
                for opt in optimizers.values() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor)}
    return {"optimizer": sum(storages.values()),
            "gradients": sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)}
