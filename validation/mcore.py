"""What NVIDIA's megatron-core really saves for backward, on CPU, labelled per term.

megatron-core 0.16.1 (the newest release pip installs on Python 3.11, which CI runs; later releases,
0.19.x, need Python >= 3.12) built from its *local* spec (``get_gpt_layer_local_spec``: megatron-core's own
ColumnParallelLinear / RowParallelLinear, DotProductAttention, torch LayerNorm / RMSNorm, no
Transformer Engine), bf16, training mode, over a gloo process group of t spawned processes
(``validation.ranks.run_ranks``; t = 1 is spawned too, so megatron-core's global parallel state
never lives in the caller's process).

megatron-core assumes CUDA in places that have nothing to do with what a layer saves; they
are patched at run time in the rank processes (``validation.mcore_cpu.apply_cpu_patches``), never in site-packages.

And three configuration choices: ``masked_softmax_fusion=False`` (the fused softmax kernels are
CUDA-only), an explicit causal attention mask (the unfused softmax masks with ``masked_fill``) and
``.bfloat16()`` on the built modules (``use_cpu_initialization`` makes fp32 weights).
``attention_softmax_in_fp32`` is Megatron-LM's argument default (False: ``--attention-softmax-in-fp32``
is a store_true flag) unless a case asks for megatron-core's TransformerConfig default (True).

Labels: every saved storage is labelled from the context of its first save, as validation/hf.py does
for transformers: (module path relative to the decoder layer / model, torch call, k-th saving call of
that op in that module, j-th saved tensor of the call), mapped by the rule tables of ``validation.mcore_rules``
to memplan's term ids. A storage no rule matches is "unlabeled" (tests demand none).

Nothing here computes a byte count from a formula; every number is read off a tensor.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from .instruments import LiveTracker, _CallRecorder, _HFLedger, _ModuleStack
from .mcore_cpu import DISCARDED, LOADS, apply_cpu_patches
from .mcore_rules import (
    ATTN, FN, GELU_SHARED_RULES, LAYER_RULES, MLA_RULES, MODEL_RULES, MOE, MOE_RULES, MUL, ROUTER, ROUTER_MUL,
    Z_LOSS_RULES, _gelu_expert_rules, split_module,
)
from .ranks import run_ranks
from .tags import UNLABELED

MCORE_VERSION = "0.16.1"
Arch = Literal["gpt", "llama"]

# ---------------------------------------------------------------------------------------------
# the ledger


class _Ledger(_HFLedger):
    """validation/instruments.py's ``_HFLedger``, with each torch.autograd.Function call (megatron-core's linears, its
    CheckpointFunction, its vocab-parallel cross-entropy: invisible to a TorchFunctionMode) its own call,
    op "Function"."""

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        frame = sys._getframe(1)
        while frame is not None and not (frame.f_code.co_name == "apply"
                                         and frame.f_code.co_filename.endswith(os.path.join("autograd", "function.py"))):
            frame = frame.f_back if frame.f_code.co_filename.endswith(("hooks.py", "graph.py")) else None
        if frame is None:
            return super().pack(t)
        # the packing itself calls Tensor methods, which the recorder counts: put its counter back, so that the
        # tensors one Function saves share a call (a later Function runs torch calls first: a new call)
        current, call, counter = self.rec.current, self.rec.call, self.rec._next
        self.rec.current, self.rec.call = FN, ("fn", id(frame), counter)
        try:
            return super().pack(t)
        finally:
            self.rec.current, self.rec.call, self.rec._next = current, call, counter


# ---------------------------------------------------------------------------------------------
# the case


@dataclass(frozen=True)
class McoreCase:
    """One megatron-core configuration: ``arch`` "gpt" (LayerNorm, GeLU, learned positions, dropout)
    or "llama" (RMSNorm, SwiGLU, RoPE, GQA with g groups, no dropout, no biases)."""

    arch: Arch = "gpt"
    s: int = 32
    b: int = 2
    h: int = 64
    a: int = 4
    f: Optional[int] = None
    g: Optional[int] = None
    v: int = 256
    L: int = 1
    t: int = 1
    sp: bool = False
    recompute: str = "none"
    scope: Literal["layer", "model"] = "layer"
    modules: tuple[str, ...] = ("core_attn",)  # selective recompute: Megatron-LM's --recompute-modules
    p_drop: float = 0.1
    softmax_fp32: bool = False
    backend: Literal["ledger", "live"] = "ledger"
    seed: int = 0
    # mixture of experts (experts > 0: every layer's MLP is megatron-core's MoELayer with SequentialMLP experts)
    experts: int = 0
    topk: int = 2
    fe: Optional[int] = None  # one expert's width (default f)
    fs: int = 0  # shared experts' width (0: none)
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallelism (None: t)
    capacity: Optional[float] = None  # moe_expert_capacity_factor (token dropping)
    pad: bool = False  # moe_pad_expert_input_to_capacity
    aux_loss: float = 0.0  # moe_aux_loss_coeff (Megatron-LM's default 0: no aux loss)
    balanced: bool = True  # route token i to experts (i k + j) mod E (see _balanced_routing)
    loads: tuple[int, ...] = ()  # routed copies each expert receives from this rank's tokens (see _balanced_routing)
    z_loss: Optional[float] = None  # moe_z_loss_coeff (None: no z-loss)
    router_dtype: Optional[str] = None  # moe_router_dtype: None (the input's) | fp32 | fp64
    pre_softmax: bool = False  # moe_router_pre_softmax (softmax over all E logits before top-k)
    gelu: bool = False  # llama arch with a GeLU MLP (no GLU) instead of SwiGLU: GeLU experts without biases
    # multi-latent attention (kv_lora > 0: megatron-core's MLASelfAttention with its latent norms,
    # qk_layernorm=True as DeepSeek-V3's Megatron-LM recipe; RoPE on the qk_rope part, unfused)
    kv_lora: int = 0
    q_lora: Optional[int] = None  # None: the direct q projection (linear_q_proj)
    qk_nope: int = 32
    qk_rope: int = 16
    v_head: int = 32

    @property
    def world(self) -> int:
        return self.t * self.ep

    @property
    def ffn(self) -> int:
        return 4 * self.h if self.f is None else self.f


@dataclass
class McoreMeasurement:
    case: McoreCase
    saved_bytes_by_label: dict[str, int]
    entries: list[tuple[str, tuple, str, int, tuple]]  # (label, shape, dtype, bytes, (module, op, k, j))
    retained_after_forward_bytes: Optional[int]
    peak_bytes: Optional[int]
    loss_bytes: int
    rank: int = 0
    ranks_agree: Optional[bool] = None
    notes: list[str] = field(default_factory=list)

    @property
    def saved_bytes_total(self) -> int:
        return sum(self.saved_bytes_by_label.values())


# ---------------------------------------------------------------------------------------------
# building


def _config(case: McoreCase):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    llama = case.arch == "llama"
    kw = dict(
        num_layers=case.L, hidden_size=case.h, num_attention_heads=case.a, ffn_hidden_size=case.ffn,
        tensor_model_parallel_size=case.t, sequence_parallel=case.sp and case.t > 1,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True, masked_softmax_fusion=False,
        attention_softmax_in_fp32=case.softmax_fp32, bias_dropout_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False,
        hidden_dropout=case.p_drop, attention_dropout=case.p_drop,
    )
    if llama:
        kw.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  num_query_groups=case.g or case.a)
        if case.gelu:
            kw.update(gated_linear_unit=False, activation_func=F.gelu)
    if case.experts:
        kw.update(num_moe_experts=case.experts, moe_router_topk=case.topk, moe_ffn_hidden_size=case.fe or case.ffn,
                  moe_token_dispatcher_type=case.dispatcher, expert_model_parallel_size=case.ep,
                  expert_tensor_parallel_size=case.etp or case.t,
                  moe_expert_capacity_factor=case.capacity, moe_pad_expert_input_to_capacity=case.pad,
                  moe_aux_loss_coeff=case.aux_loss, moe_router_force_load_balancing=case.balanced,
                  moe_shared_expert_intermediate_size=case.fs or None, moe_grouped_gemm=False,
                  moe_z_loss_coeff=case.z_loss, moe_router_dtype=case.router_dtype,
                  moe_router_pre_softmax=case.pre_softmax)
    if case.kv_lora:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kw.update(q_lora_rank=case.q_lora, kv_lora_rank=case.kv_lora, qk_head_dim=case.qk_nope,
                  qk_pos_emb_head_dim=case.qk_rope, v_head_dim=case.v_head, rope_type="rope")
        kw.pop("num_query_groups", None)
    if case.recompute == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=list(case.modules))
    elif case.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return MLATransformerConfig(**kw) if case.kv_lora else TransformerConfig(**kw)


def _spec(case: McoreCase):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=case.experts or None, moe_grouped_gemm=False,
                                    normalization="RMSNorm" if case.arch == "llama" else None,
                                    multi_latent_attention=bool(case.kv_lora), qk_layernorm=bool(case.kv_lora))
    if case.kv_lora:
        spec.submodules.self_attention.submodules.core_attention = _mla_dot_product_attention()
    return spec


def _mla_dot_product_attention():
    """megatron-core 0.16.1's MLA passes ``k_channels`` / ``v_channels`` to its core attention, which only
    Transformer Engine's attention takes (Megatron-LM runs MLA with ``--transformer-impl transformer_engine``);
    the local ``DotProductAttention`` refuses them. Its forward is width-agnostic (Q and K reshaped with
    ``-1``; the output is ``hidden_size_per_partition`` wide): this subclass takes the two arguments and makes
    that width a v_channels per head. The attention's own ops (baddbmm, the unfused softmax, bmm) run
    unchanged."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # Attention.__init__ builds one without them, MLA its own
                self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
                self.hidden_size_per_attention_head = k_channels

    return MLADotProductAttention


