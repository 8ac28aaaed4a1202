"""What NVIDIA's megatron-core really saves for backward, on CPU, labelled per term.

megatron-core 0.16.1 (the newest release pip installs on Python 3.11, which CI runs; later releases,
0.19.x, need Python >= 3.12) built from its *local* spec (``get_gpt_layer_local_spec``: megatron-core's own
ColumnParallelLinear / RowParallelLinear, DotProductAttention, torch LayerNorm / RMSNorm, no
Transformer Engine), bf16, training mode, over a gloo process group of t spawned processes
(``validation.ranks.run_ranks``; t = 1 is spawned too, so megatron-core's global parallel state
never lives in the caller's process).

megatron-core assumes CUDA in places that have nothing to do with what a layer saves; they
are patched at run time in the rank processes (``apply_cpu_patches``), never in site-packages:

* ``tensor_parallel/random.py``: the CUDA RNG tracker (``model_parallel_cuda_manual_seed``,
  ``CudaRNGStatesTracker.add`` / ``fork``, ``CheckpointFunction``) reads and sets the CUDA generator:
  routed to the CPU generator (``torch.get_rng_state`` / ``set_rng_state`` / ``manual_seed``);
* ``utils.py``: ``GlobalMemoryBuffer.get_tensor`` (the ``baddbmm`` input buffer of
  ``DotProductAttention``) allocates on ``torch.cuda.current_device()``: answered "cpu"; in 0.16.1 also
  RoPE's ``get_emb`` and SP's all-gather buffers (``tensor_parallel/mappings.py``, ``layers.py``):
  ``CURRENT_DEVICE_MODULES``;
* ``transformer/torch_norm.py``: ``WrappedTorchNorm`` refuses sequence parallelism (it cannot mark
  the norm weights for the SP gradient all-reduce, which a memory measurement does not need):
  built with ``config.sequence_parallel`` seen as False.

And three configuration choices: ``masked_softmax_fusion=False`` (the fused softmax kernels are
CUDA-only), an explicit causal attention mask (the unfused softmax masks with ``masked_fill``) and
``.bfloat16()`` on the built modules (``use_cpu_initialization`` makes fp32 weights).
``attention_softmax_in_fp32`` is Megatron-LM's argument default (False: ``--attention-softmax-in-fp32``
is a store_true flag) unless a case asks for megatron-core's TransformerConfig default (True).

Labels: every saved storage is labelled from the context of its first save, as validation/hf.py does
for transformers: (module path relative to the decoder layer / model, torch call, k-th saving call of
that op in that module, j-th saved tensor of the call), mapped by the rule tables below to memplan's
term ids. A storage no rule matches is "unlabeled" (tests demand none).

Nothing here computes a byte count from a formula; every number is read off a tensor.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass, field, replace
from typing import Literal, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .hf import _CallRecorder, _HFLedger
from .measure import LiveTracker, _ModuleStack
from .ranks import run_ranks
from .tags import UNLABELED

MCORE_VERSION = "0.16.1"
Arch = Literal["gpt", "llama"]

# ---------------------------------------------------------------------------------------------
# the CPU patches


class _Proxy:
    """A stand-in for a module's global ``torch``: everything from torch, except ``torch.cuda``'s
    attributes named in ``cuda``."""

    def __init__(self, **cuda) -> None:
        class _Cuda:
            def __getattr__(self, name):
                return getattr(torch.cuda, name)

        self.cuda = _Cuda()
        for name, fn in cuda.items():
            setattr(self.cuda, name, fn)

    def __getattr__(self, name):
        return getattr(torch, name)


# modules of megatron-core 0.16.1 beside utils.py that allocate on torch.cuda.current_device() in a path the
# cases run: RoPE's inv_freq (rotary_pos_embedding.get_emb), SP's all-gather buffers (tensor_parallel mappings /
# layers)
CURRENT_DEVICE_MODULES = ("models.common.embeddings.rotary_pos_embedding", "tensor_parallel.mappings",
                          "tensor_parallel.layers", "transformer.moe.router", "transformer.moe.token_dispatcher",
                          "transformer.moe.moe_utils", "transformer.moe.experts")


# the output storages megatron-core's CheckpointWithoutOutput frees in this process's current case (selective
# recompute of "layernorm": the norms' outputs, saved by the next linear, resized to 0 once it has run)
DISCARDED: set = set()


def apply_cpu_patches() -> None:
    """Make megatron-core run on CPU (see the module docstring); idempotent, rank processes only."""
    from megatron.core import utils
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import torch_norm

    if getattr(random, "_memplan_cpu", False):
        return
    random.torch = _Proxy(get_rng_state=lambda *a, **k: torch.get_rng_state(),
                          set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
                          manual_seed=lambda seed: torch.manual_seed(seed))
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    for module in (utils, *(importlib.import_module(f"megatron.core.{m}") for m in CURRENT_DEVICE_MODULES)):
        module.torch = _Proxy(current_device=lambda: "cpu")
    original_new = torch_norm.WrappedTorchNorm.__new__

    def norm_new(cls, config, *args, **kwargs):
        return original_new(cls, replace(config, sequence_parallel=False) if config.sequence_parallel else config,
                            *args, **kwargs)

    torch_norm.WrappedTorchNorm.__new__ = norm_new
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher

    # moe_utils imports te_general_gemm from Transformer Engine and leaves the name undefined without it
    # (0.16.1); RouterGatingLinearFunction then takes its torch.mm path
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    router.apply_random_logits = _balanced_routing
    from megatron.core.transformer import multi_latent_attention

    # without Transformer Engine megatron-core's extensions import stands MagicMocks in for TE's classes, and
    # MLA's isinstance(self.linear_proj, TELinear) refuses one: TE is absent, as HAVE_TE should say
    multi_latent_attention.HAVE_TE = False
    # the alltoall dispatcher copies its split sizes to the host on a side CUDA stream: one stand-in stream
    stream = _NoStream()
    # ... and moves them there only from a CUDA tensor (maybe_move_tensor_to_cpu): on CPU the split sizes
    # stay tensors, which gloo's all_to_all_single refuses; as on CUDA they become numpy arrays
    token_dispatcher.maybe_move_tensor_to_cpu = (
        lambda tensor, as_numpy=False, record_stream=False:
        tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor)
    token_dispatcher.torch = _Proxy(current_device=lambda: "cpu", Stream=lambda *a, **k: stream,
                                    current_stream=lambda *a, **k: stream, stream=lambda s: contextlib.nullcontext())
    # CheckpointWithoutOutput (selective recompute of "layernorm") sets its fp8 flag from `fp8 is not None`, so
    # the default fp8=False turns it on and its forward reaches Transformer Engine's FP8GlobalStateManager, an
    # undefined name without TE (0.16.1): the flag as its default means (off); nothing it saves changes
    original_init = random.CheckpointWithoutOutput.__init__

    def checkpoint_init(self, fp8=False):
        original_init(self, fp8)
        self.fp8 = bool(fp8)

    random.CheckpointWithoutOutput.__init__ = checkpoint_init
    original_discard = random.CheckpointWithoutOutput.discard_output_and_register_recompute

    def discard(self, hook_tensor):
        DISCARDED.update(StorageWeakRef(o.untyped_storage()) for o in self.outputs)
        return original_discard(self, hook_tensor)

    random.CheckpointWithoutOutput.discard_output_and_register_recompute = discard
    random._memplan_cpu = True


class _NoStream:
    """A CUDA stream / event stand-in on CPU: work is synchronous, so waiting is nothing."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> "_NoStream":
        return self

    def synchronize(self) -> None:
        pass


