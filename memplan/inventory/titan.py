"""torchtitan 0.3.0's Llama 3 decoder layer: the tensors it keeps for the backward per activation-checkpointing
mode and TP degree, FSDP2's per-rank states, and them as the Inventory of `--impl torchtitan` (``titan_inventory``; issue 24's
first slice: what is left is TITAN_LEFT).  Qwen3 MoE (``is_qwen3_moe``): the MoE's terms in place of the SwiGLU's,
memplan/inventory/titan_moe.py.

The layer (torchtitan/models/llama3 + models/common: fused QKV linear, complex RoPE, RMSNorm, SwiGLU) read from
its code and checked, term by term in total, against validation/titan.py, which runs torchtitan's real block
(measured with real tensors on CPU, and traced under FakeTensorMode with symbolic s and b).  Every figure is
bytes per token (times s b for the layer) on CPU kernels, bf16 activations:

* ``none``: what autograd keeps.  torch's CPU ``F.rms_norm`` is composite: each norm keeps x in fp32 (4h), its
  rstd (fp32, 4), x * rstd in fp32 (4h) and the bf16 output (2h); RoPE keeps its cache rows gathered at the
  dataloader's positions (4d: ``rope_gathered``), the rotated q (2 a d) and k (2 g d),
  the value is copied contiguous (2 g d); attention keeps its output (2 a d) and fp32 log-sum-exp (4 a); the
  SwiGLU keeps w1's output, silu's, w3's and the product (4 x 2f).  The layer input is not kept (no op of the
  layer saves x itself: the norm saves its fp32 copy).
* ``full`` (torchtitan FullAC: torch checkpoint_wrapper around the block): the block input (2h) only.
* ``selective-op`` (torchtitan SelectiveAC): the block input (2h) and the outputs of the save-list ops,
  every second matmul recomputed (the count restarts per block): matmuls 1, 3, 5 of the six (wqkv: 2(a+2g)d,
  w1: 2f, w2: 2h) and attention's output and log-sum-exp.

Attention: validation runs torchtitan's sdpa inner module in place of compiled FlexAttention (no CPU backward);
both keep q, k, v, out and the fp32 log-sum-exp (derived from torch's FlexAttentionAutogradOp, not measured).
On CUDA, F.rms_norm is the fused kernel (x and an fp32 rstd kept, the output kept as the next matmul's input:
4h + 4 per norm instead of 10h + 4): derived from torch's dispatch, not measured here.

Tensor parallelism (``--tp T``, torchtitan's sharding configs with sequence parallelism on, applied by
parallelize_llama; measured per rank over gloo with 2 ranks, tests/test_titan_tp.py): each term is split ``tp``
(heads, FFN columns: / t), ``sp`` (the norms' fp32 tensors and the block input, sequence-sharded: / t) or kept whole
(the norm outputs all-gathered over the sequence as the colwise matmuls' input; w2's partial sums over the whole
sequence under selective-op).  selective-op also keeps the reduce-scattered outputs of wo and w2 (TP only: the
save list holds reduce_scatter_tensor).  Loss parallel: the fp32 log-probabilities are the rank's vocab shard.
FSDP2 x TP: the states per rank are the TP shard (matrices / t, norms whole) sharded over the d data-parallel ranks.

FSDP2 (torchtitan's apply_fsdp_to_decoder: fully_shard with MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32), dp_shard = N ranks): fp32 sharded parameters, gradients and AdamW's two moments (4 each,
dim 0 padded to a multiple of N; the moments unpadded), measured over gloo with 2 ranks; the bf16 unsharded parameters of the
running decoder layer (reshard_after_forward), measured, and of the next one all-gathered ahead of it on a GPU
(derived: on CPU nothing runs ahead); the final norm and LM head stay unsharded in bf16 from their forward to
their backward (torchtitan does not reshard them after forward), measured.

Context parallelism (``--cp C``, torchtitan's context_parallel_degree; read from torchtitan 0.3.0's
distributed/context_parallel/api.py and torch 2.13's distributed/tensor/experimental/_context_parallel; the layer's
kept tensors measured on one rank of a fake cp group, validation/titan_cp.py, tests/test_titan_cp.py). The batch's tokens are cut
into 2C chunks, rank r keeping chunks r and 2C-1-r (cp_shard's "headtail" load balancer), so every per-token term
is the rank's s/C tokens (memplan's cp split).  FlexAttention, torchtitan's Llama 3 default (``attn_backend="flex"``),
does not run a ring: ``apply_cp_to_forward`` wraps it to all-gather K and V over the cp group
(cplib::flex_cp_allgather) and FlexAttention saves its inputs, so a layer keeps the whole sequence's K and V in
place of its own rotated k and contiguous v (``cp_gathered_kv``); q, the output and log-sum-exp stay the rank's.  Their
gradients over the whole sequence are reduce-scattered in the backward (in the attention backward's moment, derived:
memplan/inventory/titan_moments.py).  The sdpa backend's ring instead (torch's
_templated_ring_attention, rotate method all-gather) keeps only local q, k, v, out, lse and holds transients
(the all-gathered K/V, the fp32 merged output and log-sum-exp) inside the attention: not modelled.  FSDP2 shards
over dp_shard x C (ParallelDims folds cp into the "fsdp" mesh): memplan's d x cp state sharding.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.hf import hf_loss_moments
from memplan.inventory.k22 import labels_term
from memplan.core.symbolic import Poly
from memplan.inventory.titan_moe import DENSE_FFN, MODE_FLAGS, TP_MEASURED, titan_moe_terms
from memplan.inventory.titan_moments import titan_layer_moments
from memplan.inventory.types import Inventory, Moment, Term, saved, transient

AC_MODES = ("none", "full", "selective-op")
# torchtitan <= 0.2's selective per-layer AC (activation_checkpoint.mode "selective", selective_ac_option an int N):
# torch's checkpoint_wrapper (FullAC's) around every N-th decoder layer, the others as under none; its default "2"
LAYER_AC = "selective-layer"
LAYER_AC_DEFAULT = 2
# torchtitan's MemoryBudgetAC (activation_checkpoint "memory-budget": torch._functorch.config.activation_memory_budget
# = F, the blocks compiled): --ac budget:F, F in tenths from 0 to 1 (memplan/inventory/compiled.py BUDGET_SAVED)
BUDGET_AC = "budget"
SOURCE = "torchtitan 0.3.0 Llama 3 block; measured and traced on CPU (validation/titan.py)"


@dataclass(frozen=True)
class TitanTerm:
    """One kept tensor of the layer: bytes per token, the AC modes that keep it."""
    id: str
    name: str
    bytes_per_token: int
    modes: tuple[str, ...]
    split: str = ""  # under TP t: "tp" / t (heads, FFN columns, vocab), "sp" / t (the sequence-parallel norms), "" whole
    tp_only: bool = False  # exists only with TP (t > 1)
    cp_gathered: bool = False  # under context parallelism the all-gathered whole-sequence tensor is kept instead


def rope_gathered(bytes_per_token: int, what: str) -> TitanTerm:
    """The RoPE cache rows a layer gathers at the dataloader's positions and keeps under AC none: torchtitan 0.3.0's
    Trainer always hands the model ``positions`` (its text datasets yield them with every sample;
    ``post_dataloading_process`` passes them on as a model kwarg), so each layer's RoPE makes its own (b, s, 1, width)
    copy of its buffer (models/common/rope.py ``_reshape_for_broadcast``: ``torch.gather``, ``rope_cache[positions]``
    at b = 1) in place of a view of the buffer, and the rotation's multiplications save it (ComplexRoPE: d/2
    complex64, 4d B per token; CosSinRoPE: cos and sin, slices of one fp32 [2d], 8d B; DeepSeek-V3: d = the rotated
    width).  selective-op recomputes it (the gather is not in SelectiveAC's save list), full keeps the checkpoint's
    input positions only (the batch's one storage).  Whole under TP (the attention runs on the all-gathered sequence;
    the rows replicated over tp), the rank's s / C tokens under CP (the positions CP-sharded with the tokens).
    Measured on CPU with the positions passed (validation/titan.py ``kept_storages``)."""
    return TitanTerm("rope.gathered", f"RoPE cache rows gathered at the positions ({what}; as fp32 bytes)",
                     bytes_per_token, ("none",))


def llama3_layer_terms(h: int, a: int, g: int, f: int, d: int | None = None, qk_norm: bool = False) -> list[TitanTerm]:
    """The layer's kept tensors (bytes per token) for hidden h, heads a, KV heads g, FFN f, head dim d (h / a);
    ``qk_norm``: torchtitan's Qwen3 block (RMSNorms on the head dim over q and k before RoPE, CosSinRoPE): each keeps
    its fp32 input, rstd (one per head) and fp32 x * rstd under AC none; its bf16 output is not kept (CosSinRoPE
    multiplies it by cos / sin buffers, which saves only them; the rotated q, k stay as in Llama 3), measured."""
    d = d or h // a
    norm = [("x_fp32", "x in fp32", 4 * h, "sp"), ("rstd", "rstd (fp32)", 4, "sp"),
            ("x_rstd", "x * rstd in fp32", 4 * h, "sp"),
            ("out", "norm output (bf16), all-gathered over the sequence under TP", 2 * h, "")]
    terms = [TitanTerm("input", "block input (bf16), kept by the checkpoint", 2 * h, ("full", "selective-op"), "sp")]
    terms += [TitanTerm(f"attention_norm.{i}", f"attention_norm: {n}", v, ("none",), sp) for i, n, v, sp in norm]
    terms += [
        TitanTerm("wqkv.out", "fused QKV linear output (bf16), matmul 1", 2 * (a + 2 * g) * d, ("selective-op",), "tp"),
        *[TitanTerm(f"{w}_norm.{i}", f"{w}_norm (head dim): {n}", v * heads, ("none",), "tp")
          for w, heads in (("q", a), ("k", g)) if qk_norm
          for i, n, v in (("x_fp32", "x in fp32", 4 * d), ("rstd", "rstd (fp32)", 4), ("x_rstd", "x * rstd in fp32", 4 * d))],
        rope_gathered(8 * d if qk_norm else 4 * d, "cos and sin, fp32 2d" if qk_norm else "complex64 d/2"),
        TitanTerm("rope.q", "rotated q (bf16)", 2 * a * d, ("none",), "tp"),
        TitanTerm("rope.k", "rotated k (bf16)", 2 * g * d, ("none",), "tp", cp_gathered=True),
        TitanTerm("v.contiguous", "v copied contiguous (bf16)", 2 * g * d, ("none",), "tp", cp_gathered=True),
        TitanTerm("attn.out", "attention output (bf16)", 2 * a * d, ("none", "selective-op"), "tp"),
        TitanTerm("attn.lse", "attention log-sum-exp (fp32)", 4 * a, ("none", "selective-op"), "tp"),
        TitanTerm("wo.rs", "wo output reduce-scattered over the sequence (bf16), TP only", 2 * h, ("selective-op",),
                  "sp", True),
    ]
    terms += [TitanTerm(f"ffn_norm.{i}", f"ffn_norm: {n}", v, ("none",), sp) for i, n, v, sp in norm]
    terms += [
        TitanTerm("w1.out", "w1 output (bf16), matmul 3", 2 * f, ("none", "selective-op"), "tp"),
        TitanTerm("silu.out", "silu output (bf16)", 2 * f, ("none",), "tp"),
        TitanTerm("w3.out", "w3 output (bf16)", 2 * f, ("none",), "tp"),
        TitanTerm("swiglu.mul", "silu(w1) * w3 (bf16)", 2 * f, ("none",), "tp"),
        TitanTerm("w2.out", "w2 output (bf16), matmul 5; under TP the partial sums over the whole sequence", 2 * h,
                  ("selective-op",)),
        TitanTerm("w2.rs", "w2 output reduce-scattered over the sequence (bf16), TP only", 2 * h, ("selective-op",),
                  "sp", True),
    ]
    return terms


def rank_bytes_per_token(term: TitanTerm, t: int = 1) -> int:
    """A term's bytes per token of the global s b on one rank of a TP group of t (0 for a TP-only term at t = 1)."""
    if term.tp_only and t == 1:
        return 0
    return term.bytes_per_token // (t if term.split else 1)


def layer_bytes(terms: list[TitanTerm], ac: str, s: int, b: int, t: int = 1) -> int:
    """Bytes one layer keeps after its forward under AC mode ``ac``, on one rank of a TP group of ``t``."""
    if ac not in AC_MODES:
        raise MemplanError(f"unknown --ac '{ac}' for --impl torchtitan; modelled: {', '.join(AC_MODES)}")
    return s * b * sum(rank_bytes_per_token(x, t) for x in terms if ac in x.modes)


def titan_ac_mode(ac: str | None) -> tuple[str, int]:
    """--ac as (mode, N): N the layer frequency of selective-layer[:N] (default 2), the tenths of budget:F (F = 0,
    0.1, ..., 1: the budgets traced), else 1; unknown modes refused."""
    mode, _, every = (ac or "none").partition(":")
    if mode == BUDGET_AC:
        tenths = round(float(every) * 10) if every.replace(".", "", 1).isdigit() and every.isascii() else -1
        if 0 <= tenths <= 10 and abs(float(every) * 10 - tenths) < 1e-9:
            return mode, tenths
        raise MemplanError(f"--ac budget:F: F is torchtitan's memory_budget, traced at 0, 0.1, ..., 1 (got "
                           f"{str(every)[:20]!r})")
    if mode == LAYER_AC:
        if not every:
            return mode, LAYER_AC_DEFAULT
        if every.isascii() and every.isdigit() and int(every) >= 1:
            return mode, int(every)
    elif mode in AC_MODES and not every:
        return mode, 1
    raise MemplanError(f"--impl torchtitan: --ac {str(ac)[:40]!r} is not modelled; modelled: {', '.join(AC_MODES)}, "
                       f"{LAYER_AC}[:N] (N >= 1), {BUDGET_AC}:F (with --compile)")


def checkpointed_layers(layers: int, every: int) -> list[int]:
    """The decoder layers (0-based) torchtitan's selective per-layer AC checkpoints: it counts the blocks it wraps
    from 1 and wraps those whose count is a multiple of N (``_apply_ac_to_transformer_block``: ``_count % ac_freq
    == 0``), so layers N-1, 2N-1, ...: L // N of them."""
    return [i for i in range(layers) if (i + 1) % every == 0]


@dataclass(frozen=True)
class Fsdp2States:
    """Per-rank bytes of FSDP2's states under torchtitan's apply_fsdp_to_decoder."""
    params: int  # fp32 sharded parameters (dim 0 padded to a multiple of the ranks)
    grads: int  # fp32 sharded gradients
    adam: int  # AdamW exp_avg + exp_avg_sq, fp32, the local shard unpadded
    layers_unsharded: int  # bf16 unsharded parameters of the decoder layers in flight
    head_unsharded: int  # bf16 final norm + LM head, not resharded after forward (torchtitan's default)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.adam + self.layers_unsharded + self.head_unsharded


def sharded_numel(shape: tuple[int, ...], n: int) -> int:
    """A parameter's per-rank elements under fully_shard over n ranks: dim 0 split in ceil(d0 / n) rows."""
    rows = -(-shape[0] // n)
    rest = 1
    for x in shape[1:]:
        rest *= x
    return rows * rest


def local_numel(shape: tuple[int, ...], n: int, rank: int) -> int:
    """A parameter's real (unpadded) elements on ``rank``: its rows of torch.chunk(d0, n)."""
    rows = -(-shape[0] // n)
    return max(0, min(rows, shape[0] - rank * rows)) * (sharded_numel(shape, n) // rows)


# layers torchtitan's FSDP2 all-gathers ahead of the running one on a GPU (derived: fully_shard's prefetch)
GPU_PREFETCH = 1


def fsdp2_states(param_shapes: list[tuple[int, ...]], layer_shapes: list[tuple[int, ...]],
                 head_shapes: list[tuple[int, ...]], n: int, prefetch: int = GPU_PREFETCH, rank: int = 0) -> Fsdp2States:
    """FSDP2 states per rank: ``param_shapes`` every parameter's shape, ``layer_shapes`` one decoder layer's,
    ``head_shapes`` the final norm's and LM head's, ``n`` = dp_shard; ``prefetch`` layers all-gathered ahead of
    the running one (GPU: 1, the all-gather runs on its own stream ahead of the compute, derived; on CPU
    nothing runs ahead: 0, measured).  AdamW's moments are made like the local shard, unpadded (``rank``'s rows;
rank 0 holds the most); the sharded parameters and gradients keep the padded size.  An unsharded parameter is the all-gather of n padded shards (n x
    ceil(d0 / n) rows).  The bf16 copies exist at n = 1 too (mixed precision)."""
    if n < 1:
        raise MemplanError("--gpus must be >= 1")

    def shard(shapes):
        return sum(sharded_numel(s, n) for s in shapes)

    local = sum(local_numel(s, n, rank) for s in param_shapes)
    return Fsdp2States(params=4 * shard(param_shapes), grads=4 * shard(param_shapes), adam=8 * local,
                       layers_unsharded=2 * n * shard(layer_shapes) * (1 + prefetch),
                       head_unsharded=2 * n * shard(head_shapes))


CP_SOURCE = ("measured: torchtitan 0.3.0 apply_cp_to_forward on its block, one rank of a fake cp group, the CPU sdpa "
             "kernel in place of FlexAttention's (validation/titan_cp.py)")


def cp_gathered_kv(g: int, d: int) -> Term:
    """The whole sequence's K and V a layer keeps under context parallelism: FlexAttention saves the all-gathered
    K and V (cplib::flex_cp_allgather's two outputs, g d bf16 each per token of the whole sequence), and the rank's
    own rotated k and contiguous v are then freed (rope.k, v.contiguous: without_cp).  Written before the cp split
    (Term.bytes divides by cp): 2 g d cp s b elements, i.e. 2 g d s b on a rank, two storages.  Kept where rope.k
    and v.contiguous are (AC none: selective-op's save list does not hold the all-gather); cp > 1 only; heads split
    over t."""
    return Term("cp.kv_gathered", "K and V of the whole sequence (bf16), all-gathered over cp for FlexAttention",
                "attn", Poly.parse(f"{2 * g * d} cp s b"), "act", True, False, True, False, "layer", False, CP_SOURCE,
                needs_cp=True, storages=2)


MEASURED = (
    "measured: torchtitan 0.3.0 Llama 3 block on CPU (validation/titan.py; tests/test_titan.py, TP: tests/test_titan_tp.py)")
DERIVED = "derived: torchtitan 0.3.0's and torch 2.13's code, not measured"
def titan_term(t: TitanTerm, src: str, scope: str = "layer") -> Term:
    """A TitanTerm (bytes per token) as an Inventory term: fp32 where its name says so, else the activation dtype."""
    fp32 = "fp32" in t.name or t.id.endswith("rstd")
    per = t.bytes_per_token // (4 if fp32 else 2)
    flags = MODE_FLAGS[t.modes] if scope == "layer" else {}
    return saved(t.id, t.name, t.id.split(".")[0], f"{per} s b", "fp32" if fp32 else "act", scope=scope, k22=False,
                 src=src, tp=t.split == "tp", sp=t.split == "sp", needs_tp=t.tp_only, without_cp=t.cp_gathered, **flags)


def cuda_norm(terms: list[TitanTerm]) -> list[TitanTerm]:
    """On CUDA, F.rms_norm is one fused kernel keeping its bf16 input and its fp32 rstd (derived); its output stays
    as the next matmul's input (the all-gathered one under TP: measured on CPU, where it is a tensor of its own)."""
    out: list[TitanTerm] = []
    for t in terms:
        which = t.id.split(".")[0]
        if which.endswith("norm") and t.id.endswith(".x_fp32"):  # the bf16 input: half the fp32 copy
            out.append(TitanTerm(f"{which}.x", f"{which}: input (bf16), fused kernel (CUDA)", t.bytes_per_token // 2,
                                 t.modes, t.split))
        elif which.endswith("norm") and t.id.endswith(".rstd"):
            out.append(dataclasses.replace(t, name=f"{which}: rstd (fp32), fused kernel (CUDA)"))
        elif not which.endswith("norm") or t.id.endswith(".out"):
            out.append(t)
    return out


def _vocab_split(term: Term) -> Term:
    """A loss transient as loss parallel makes it: a vocab-wide tensor is the rank's vocab shard (/ t)."""
    vocab = any(name == "v" for mono, _ in term.elements.terms for name, _ in mono)
    return dataclasses.replace(term, tp_split=True) if vocab else term


TAIL = (f"{DERIVED}; under TP measured on CPU over gloo (2 ranks, tests/test_titan_tp.py): the final norm's fp32 "
        "terms sequence-sharded, its output all-gathered")


# the ModelSpec fields a dense Qwen3 (torchtitan's models/qwen3 _build_qwen3_layers) may set off their defaults:
# sizes, names and the q / k norms on the head dim; any other (sliding window, sandwich norms, ...) is not its layout
QWEN3_FIELDS = frozenset({"name", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                          "ffn_hidden_size", "num_kv_heads", "head_dim", "norm", "dropout", "tied_embeddings",
                          "position_embedding", "mlp", "bias", "attention", "qk_norm", "rope_theta", "norm_eps",
                          "inventory"})


# and those torchtitan's Qwen3 MoE (_build_qwen3_moe_layers: every layer MoE, no shared experts) sets besides
QWEN3_MOE_FIELDS = QWEN3_FIELDS | {"num_experts", "moe_top_k", "moe_ffn_hidden_size"}


def _is_qwen3(model: ModelSpec, fields: frozenset) -> bool:
    own = type(model).model_fields
    return model.qk_norm and model.qk_norm_width == "head" and not model.tied_embeddings and all(
        getattr(model, k) == f.default for k, f in own.items() if k not in fields)


def is_qwen3_dense(model: ModelSpec) -> bool:
    """A model with transformers' traced inventory that is torchtitan's dense Qwen3 layout (QWEN3_FIELDS)."""
    return _is_qwen3(model, QWEN3_FIELDS)


def is_qwen3_moe(model: ModelSpec) -> bool:
    """torchtitan's Qwen3 MoE layout (QWEN3_MOE_FIELDS: routed experts only, every layer, balanced routing)."""
    return model.is_moe and _is_qwen3(model, QWEN3_MOE_FIELDS)


# and those torchtitan's DeepSeek-V3 (models/deepseek_v3 build_mla_moe_layers: MLA, n_dense_layers dense first
# layers, routed and shared experts; no q / k norms on the heads) sets
DSV3_FIELDS = (QWEN3_FIELDS - {"qk_norm"}) | {"num_experts", "moe_top_k", "moe_ffn_hidden_size",
                                              "moe_shared_ffn_hidden_size", "moe_first_dense_layers", "kv_lora_rank",
                                              "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                              "mtp_layers", "mla_down_replicated"}


def is_dsv3(model: ModelSpec) -> bool:
    """torchtitan's DeepSeek-V3 layout (DSV3_FIELDS: MLA with its latent widths, MoE with shared experts)."""
    own = type(model).model_fields
    return (model.is_mla and model.is_moe and model.moe_shared_ffn_hidden_size > 0 and not model.qk_norm
            and not model.tied_embeddings and model.qk_nope_head_dim is not None
            and model.qk_rope_head_dim is not None and model.v_head_dim is not None
            and all(getattr(model, k) == f.default for k, f in own.items() if k not in DSV3_FIELDS))


def check_titan_layout(model: ModelSpec) -> None:
    """The layouts `--impl torchtitan` models (Llama 3, dense Qwen3, Qwen3 MoE, DeepSeek-V3); any other refused in
    one line."""
    if is_dsv3(model):
        return
    moe = is_qwen3_moe(model)
    if ((model.is_moe and not moe) or model.is_mla or (model.inventory is not None and not (moe or is_qwen3_dense(model)))
            or model.norm != "rmsnorm" or model.mlp != "swiglu" or model.bias or model.dropout):
        raise MemplanError("--impl torchtitan: memplan models torchtitan's Llama 3, dense Qwen3, Qwen3 MoE and "
                           "DeepSeek-V3 layouts only (RMSNorm, SwiGLU, q / k norms on the head dim or none, no biases, "
                           "no dropout; MoE: Qwen3's routed experts in every layer, or DeepSeek-V3's MLA with dense "
                           "first layers and shared experts; balanced routing)")


def titan_model(model: ModelSpec, mtp: int = 0) -> ModelSpec:
    """``model`` as torchtitan builds it, its layout checked (check_titan_layout): DeepSeek-V3 with ``mtp``
    multi-token-prediction layers (model_registry's num_mtp_layers, 0 by default as torchtitan's flavours: the preset's
    own are dropped; memplan/inventory/titan_mtp.py), its latent down projections replicated under TP
    (``mla_down_replicated``: set_deepseek_v3_sharding_config)."""
    check_titan_layout(model)
    if mtp and not is_dsv3(model):
        raise MemplanError("--mtp N: torchtitan 0.3.0 builds multi-token-prediction layers for DeepSeek-V3 only "
                           "(models/deepseek_v3/mtp.py)")
    return model.model_copy(update={"mtp_layers": mtp, "mla_down_replicated": True}) if is_dsv3(model) else model


def titan_inventory(model: ModelSpec, device: str, layer_terms: tuple[Term, ...] = (),
                    layer_moments: tuple[Moment, ...] = ()) -> Inventory:
    """torchtitan's Llama 3 as an Inventory: the layer's kept tensors per AC mode (the slice above: CPU kernels
    measured; on CUDA the fused RMSNorm, derived), the final norm, LM head input, fp32 loss and token ids (derived
    from torchtitan's cross_entropy_loss: ``F.cross_entropy(pred.float(), labels)``), the loss's moments and the
    layer's backward moments (memplan/inventory/titan_moments.py: the dense layer's and the Qwen3 MoE layer's).
    ``layer_terms``: another layer's terms in place of Llama 3's and Qwen3's and ``layer_moments`` its backward
    moments (DeepSeek-V3: memplan/inventory/titan_dsv3.py, which gives them; refused without)."""
    check_titan_layout(model)
    if is_dsv3(model) and not layer_terms:
        raise MemplanError("torchtitan's DeepSeek-V3 layer is memplan/inventory/titan_dsv3.py's (dsv3_inventory)")
    moe = is_qwen3_moe(model)
    h = model.hidden_size
    terms = llama3_layer_terms(h, model.num_attention_heads, model.g, model.f, model.q // model.num_attention_heads,
                               model.qk_norm)
    if moe:  # the MoE in place of the dense feed-forward (memplan/inventory/titan_moe.py)
        terms = [t for t in terms if t.id not in DENSE_FFN]
    src = MEASURED
    if device == "cuda":
        terms, src = cuda_norm(terms), f"{MEASURED}; on CUDA the fused RMSNorm derived from torch 2.13's code, not measured"
    final = [t for t in llama3_layer_terms(h, 1, 1, 1, 1) if t.id.startswith("ffn_norm.")]
    final = cuda_norm(final) if device == "cuda" else final
    loss = f"{DERIVED}; cross_entropy_loss on the fp32 logits"
    outside = [titan_term(TitanTerm("final_" + t.id.replace("ffn_", ""), "final " + t.name.replace("ffn_", ""),
                               t.bytes_per_token, (), t.split), TAIL, "last") for t in final]
    outside += [
        saved("token_ids", "token ids (int64, tok_embeddings)", "embedding", "s b", "int64", scope="first", k22=False,
              src=DERIVED),
        # under TP the vocab-parallel tok_embeddings (RowwiseParallel, DTensor's _MaskPartial) keeps its vocab-shard
        # mask in the weights' dtype: measured in the MTP layer's call of the same module (tests/test_titan_mtp_tp.py)
        saved("embed_mask", "tok_embeddings' vocab-shard mask (bf16; TP only: the vocab-parallel embedding's)",
              "embedding", "s b", "act", scope="first", k22=False, needs_tp=True,
              src="derived: measured in DeepSeek-V3's MTP layer, which calls the same vocab-parallel module over gloo "
                  "(tests/test_titan_mtp_tp.py)"),
        saved("logits_fp32", "fp32 log-softmax of the logits (its vocab shard under TP: loss parallel)", "output",
              "s b v", "fp32", scope="last", k22=False, src=loss, tp=True),
    ]
    # the targets: torchtitan hands the loader's labels to the loss as they are (a view; no target copy, TP's
    # loss-parallel function included: tests/test_titan_tp.py), so they are the training loop's held labels only
    # (a separate target_ids term counted them twice: measured in a whole step, validation/titan_step.py)
    # and the dataloader's positions (int64 s b: its text datasets yield them with every sample; the Trainer holds the
    # micro-batch's input dict through the step and passes them to every layer: measured in the whole step; under PP
    # each stage holds them, counted on the last with the labels)
    held = (labels_term(), transient("positions", "the dataloader's positions (int64, held by the training loop, "
                                     "passed to every layer's RoPE)", "s b", "int64", scope="last",
                                     src="measured: a whole torchtitan step over gloo (validation/titan_step.py)"))
    # the loss's moments: torchtitan's cross_entropy_loss runs the ops of transformers' ForCausalLMLoss (bf16
    # logits, their fp32 copy, log-softmax), so its measured moments apply: derived for torchtitan
    # under TP the logits and their gradients are vocab shards (loss parallel: _LossParallelCrossEntropy), derived
    moments = tuple(dataclasses.replace(m, source=f"derived: {m.source}, with torchtitan's loss (same ops; not "
                                        "measured); under TP the vocab-wide tensors / t (loss parallel)",
                                        transients=tuple(_vocab_split(x) for x in m.transients))
                    for m in hf_loss_moments(model, final_norm=False))
    layer = tuple(titan_term(t, src) for t in terms) + tuple(titan_moe_terms(model, device) if moe else ())
    if moe:  # the MoE's input: all-gathered over the sequence under TP at ep 1, sequence-sharded at ep > 1 (titan_moe)
        layer = tuple(dataclasses.replace(t, tp_split=True, etp_gathered=True, source=f"{t.source}; {TP_MEASURED}")
                      if t.id == "ffn_norm.out" else t for t in layer)
    layer = layer_terms or layer + (cp_gathered_kv(model.g, model.q // model.num_attention_heads),)
    # the layer's backward moments, dense or Qwen3 MoE (DeepSeek-V3's given: memplan/inventory/titan_dsv3_moments.py)
    moments = (layer_moments if layer_terms else titan_layer_moments(model, device, layer)) + moments
    return Inventory(f"torchtitan/{device}", layer + tuple(outside), moments, "buffer",
                     False, "fused", "torch", held, tied_grad_waits=False)


TITAN_LEFT = ("FlexAttention's block masks built from the dataloader's positions, "
              "CUDA kernels measured (the fused RMSNorm's and FlexAttention's backward, derived), the layers' backward "
              "moments under compile with float8 or the memory-budget AC (and on CUDA: triton's, derived from the CPU "
              "backend's), FSDP2's reduce-scatter overlapping the next layer's backward; "
              "async TP measured (its workspace and overlap derived: memplan/inventory/titan_async_tp.py), "
              "Qwen3 MoE compiled with EP, TP or CP or with float8, its uneven routing (balanced modelled), its "
              "layers' backward moments with TP measured (derived; CP 2 measured, as the dense Llama 3 layer's at TP 2 and at "
              "CP 2, not both together), its attention_norm's backward moment (the dense layer's modelled), "
              "DeepSeek-V3 compiled, with float8 or with the split-backward pipeline schedules (and its MTP layers on "
              "CUDA measured, their FLOPs' step time calibrated, its 16B / 236B flavours' router options, "
              "FlexAttention's MLA save set and backward measured on CUDA, its layers' backward moments with EP, TP "
              "or CP measured, the dense first layers' own weight gradients in their attention's and reduce-scatter's "
              "moments), Qwen3 with TP or CP measured, "
              "CP with the sdpa ring or with TP measured, compile with CP or with selective-op AC and float8, compile with "
              "full AC and TP measured (torch 2.13 stops: compiled.FULL_TP_ERROR), compile with float8 and TP outside full AC "
              "(the partitioner's float8 casts), budget AC's recompute; the allocation stream checked against a CUDA recording (a CPU one checks it: "
              "tests/test_titan_alloc.py), MoE's and PP's streams against any")


SPLIT_BLOCK = "split backward"  # the block of `split_backward_grads`' terms


@functools.lru_cache(maxsize=16)  # the same Term objects on every call: memplan/memory/term_bytes.py caches by them
def split_backward_grads(model: ModelSpec, device: str) -> tuple[Term, ...]:
    """What a zero-bubble schedule's split backward keeps from I (input gradients) to W (weight gradients) of one
    micro-batch, beyond the saved tensors: torch's ``stage_backward_input`` hooks the nodes where the input and the
    weight paths meet and keeps the gradient flowing into each (``param_groups``' grads) until
    ``stage_backward_weight`` (torch 2.13 distributed/pipelining/_backward.py). In torchtitan's Llama 3 layer: the
    output gradient of each linear (wq, wk, wv, w1, w3 shard the columns under TP; wo and w2's whole-sequence partial
    sums do not shard) in bf16, and of the two RMSNorm weight multiplications, fp32 with torch's composite CPU
    F.rms_norm (measured over gloo: validation/titan_pp.py grads_peak, tests/test_titan_multistage.py), bf16 through
    the fused CUDA kernel (derived); scope "last": the final norm's and the LM head's (the logits, bf16, the rank's
    vocab shard under loss parallel). Not in the inventory's terms: memplan/memory/stage.py adds them for those
    schedules only. TP and CUDA derived, not measured."""
    norm = "fp32" if device == "cpu" else "act"
    src = (f"{DERIVED}; torch's stage_backward_input keeps these gradients from I to W (measured on CPU without TP: "
           "validation/titan_pp.py)")
    return (
        saved("zb.linear_out_col", "I->W: output gradients of wq, wk, wv, w1, w3", SPLIT_BLOCK,
              f"{model.q + 2 * model.g * (model.q // model.num_attention_heads) + 2 * model.f} s b", tp=True,
              k22=False, src=src),
        saved("zb.linear_out_row", "I->W: output gradients of wo, w2 (whole-sequence partial sums under TP)",
              SPLIT_BLOCK, f"{2 * model.hidden_size} s b", k22=False, src=src),
        saved("zb.norm_out", "I->W: output gradients of the two RMSNorm weight products", SPLIT_BLOCK,
              f"{2 * model.hidden_size} s b", norm, sp=True, k22=False, src=src),
        saved("zb.final_norm_out", "I->W: output gradient of the final RMSNorm's weight product", SPLIT_BLOCK,
              f"{model.hidden_size} s b", norm, sp=True, k22=False, src=src, scope="last"),
        saved("zb.logits", "I->W: output gradient of the LM head (the logits, its vocab shard under TP)",
              SPLIT_BLOCK, "s b v", tp=True, k22=False, src=src, scope="last"),
    )