def build(case: McoreCase):
    """The measured module: a TransformerBlock of L layers without the final norm (scope "layer":
    the block applies full recompute, as Megatron-LM does) or a whole GPTModel (scope "model")."""
    config = _config(case)
    if case.scope == "layer":
        from megatron.core.transformer.transformer_block import TransformerBlock

        module = TransformerBlock(config, _spec(case), post_layer_norm=False)
    else:
        from megatron.core.models.gpt import GPTModel

        module = GPTModel(config, _spec(case), case.v, case.s,
                          position_embedding_type="rope" if case.arch == "llama" else "learned_absolute",
                          share_embeddings_and_output_weights=case.arch != "llama")
    return module.bfloat16().train()


def _forward_fresh(module, case: McoreCase) -> torch.Tensor:
    """This step's inputs are created here and die on return unless autograd saved them."""
    from megatron.core import parallel_state as ps

    t = ps.get_tensor_model_parallel_world_size()
    mask = torch.triu(torch.ones(case.s, case.s, dtype=torch.bool), diagonal=1).view(1, 1, case.s, case.s)
    if case.scope == "layer":
        s_local = case.s // t if (case.sp and t > 1) else case.s
        x = torch.randn(s_local, case.b, case.h, dtype=torch.bfloat16).requires_grad_()
        rope = None
        if case.arch == "llama" and not case.kv_lora:  # MLA makes its own rotary embedding
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

            rope = RotaryEmbedding(case.h // case.a, rotary_percent=1.0, use_cpu_initialization=True)(case.s)
        out = module(x, attention_mask=mask, rotary_pos_emb=rope)
        return out.sum()
    ids = torch.randint(0, case.v, (case.b, case.s))
    labels = torch.randint(0, case.v, (case.b, case.s))
    pos = torch.arange(case.s).unsqueeze(0).expand(case.b, case.s)
    return module(ids, pos, mask, labels=labels).sum()


# ---------------------------------------------------------------------------------------------
# measuring (in a rank process)


def _measure_here(case: McoreCase) -> McoreMeasurement:
    warnings.filterwarnings("ignore")
    # the tracker warns when the CPU generator moves inside a fork: here it is the generator the fork uses
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    apply_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random

    ps.initialize_model_parallel(tensor_model_parallel_size=case.t, expert_model_parallel_size=case.ep,
                                 expert_tensor_parallel_size=case.etp or case.t)
    try:
        random.model_parallel_cuda_manual_seed(case.seed + 1)
        torch.manual_seed(case.seed + ps.get_tensor_model_parallel_rank())
        module = build(case)
        DISCARDED.clear()
        LOADS[:] = case.loads
        if case.backend == "live":  # warm-up: lazy initialisation outside the window
            _forward_fresh(module, case).backward()
            module.zero_grad(set_to_none=True)
            gc.collect()
        modules = _ModuleStack(module, "decoder" if case.scope == "layer" else "")
        rec = _CallRecorder(modules)
        ledger = _Ledger(list(module.parameters()), rec, modules)
        tracker = LiveTracker() if case.backend == "live" else None
        try:
            with (tracker or contextlib.nullcontext()):
                with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack), rec:
                    loss = _forward_fresh(module, case)
                # packed but not kept: on CPU F.dropout under no_grad (a checkpoint's forward) still calls the
                # pack hook, and nothing holds what it packed
                alive = {key for key in ledger.records if not key.expired()}
                retained = tracker.settle() if tracker else None
                loss_bytes = loss.untyped_storage().nbytes()
                loss.backward()
                del loss
                peak = tracker.peak if tracker else None
        finally:
            modules.close()
        return _collect(case, ledger, alive, retained, peak, loss_bytes, ps.get_tensor_model_parallel_rank())
    finally:
        ps.destroy_model_parallel()