# the current case's uneven routing (McoreCase.loads; empty: balanced), set per case in the rank process
LOADS: list = []


def _balanced_routing(logits: torch.Tensor) -> torch.Tensor:
    """Stands in for megatron-core's ``moe_router_force_load_balancing`` (random logits, balanced only on
    average): token i of the rank's [s, b] tokens (flattened) gets a large bonus on experts (i k + j) mod E,
    j < k, so every expert receives exactly k s b / E of them (when E divides k s b). A constant added to
    the logits: autograd saves nothing more, and the router's own ops (softmax, top-k) run unchanged."""
    from megatron.core.transformer.moe.router import TopKRouter

    frame = sys._getframe(1)
    k = frame.f_locals["self"].topk if isinstance(frame.f_locals.get("self"), TopKRouter) else 1
    E = logits.shape[-1]
    n = logits.numel() // E
    idx = (torch.arange(n).unsqueeze(1) * k + torch.arange(k).unsqueeze(0)) % E
    if LOADS:  # uneven: expert e receives LOADS[e] of the k n copies; copy j of token i goes to the (i + j n)-th
        # entry of the experts listed in order, each LOADS[e] times (distinct experts per token while LOADS[e] <= n)
        order = torch.repeat_interleave(torch.arange(E), torch.tensor(LOADS))
        idx = torch.stack([order[torch.arange(n) + j * n] for j in range(k)], dim=1)
    bonus = torch.zeros(n, E, dtype=logits.dtype).scatter_(1, idx, 64.0)
    return logits + bonus.view(logits.shape)