def _collect(case, ledger, alive, retained, peak, loss_bytes, rank) -> McoreMeasurement:
    rules = {**LAYER_RULES, **MOE_RULES, **MLA_RULES, **MODEL_RULES, **(Z_LOSS_RULES if case.z_loss is not None else {}),
             **{k: v for i in range(16) if case.gelu for k, v in _gelu_expert_rules(f"{MOE}.experts.local_experts.{i}").items()},
             **(GELU_SHARED_RULES if case.gelu else {})}
    checkpoints = layer_checkpoints(case)
    up_proj = mla_up_proj_inputs(case)
    by_label: dict[str, int] = {}
    entries = []
    for key, r in ledger.records.items():
        if r.is_param or key not in alive:
            continue
        module, op, k, j, _ = ledger.ctx[key]
        layer, rel = split_module(module.lstrip("."))
        where = rel if layer is None else f"<layer>.{rel}".rstrip(".")
        label = rules.get((where, op, k, j), UNLABELED)
        if (where, op) == (ROUTER, MUL):
            label = ROUTER_MUL.get(str(r.dtype).removeprefix("torch."), UNLABELED)
        if (where, op, j) == ("<layer>", FN, 0) and k < len(checkpoints):
            label = checkpoints[k]
        if (where, op) == (ATTN, FN) and up_proj:  # the up projections' checkpoint runs before the core attention's
            label = up_proj[j] if k == 0 else rules.get((where, op, k - 1, j), UNLABELED)
        if key in DISCARDED:
            continue  # its storage freed (resize_(0)) by CheckpointWithoutOutput: nothing left to count
        entries.append((label, r.shape, r.dtype, r.nbytes, (where, op, k, j)))
        by_label[label] = by_label.get(label, 0) + r.nbytes
    return McoreMeasurement(case, by_label, entries, retained, peak, loss_bytes, rank,
                            notes=[f"megatron-core {_version()}"])


def layer_checkpoints(case: McoreCase) -> list[str]:
    """The labels of the inputs that selective recompute's checkpoints in a TransformerLayer's own forward save,
    in call order: "layernorm" checkpoints both norms (their inputs: the layer input, the residual after the
    attention), "mlp" the dense MLP (its input, the second norm's output)."""
    if case.recompute != "selective":
        return []
    norms = ["ln1_input", "ln2_input"] if "layernorm" in case.modules else []
    return norms + (["fc1_input"] if "mlp" in case.modules and not case.experts else [])


def mla_up_proj_inputs(case: McoreCase) -> list[str]:
    """The labels of what selective recompute of "mla_up_proj" (MLA's CheckpointWithoutOutput around the up
    projections and RoPE) saves, in order: q_compressed (the q latent norm's output; without a q down projection the
    attention input), kv_compressed (the kv latent norm's output), k_pos_emb (a view of the kv down projection's
    output) and the fp32 rotary frequencies; [] without it."""
    if not (case.kv_lora and case.recompute == "selective" and "mla_up_proj" in case.modules):
        return []
    return ["mla_q_up_input" if case.q_lora else "qkv_input", "mla_kv_up_input", "mla_k_pos_emb", "mla_rope_freqs"]


def _version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def _measure_rank(rank: int, world: int, cases: list[McoreCase]) -> list[McoreMeasurement]:
    return [_measure_here(c) for c in cases]