# ---------------------------------------------------------------------------------------------
# label rules: (module relative to the layer / model, op, k, j) -> memplan term id

FN = "Function"  # a torch.autograd.Function's save_for_backward (megatron-core's linears, checkpoint, loss)
LN, RMS = "torch.nn.functional.layer_norm", "torch.nn.functional.rms_norm"
DROPOUT, MUL = "torch.nn.functional.dropout", "torch.Tensor.mul"
ATTN, CORE = "<layer>.self_attention", "<layer>.self_attention.core_attention"


def _norm_rules(module: str, prefix: str) -> dict:
    """torch.nn.LayerNorm saves input, mean, rstd (bf16 statistics on CPU); torch.nn.RMSNorm on CPU runs
    F.rms_norm's composite path: an fp32 copy of the input, rstd (fp32) and the fp32 normalised input."""
    return {(module, LN, 0, 0): f"{prefix}_input", (module, LN, 0, 1): f"{prefix}_stats",
            (module, LN, 0, 2): f"{prefix}_stats",
            (module, RMS, 0, 0): f"{prefix}_fp32_input", (module, RMS, 0, 1): f"{prefix}_stats",
            (module, RMS, 0, 4): f"{prefix}_normed"}


LAYER_RULES: dict[tuple[str, str, int, int], str] = {
    **_norm_rules("<layer>.input_layernorm", "ln1"),
    ("<layer>.self_attention.linear_qkv", FN, 0, 0): "qkv_input",
    # apply_rotary_pos_emb (unfused): t * cos and rotate_half(t) * sin save cos and sin, made per call from
    # the freqs, for Q and for K
    **{(ATTN, MUL, k, 0): "rope_cos_sin" for k in range(4)},
    # DotProductAttention: baddbmm(buffer, Q, K^T) saves Q and K, bmm(probs, V) saves V: views of the QKV
    # projection's output (one storage) for GPT; Q and K after RoPE and K, V repeated to the a heads for GQA
    (CORE, "torch.baddbmm", 0, 0): "qkv",
    (CORE, "torch.baddbmm", 0, 1): "qkv",
    (CORE, "torch.bmm", 0, 0): "qkv",
    (f"{CORE}.scale_mask_softmax", "torch.Tensor.masked_fill_", 0, 0): "causal_mask",
    (f"{CORE}.scale_mask_softmax", "torch.nn.functional.softmax", 0, 0): "softmax_out",
    (f"{CORE}.attention_dropout", DROPOUT, 0, 0): "softmax_mask",
    (CORE, "torch.bmm", 0, 1): "attn_dropout_out",  # dropout output, or the bf16 probabilities of an fp32 softmax
    # selective recompute: CheckpointFunction around the attention core saves Q, K, V, the mask and
    # attn_mask_type as an int tensor
    **{(ATTN, FN, 0, j): "qkv" for j in range(3)},
    (ATTN, FN, 0, 3): "causal_mask",
    (ATTN, FN, 0, 4): "attn_mask_type",
    ("<layer>.self_attention.linear_proj", FN, 0, 0): "proj_input",
    ("<layer>", DROPOUT, 0, 0): "attn_dropout_mask",  # self_attn_bda (bias_dropout_fusion off: F.dropout)
    **_norm_rules("<layer>.pre_mlp_layernorm", "ln2"),
    ("<layer>.mlp.linear_fc1", FN, 0, 0): "fc1_input",
    ("<layer>.mlp", "torch.nn.functional.gelu", 0, 0): "gelu_input",
    ("<layer>.mlp", "torch.nn.functional.silu", 0, 0): "swiglu_input",  # a view of fc1's 2f-wide output
    ("<layer>.mlp", MUL, 0, 0): "swiglu_up",  # x_linear + glu_linear_offset (a new tensor)
    ("<layer>.mlp", MUL, 0, 1): "swiglu_silu_out",
    ("<layer>.mlp.linear_fc2", FN, 0, 0): "fc2_input",
    ("<layer>", DROPOUT, 1, 0): "mlp_dropout_mask",
}

MOE, ROUTER, SHARED = "<layer>.mlp", "<layer>.mlp.router", "<layer>.mlp.shared_experts"
SILU = "torch.nn.functional.silu"


def _expert_rules(expert: str) -> dict:
    """One SequentialMLP expert (an MLP on its tokens, probabilities applied after the activation)."""
    return {(f"{expert}.linear_fc1", FN, 0, 0): "moe_permuted_tokens",  # its slice of the routed tokens
            (expert, SILU, 0, 0): "moe_fc1_output", (expert, MUL, 0, 0): "moe_swiglu_up",
            (expert, MUL, 0, 1): "moe_silu_out", (expert, MUL, 1, 0): "moe_permuted_probs",
            (expert, MUL, 1, 1): "moe_act_out", (f"{expert}.linear_fc2", FN, 0, 0): "moe_fc2_input"}


def _gelu_expert_rules(expert: str) -> dict:
    """One SequentialMLP expert with a GeLU MLP (no GLU): the probabilities' multiply is its first."""
    return {(expert, "torch.nn.functional.gelu", 0, 0): "moe_fc1_output", (expert, MUL, 0, 0): "moe_permuted_probs",
            (expert, MUL, 0, 1): "moe_act_out"}


GELU_SHARED_RULES = {(SHARED, "torch.nn.functional.gelu", 0, 0): "shared_fc1_output"}


# the z-loss (--moe-z-loss-coeff) runs before the routing: logsumexp keeps the logits and its output, and its
# MoEAuxLossAutoScaler is the router's second Function (the aux loss's then the third)
Z_LOSS_RULES = {(ROUTER, "torch.logsumexp", 0, 0): "moe_z_logits", (ROUTER, "torch.logsumexp", 0, 1): "moe_z_lse",
                (ROUTER, FN, 1, 0): "moe_z_loss", (ROUTER, FN, 2, 0): "moe_aux_loss"}