def measure_mcore(cases: list[McoreCase]) -> list[McoreMeasurement]:
    """Measure each case on rank 0 of its own t-process gloo group (one spawn per t); the ranks'
    ledgers are compared (``ranks_agree``)."""
    out: list[Optional[McoreMeasurement]] = [None] * len(cases)
    by_t: dict[int, list[int]] = {}
    for i, c in enumerate(cases):
        by_t.setdefault(c.world, []).append(i)
    for t, idx in by_t.items():
        per_rank = run_ranks(_measure_rank, t, ([cases[i] for i in idx],))
        for n, i in enumerate(idx):
            ms = [per_rank[r][n] for r in range(t)]
            sig = [(m.saved_bytes_by_label, m.retained_after_forward_bytes) for m in ms]
            ms[0].ranks_agree = all(s == sig[0] for s in sig[1:])
            out[i] = ms[0]
    return out  # type: ignore[return-value]


def format_table(m: McoreMeasurement) -> str:
    lines = [f"{m.notes[0]}  {m.case}"]
    for label, shape, dtype, nbytes, ctx in m.entries:
        lines.append(f"{label:24} {'x'.join(map(str, shape)):16} {dtype:9} {nbytes:>10,}  {ctx}")
    lines.append(f"saved {m.saved_bytes_total:,} B  retained {m.retained_after_forward_bytes}  peak {m.peak_bytes}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m validation.mcore", description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--scope", choices=("layer", "model"), default="layer")
    p.add_argument("--backend", choices=("ledger", "live"), default="ledger")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--sp", action="store_true")
    p.add_argument("--softmax-fp32", action="store_true")
    for name, default in (("s", 32), ("b", 2), ("h", 64), ("a", 4), ("v", 256), ("L", 1), ("t", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--f", type=int, default=None)
    p.add_argument("--g", type=int, default=None)
    p.add_argument("--dropout", type=float, default=None)
    a = p.parse_args(argv)
    drop = a.dropout if a.dropout is not None else (0.1 if a.arch == "gpt" else 0.0)
    # by keyword: McoreCase's fields are not in this order (modules sits before p_drop)
    case = McoreCase(arch=a.arch, s=a.s, b=a.b, h=a.h, a=a.a, f=a.f, g=a.g, v=a.v, L=a.L, t=a.t, sp=a.sp,
                     recompute=a.recompute, scope=a.scope, p_drop=drop, softmax_fp32=a.softmax_fp32, backend=a.backend)
    print(format_table(measure_mcore([case])[0]))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