# megatron-core's MoELayer (memplan/inventory/moe.py): router, permutation, SequentialMLP experts, shared experts
MOE_RULES: dict[tuple[str, str, int, int], str] = {
    (ROUTER, FN, 0, 0): "fc1_input",  # RouterGatingLinearFunction keeps the MLP input
    (f"{SHARED}.linear_fc1", FN, 0, 0): "fc1_input",  # the same storage, when the shared experts run first
    (ROUTER, "torch.topk", 0, 0): "moe_topk_indices",
    (ROUTER, "torch.softmax", 0, 0): "moe_topk_probs",
    (ROUTER, "torch.softmax", 1, 0): "moe_aux_scores",
    (ROUTER, FN, 1, 0): "moe_aux_loss",  # MoEAuxLossAutoScaler
    (MOE, "torch.Tensor.masked_select", 0, 0): "moe_routing_map",
    (MOE, "torch.Tensor.masked_select", 0, 1): "moe_probs_dense",
    (MOE, "torch.Tensor.__getitem__", 0, 0): "moe_sort_index",  # 0.19.2's argsort, indexing the probabilities
    (MOE, "torch.Tensor.index_select", 0, 0): "moe_permute_index",
    (MOE, FN, 0, 0): "fc1_input",  # selective recompute "moe" / "shared_experts": the checkpoint keeps the MLP input
    (MOE, "torch.Tensor.index_select", 1, 0): "moe_permute_index",  # padded to capacity: the probabilities'
    (SHARED, SILU, 0, 0): "shared_fc1_output", (SHARED, MUL, 0, 0): "shared_swiglu_up",
    (SHARED, MUL, 0, 1): "shared_silu_out", (f"{SHARED}.linear_fc2", FN, 0, 0): "shared_fc2_input",
    **{k: v for i in range(16) for k, v in _expert_rules(f"{MOE}.experts.local_experts.{i}").items()},
}
# the router's multiplies: the token dropping's routing map (bool) and the aux loss's tokens per expert (int64),
# in either order
ROUTER_MUL = {"bool": "moe_routing_map", "int64": "moe_aux_counts"}

# megatron-core's MLASelfAttention (memplan/inventory/mla.py): down projections, latent norms, up projections; RoPE's
# cos / sin and the core attention's Q, K, V are LAYER_RULES' (ATTN, CORE)
MLA_RULES: dict[tuple[str, str, int, int], str] = {
    **{(f"{ATTN}.{proj}", FN, 0, 0): "qkv_input" for proj in ("linear_q_down_proj", "linear_kv_down_proj",
                                                               "linear_q_proj")},
    **{(f"{ATTN}.{which}_layernorm", RMS, 0, j): f"mla_{which}_{part}" for which in ("q", "kv")
       for j, part in ((0, "fp32_latent"), (1, "norm_stats"), (4, "normed"))},
    (f"{ATTN}.linear_q_up_proj", FN, 0, 0): "mla_q_up_input",
    (f"{ATTN}.linear_kv_up_proj", FN, 0, 0): "mla_kv_up_input",
}

MODEL_RULES: dict[tuple[str, str, int, int], str] = {
    ("embedding.word_embeddings", "torch.nn.functional.embedding", 0, 0): "token_ids",
    ("embedding.word_embeddings", "torch.Tensor.__setitem__", 0, 0): "embedding_input_mask",  # t > 1
    ("embedding.position_embeddings", "torch.nn.functional.embedding", 0, 0): "position_ids",
    ("embedding.embedding_dropout", DROPOUT, 0, 0): "embedding_dropout_mask",
    **_norm_rules("decoder.final_layernorm", "final_ln"),
    ("output_layer", FN, 0, 0): "head_input",
    # VocabParallelCrossEntropy saves exp_logits (the fp32 softmax), target_mask, masked_target_1d
    ("", FN, 0, 0): "logits_fp32",
    ("", FN, 0, 1): "target_mask",
    ("", FN, 0, 2): "target_ids",
    # full recompute: CheckpointFunction around the layers saves the hidden states and the mask
    **{("decoder", FN, k, 0): "ln1_input" for k in range(8)},
    **{("decoder", FN, k, 1): "causal_mask" for k in range(8)},
    **{("decoder", FN, k, 2): "rope_freqs" for k in range(8)},  # RoPE's fp32 freqs, an input of every checkpoint
}


class _Ledger(_HFLedger):
    """validation/hf.py's ledger, with each torch.autograd.Function call (megatron-core's linears, its
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


LAYER_RE = re.compile(r"^(?:decoder\.)?layers\.(\d+)(?:\.(.*))?$")


def split_module(path: str) -> tuple[Optional[int], str]:
    m = LAYER_RE.match(path)
    if m:
        return int(m.group(1)), m.group(2) or ""
    return None, path


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
    case = McoreCase(a.arch, a.s, a.b, a.h, a.a, a.f, a.g, a.v, a.L, a.t, a.sp, a.recompute, a.scope, drop,
                     a.softmax_fp32, a.backend)
    print(format_table(measure_mcore([case])[0]))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
