"""The four specs a memory estimate is made of: model, parallel plan, training, GPU.

All are frozen pydantic models that reject unknown keys. Checks that involve a
single spec live on it; checks across specs (a % t, L % (p m), ...) live on
`Config`, the only place where the four meet. Symbols follow K22 Table 1.
"""

from __future__ import annotations

import difflib
import enum
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from memplan.core.errors import MemplanError
from memplan.core.units import parse_size


class Recompute(enum.IntEnum):
    """Activation recomputation, ordered from most memory to least (K22 section 4.1, 5)."""

    NONE = 0
    """Store every activation of every layer (K22 Eq. 1 / 2 / 4)."""

    SELECTIVE = 1
    """Recompute the attention core (QK^T, softmax, softmax dropout, attention over V) in the
    backward pass: drops the 5as^2b term for about 2-3% more FLOPs (K22 section 5)."""

    FULL = 2
    """Store only each layer's input (2sbh) and re-run the layer's forward in the backward pass
    (K22 section 4.1 'full activation recomputation'). With `recompute_num_layers` only that many
    layers per model chunk are recomputed (Megatron-LM `--recompute-method block`), the rest store
    everything."""

    @classmethod
    def parse(cls, value: "str | int | Recompute") -> "Recompute":
        if isinstance(value, Recompute):
            return value
        try:
            if isinstance(value, int) and not isinstance(value, bool):
                return cls(value)
            return cls[str(value).strip().upper()]
        except (KeyError, ValueError):
            raise ValueError(f"recompute must be one of none, selective, full (got {echo(value)})") from None

    @property
    def label(self) -> str:
        return self.name.lower()


def echo(value: Any, limit: int = 60) -> str:
    """A user's value for an error message, bounded (a YAML alias bomb must not print gigabytes)."""
    text = repr(value) if not isinstance(value, (dict, list, tuple)) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


class _Spec(BaseModel):
    # strict: `hidden_size: true` or `num_layers: 2.5` is refused rather than coerced (to 1, to 2)
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ModelSpec(_Spec):
    """A decoder-only transformer's architecture (no weights)."""

    name: str = "custom"
    num_layers: int = Field(gt=0, description="L, transformer layers")
    hidden_size: int = Field(gt=0, description="h")
    num_attention_heads: int = Field(gt=0, description="a")
    seq_length: int = Field(gt=0, description="s")
    vocab_size: int = Field(gt=0, description="v")
    ffn_hidden_size: Optional[int] = Field(default=None, gt=0, description="f, MLP width (default 4h)")
    num_kv_heads: Optional[int] = Field(default=None, gt=0, description="g, key/value heads (default a)")
    head_dim: Optional[int] = Field(
        default=None, gt=0,
        description="width of one attention head (default h/a; transformers head_dim, Megatron-LM "
        "--kv-channels); the attention width is q = a x head_dim",
    )
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    dropout: bool = True
    tied_embeddings: bool = True
    position_embedding: Literal["learned", "rope"] = "learned"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    bias: bool = True
    attention: Literal["eager", "flash"] = Field(
        default="eager",
        description="attention kernel: eager stores the s x s scores (K22); flash (FlashAttention, "
        "cuDNN fused, SDPA flash) stores only its output and an fp32 log-sum-exp",
    )
    qkv_bias: bool = Field(
        default=False,
        description="biases on the Q, K and V projections only (Qwen2; `bias` puts one on every linear)",
    )
    sandwich_norms: bool = Field(
        default=False,
        description="two more norms per layer, on the attention's and the MLP's outputs (Gemma 2, Gemma 3): "
        "four per layer",
    )
    qk_norm: bool = Field(
        default=False,
        description="an RMSNorm on each head's queries and keys (two head_dim-wide weights per layer: Qwen3, "
        "Qwen3-MoE)",
    )
    # Mixture of experts (all None / 0: a dense model). An MoE layer's MLP is a router (E x h) choosing k of
    # E routed experts for each token, each expert an MLP of width f_e (gated as `mlp` says), plus shared
    # experts every token goes through; the first `moe_first_dense_layers` layers keep a dense MLP f wide.
    # Expert parallelism (ParallelSpec ep, etp) splits the routed experts over GPUs (memplan/parallel.py).
    num_experts: Optional[int] = Field(
        default=None, gt=0, description="E, routed experts per MoE layer (transformers num_local_experts / "
        "num_experts / n_routed_experts; Megatron-LM --num-experts)")
    moe_top_k: Optional[int] = Field(
        default=None, gt=0, description="k, routed experts each token goes through (transformers "
        "num_experts_per_tok; Megatron-LM --moe-router-topk)")
    moe_ffn_hidden_size: Optional[int] = Field(
        default=None, gt=0, description="f_e, one routed expert's MLP width (default f; transformers "
        "moe_intermediate_size, Mixtral's intermediate_size; Megatron-LM --moe-ffn-hidden-size)")
    moe_shared_ffn_hidden_size: int = Field(
        default=0, ge=0, description="f_s, the shared experts' MLP width, all of them together (0: none; "
        "DeepSeek-V3 n_shared_experts x moe_intermediate_size; Megatron-LM "
        "--moe-shared-expert-intermediate-size)")
    moe_first_dense_layers: int = Field(
        default=0, ge=0, description="layers before the first MoE layer, each with a dense MLP f wide "
        "(DeepSeek-V3 first_k_dense_replace; Megatron-LM --moe-layer-freq [0]*k+[1]*(L-k))")
    # How Megatron-LM routes an MoE layer's tokens at run time (not architecture, but what the layer saves
    # depends on it: memplan/terms_moe.py); --impl megatron / megatron-local only.
    moe_imbalance: float = Field(
        default=1.0, ge=1.0, le=1024.0, description="the busiest GPU's share of the routed tokens relative to the "
        "average (1.0: perfectly balanced routing); scales the routed-token activations on the peak GPU")
    moe_capacity_factor: Optional[float] = Field(
        default=None, gt=0, le=1024.0, description="each expert takes at most C k s b / E tokens, the others are "
        "dropped (Megatron-LM --moe-expert-capacity-factor; None: no dropping)")
    moe_pad_to_capacity: bool = Field(
        default=False, description="pad every expert's input to its capacity (Megatron-LM "
        "--moe-pad-expert-input-to-capacity; needs moe_capacity_factor)")
    moe_token_dispatcher: Literal["alltoall", "allgather"] = Field(
        default="alltoall", description="Megatron-LM --moe-token-dispatcher-type")
    # Multi-head latent attention (DeepSeek-V2 / V3; all None: standard attention). K and V come from a
    # kv_lora_rank-wide latent (kv_a_proj_with_mqa h -> r_kv + d_r, then kv_b_proj r_kv -> a (d_n + d_v)), Q
    # from a q_lora_rank-wide one (q_a_proj, q_b_proj) or directly; each head's query and key are d_n + d_r
    # wide (d_r of them rotated), its value d_v.
    kv_lora_rank: Optional[int] = Field(
        default=None, gt=0, description="r_kv, the K / V latent's width: multi-head latent attention (DeepSeek-V3 "
        "kv_lora_rank; Megatron-LM --kv-lora-rank)")
    q_lora_rank: Optional[int] = Field(
        default=None, gt=0, description="r_q, the query latent's width (None: queries projected from h directly; "
        "DeepSeek-V3 q_lora_rank)")
    qk_nope_head_dim: Optional[int] = Field(default=None, gt=0, description="d_n, a head's query / key width "
                                            "without rotary embedding (DeepSeek-V3 qk_nope_head_dim)")
    qk_rope_head_dim: Optional[int] = Field(default=None, gt=0, description="d_r, a head's rotated query / key "
                                            "width, its key part shared by the heads (qk_rope_head_dim)")
    v_head_dim: Optional[int] = Field(default=None, gt=0, description="d_v, a head's value width (v_head_dim)")
    mtp_layers: int = Field(
        default=0, ge=0, description="multi-token-prediction modules on the last stage (DeepSeek-V3 "
        "num_nextn_predict_layers; Megatron-LM --mtp-num-layers): each an embedding / hidden norm, a 2h -> h "
        "projection, one transformer layer and the shared output head's loss for one more token")
    inventory: Optional[str] = Field(
        default=None,
        description="directory of the model's traced inventories (memplan trace): what transformers' own "
        "code saves, used by --impl hf-sdpa / hf-eager instead of a hand-written inventory",
    )

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (kv_lora_rank set)."""
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts model (num_experts set)."""
        return self.num_experts is not None

    @property
    def fe(self) -> int:
        """f_e, one routed expert's MLP width (f unless moe_ffn_hidden_size says otherwise)."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.f

    @property
    def moe_layers(self) -> int:
        """Layers with a mixture-of-experts MLP (0 for a dense model)."""
        return self.num_layers - self.moe_first_dense_layers if self.is_moe else 0

    @property
    def f(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def g(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_attention_heads

    @property
    def q(self) -> int:
        """The attention width a x head_dim: Q and the attention output are q wide, K and V qg/a.
        It is h unless the config sets a head_dim other than h/a (Mistral-Nemo: 32 x 128 = 4096,
        h = 5120)."""
        if self.is_mla:  # the attention output: a heads of d_v
            return self.num_attention_heads * (self.v_head_dim or 0)
        if self.head_dim is None:
            return self.hidden_size
        return self.num_attention_heads * self.head_dim

    def symbols(self, **plan: Any) -> dict[str, Any]:
        """The K22 symbols of the architecture (s, h, a, f, g, v, and the attention width q), plus
        plan symbols such as t and b (scalars or numpy arrays): the one place a formula's symbols are bound."""
        moe = dict(E=self.num_experts, fe=self.fe, fs=self.moe_shared_ffn_hidden_size) if self.is_moe else {}
        mla = dict(rq=self.q_lora_rank or 0, rkv=self.kv_lora_rank, dn=self.qk_nope_head_dim, dr=self.qk_rope_head_dim,
                   dv=self.v_head_dim) if self.is_mla else {}
        return dict(s=self.seq_length, h=self.hidden_size, a=self.num_attention_heads, f=self.f, g=self.g,
                    q=self.q, v=self.vocab_size, **moe, **mla, **plan)

    @model_validator(mode="after")
    def _shapes(self) -> "ModelSpec":
        h, a, g = self.hidden_size, self.num_attention_heads, self.g
        if h % a and self.head_dim is None and not self.is_mla:
            raise ValueError(f"hidden size h={h} is not divisible by the attention heads a={a} "
                             f"(a model whose heads are not h/a wide sets head_dim)")
        if a % g:
            raise ValueError(f"attention heads a={a} are not divisible by the key/value heads {g}")
        return self._latent()._experts()

    def _latent(self) -> "ModelSpec":
        """Multi-head latent attention's fields come together (kv_lora_rank and the three head widths; q_lora_rank
        optional), without biases."""
        fields = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not self.is_mla:
            given = [name for name in ("q_lora_rank",) + fields if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{given[0]} is a multi-head latent attention field: it needs kv_lora_rank")
            return self
        missing = [name for name in fields if getattr(self, name) is None]
        if missing:
            raise ValueError(f"kv_lora_rank={self.kv_lora_rank} (multi-head latent attention) needs {missing[0]}")
        if self.bias:
            raise ValueError("bias: memplan models multi-head latent attention without biases (DeepSeek-V3); set "
                             "bias: false")
        return self

    def _experts(self) -> "ModelSpec":
        """A mixture-of-experts model's fields agree: the MoE fields need num_experts, k <= E, at least one
        MoE layer; its experts have no biases."""
        E, k = self.num_experts, self.moe_top_k
        if self.moe_pad_to_capacity and self.moe_capacity_factor is None:
            raise ValueError("moe_pad_to_capacity needs moe_capacity_factor (the capacity experts are padded to)")
        if E is None:
            given = [name for name in ("moe_top_k", "moe_ffn_hidden_size", "moe_capacity_factor")
                     if getattr(self, name) is not None]
            given += ["moe_imbalance"] if self.moe_imbalance != 1.0 else []
            given += [name for name in ("moe_shared_ffn_hidden_size", "moe_first_dense_layers") if getattr(self, name)]
            if given:
                raise ValueError(f"{given[0]} is a mixture-of-experts field: it needs num_experts (the routed experts)")
            return self
        if k is None:
            raise ValueError(f"num_experts={E} needs moe_top_k (the routed experts each token goes through)")
        if k > E:
            raise ValueError(f"moe_top_k={k} exceeds num_experts={E}: a token cannot go through more experts than "
                             "there are")
        if self.moe_first_dense_layers >= self.num_layers:
            raise ValueError(f"moe_first_dense_layers={self.moe_first_dense_layers} leaves no MoE layer among the "
                             f"num_layers={self.num_layers}")
        if self.bias:
            raise ValueError("bias: memplan models mixture-of-experts layers without biases (Mixtral, Qwen3-MoE); "
                             "set bias: false")
        return self


class ParallelSpec(_Spec):
    """How the model is split over GPUs (K22 Table 1: t, p, d, m)."""

    tp: int = Field(default=1, gt=0, description="t, tensor-parallel size")
    pp: int = Field(default=1, gt=0, description="p, pipeline-parallel size")
    dp: int = Field(default=1, gt=0, description="d, data-parallel size")
    vpp: int = Field(default=1, gt=0, description="m, interleaved (virtual) stages per pipeline rank")
    sp: bool = Field(default=False, description="sequence parallelism (needs t > 1)")
    zero: int = Field(
        default=0,
        ge=0,
        le=3,
        description="0: none; 1: optimizer states sharded over d (Megatron-LM distributed optimizer, "
        "ZeRO-1); 2: also gradients; 3: also weights",
    )
    first_stage_layers: Optional[int] = Field(
        default=None, gt=0, description="transformer layers on the first pipeline stage (Megatron-LM "
        "--decoder-first-pipeline-num-layers); default: the even split L/p, or with last_stage_layers alone the "
        "rest split evenly")
    last_stage_layers: Optional[int] = Field(
        default=None, gt=0, description="transformer layers on the last pipeline stage (Megatron-LM "
        "--decoder-last-pipeline-num-layers)")
    zero_shard: Optional[int] = Field(
        default=None,
        gt=1,
        description="data-parallel ranks the ZeRO states are split over (default d); d / zero_shard "
        "replicas of each shard (HSDP: torchtitan dp_shard, Megatron-LM "
        "--num-distributed-optimizer-instances d/zero_shard)",
    )

    cp: int = Field(default=1, gt=0, description="context-parallel size: each sequence split over cp ranks "
                    "(Megatron-LM --context-parallel-size; memplan/parallel.py)")
    cp_comm_type: Literal["p2p", "a2a"] = Field(
        default="p2p", description="how context-parallel attention exchanges keys / values: p2p (ring attention, "
        "Transformer Engine AttnFuncWithCPAndKVP2P) or a2a (Ulysses: heads all-to-all, AttnFuncWithCPAndQKVOA2A); "
        "Megatron-LM --cp-comm-type")
    ep: int = Field(default=1, gt=0, description="expert-parallel size: each MoE layer's routed experts split over "
                    "ep ranks (Megatron-LM --expert-model-parallel-size)")
    etp: Optional[int] = Field(default=None, gt=0, description="expert tensor-parallel size: each routed expert's "
                               "MLP split over etp ranks (default t; Megatron-LM --expert-tensor-parallel-size)")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        """etp, the routed experts' tensor-parallel size (t unless set, as Megatron-LM's arguments.py defaults it)."""
        return self.etp if self.etp is not None else self.tp

    @property
    def edp(self) -> int:
        """The expert-data-parallel size: Megatron-LM folds the t x cp x d ranks of a pipeline stage into
        etp x ep x edp for the experts (megatron/core/parallel_state.py initialize_model_parallel:
        expert_data_parallel_size = world_size // (etp * ep * pp))."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def shard(self) -> int:
        """Ranks the sharded states are split over (d unless zero_shard says fewer)."""
        return self.zero_shard if self.zero_shard is not None else self.dp

    @model_validator(mode="after")
    def _own(self) -> "ParallelSpec":
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism needs tensor parallelism (t > 1)")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("interleaved stages (vpp > 1) need pipeline parallelism (p > 1)")
        if (self.first_stage_layers is not None or self.last_stage_layers is not None) and self.pp == 1:
            raise ValueError("first / last stage layers (an uneven pipeline split) need pipeline parallelism (p > 1)")
        if self.zero_shard is not None:
            if self.zero == 0:
                raise ValueError("zero_shard needs ZeRO stage 1-3 (sharded states)")
            if self.dp % self.zero_shard:
                raise ValueError(f"zero_shard={self.zero_shard} does not divide the data-parallel size d={self.dp}")
        folded = self.tp * self.cp * self.dp
        if folded % (self.expert_tp * self.ep):
            raise ValueError(f"ep*etp = {self.ep}*{self.expert_tp} does not divide t*cp*d = {self.tp}*{self.cp}*{self.dp}"
                             f" = {folded}: Megatron-LM folds a stage's t x cp x d ranks into etp x ep x expert-data-"
                             "parallel ranks (megatron/core/parallel_state.py)")
        if self.zero_shard is not None and self.ep * self.expert_tp > 1 and self.edp % (self.dp // self.zero_shard):
            raise ValueError(f"the {self.dp // self.zero_shard} distributed-optimizer instances (d/zero_shard) do not "
                             f"divide the expert-data-parallel size {self.edp} (megatron/core/parallel_state.py)")
        return self


# Byte sizes of each precision, with PyTorch Lightning's names. "mixed" follows Megatron-LM
# (docs/user-guide/features/dist_optimizer.md): 16-bit weights and activations, fp32 master
# weights and Adam moments; bf16 keeps fp32 main gradients (2 + 4 + 4 + 8 = 18 B per parameter),
# fp16 keeps fp16 model gradients and fp32 copies of them (2 + 2 + 4 + 4 + 8 = 20). "true" runs
# everything in that dtype with no master copy (a bf16 model with torch AdamW, as most
# transformers fine-tuning does: 2 + 2 + 4 = 8 B per parameter).
PRECISIONS: dict[str, dict[str, int]] = {
    "bf16-mixed": dict(activation_bytes=2, weight_bytes=2, grad_bytes=4, master_weight_bytes=4,
                       optimizer_state_bytes=4),
    "16-mixed": dict(activation_bytes=2, weight_bytes=2, grad_bytes=6, master_weight_bytes=4,
                     optimizer_state_bytes=4),
    "bf16-true": dict(activation_bytes=2, weight_bytes=2, grad_bytes=2, master_weight_bytes=0,
                      optimizer_state_bytes=2),
    "32-true": dict(activation_bytes=4, weight_bytes=4, grad_bytes=4, master_weight_bytes=0,
                    optimizer_state_bytes=4),
}
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")
# The optimizers memplan models (memplan/optimizers.py: states, step temporaries, sources); `adam` is
# the old name of `adamw`, still read from YAML files.
OPTIMIZERS = ("adamw", "sgd", "sgd-nomomentum", "adafactor", "adam8bit", "muon", "lion")
OPTIMIZER_ALIASES = {"adam": "adamw"}
# The implementations each has, its own default first (torch 2.13 torch/optim/: AdamW and SGD have
# foreach and fused; Adafactor a for-loop, its default, and foreach; Muon a for-loop beside an AdamW
# for the other parameters, whose implementation is the one named; bitsandbytes' 8-bit Adam one fused
# kernel; lion-pytorch's Lion a for-loop).
OPTIMIZER_IMPLS_OF = {"adamw": ("foreach", "fused"), "sgd": ("foreach", "fused"), "sgd-nomomentum": ("foreach", "fused"),
                      "adafactor": ("for-loop", "foreach"), "adam8bit": ("fused",), "muon": ("fused", "foreach"),
                      "lion": ("for-loop",)}


def parse_optimizer(value: Any) -> str:
    """An optimizer's name (the old `adam` read as `adamw`); an unknown one is refused with the list."""
    name = OPTIMIZER_ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {echo(value)}; known: {', '.join(OPTIMIZERS)} (adam = adamw)")
    return name


class TrainingSpec(_Spec):
    """Batch, recompute and the byte size of every stored number."""

    micro_batch: int = Field(default=1, gt=0, description="b")
    global_batch: Optional[int] = Field(default=None, gt=0, description="sequences per step (default b*d)")
    recompute: Recompute = Recompute.NONE
    recompute_num_layers: Optional[int] = Field(
        default=None, gt=0, description="with full recompute: layers per model chunk recomputed (default all)"
    )
    activation_bytes: int = Field(default=2, gt=0, description="16-bit activations (K22 section 4)")
    weight_bytes: int = Field(default=2, gt=0, description="bf16 model weights")
    grad_bytes: int = Field(default=4, gt=0, description="fp32 main gradients (Megatron-LM bf16 training)")
    master_weight_bytes: int = Field(default=4, ge=0, description="fp32 master copy of the weights; 0 if none")
    optimizer: str = Field(
        default="adamw", description="adamw (adam), sgd (momentum), sgd-nomomentum, adafactor, adam8bit, muon, lion "
        "(memplan/optimizers.py)")
    optimizer_state_bytes: int = Field(default=4, ge=0, description="bytes of each optimizer moment")
    precision: Literal["bf16-mixed", "16-mixed", "bf16-true", "32-true"] = Field(
        default="bf16-mixed", description="sets the byte sizes above that are not given explicitly")
    optimizer_impl: Optional[Literal["foreach", "fused", "for-loop"]] = Field(
        default=None, description="the optimizer's implementation: torch's foreach (parameter-sized temporaries "
        "in the step), fused (none) or for-loop (one tensor at a time); default: the implementation's own "
        "where the optimizer has it, else the optimizer's (see `memplan impls`)")
    loss_chunks: int = Field(
        default=1, gt=0, description="LM head and cross-entropy computed in this many sequence chunks, each "
        "checkpointed, so the full fp32 logits never exist (chunked / fused linear cross-entropy)")
    fp8: Optional[Literal["delayed", "tensorwise", "blockwise"]] = Field(
        default=None, description="FP8 training with Transformer Engine as Megatron-LM launches it (--fp8-recipe): "
        "the linear layers' GEMMs in FP8, their saved inputs and weight copies in 1-byte FP8 (memplan/fp8.py; "
        "derived from Transformer Engine's code, not measured); None: no FP8")
    fp8_format: Literal["hybrid", "e4m3"] = Field(
        default="hybrid", description="FP8 format (Megatron-LM --fp8-format): hybrid = E4M3 forward, E5M2 gradients")
    fp8_amax_history_len: int = Field(
        default=1, gt=0, description="delayed scaling: amax values kept per FP8 tensor (Megatron-LM "
        "--fp8-amax-history-len, default 1; Transformer Engine's own default is 1024)")
    fp8_param_gather: bool = Field(
        default=False, description="the linear layers' weights kept only in FP8 (Megatron-LM --fp8-param-gather: "
        "Transformer Engine fp8_model_init, no bf16 copy; the fp32 master weights stay)")
    mst: int | Literal["auto"] = Field(
        default=1, description="Mini-Sequence Transformer (MsT, arXiv 2407.15892): the MLP and the LM head + loss "
        "run on this many pieces of the sequence, one after another, under layer-level gradient checkpointing; "
        "'auto' chooses the pieces as MsT's code does (memplan/mst.py); 1: off")
    optimizer_in_backward: bool = Field(
        default=False, description="each parameter's optimizer step runs in a post-accumulate-grad hook inside the "
        "backward and frees its gradient (PyTorch's 'optimizer step in backward' recipe; MsT's "
        "scripts/benchmark_minis.py, a for-loop Adam per parameter, the LM head's step after the embedding's): "
        "no step holds every gradient (memplan/timeline.py)")
    offload_optimizer_fraction: float = Field(
        default=0.0, ge=0, le=1, description="fraction of each GPU's optimizer states (master weights and moments) "
        "kept and stepped in host memory, its gradients copied there and its weights back every step (Megatron-LM "
        "--optimizer-cpu-offload --optimizer-offload-fraction; memplan/offload.py); 0: none")
    offload_activations: bool = Field(
        default=False, description="the decoder layers' saved tensors are copied to pinned host memory when saved "
        "and back when the backward needs them (torch.autograd.graph.save_on_cpu(pin_memory=True); "
        "memplan/offload.py)")

    @model_validator(mode="before")
    @classmethod
    def _precision(cls, data: Any) -> Any:
        """Byte sizes not given explicitly come from the precision (explicit ones win)."""
        if isinstance(data, dict):
            name = data.get("precision", "bf16-mixed")
            if name in PRECISIONS:
                data = {**PRECISIONS[name], **data}
        return data

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute(cls, value: Any) -> Recompute:
        return Recompute.parse(value)

    @field_validator("mst", mode="before")
    @classmethod
    def _mst(cls, value: Any) -> Any:
        """'auto' or a whole number >= 1 of mini-sequences (1: MsT off)."""
        if isinstance(value, str):
            text = value.strip().lower()
            if text == "auto":
                return "auto"
            if not text.isdigit():
                raise ValueError(f"mst takes a number of mini-sequences or 'auto', not {echo(value)}")
            value = int(text)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mst takes a number of mini-sequences >= 1 or 'auto', not {echo(value)}")
        return value

    @model_validator(mode="after")
    def _mst_needs(self) -> "TrainingSpec":
        """MsT with its own LM head + loss in place of a chunked loss (its gradient checkpointing: Config, as the
        recompute mode is a plan's), and the optimizer step in the backward as modelled."""
        if self.optimizer_in_backward and (self.optimizer != "adamw" or self.offload_optimizer_fraction > 0):
            raise ValueError("the optimizer step in the backward is modelled for AdamW on the GPU (a for-loop AdamW "
                             "per parameter, as MsT's benchmark runs it)")
        if self.mst != 1 and self.loss_chunks > 1:
            raise ValueError("MsT computes the LM head and loss in its own pieces: drop --loss-chunks")
        return self

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer(cls, value: Any) -> str:
        return parse_optimizer(value)

    @model_validator(mode="after")
    def _offload(self) -> "TrainingSpec":
        """Offload as modelled: optimizer offload steps AdamW or SGD on the host (Megatron-LM's HybridDeviceOptimizer
        has a CPU Adam and SGD only); activation offload without recompute (torch's checkpoint keeps its inputs
        outside save_on_cpu's hooks, and Megatron-LM refuses the two together)."""
        if self.offload_optimizer_fraction > 0 and self.optimizer not in ("adamw", "sgd", "sgd-nomomentum"):
            raise ValueError(f"optimizer offload is modelled for adamw and sgd (Megatron-LM's HybridDeviceOptimizer "
                             f"steps a CPU AdamW or SGD), not {self.optimizer}")
        if self.offload_activations and self.recompute != Recompute.NONE:
            raise ValueError(f"activation offload is modelled without recompute (got recompute "
                             f"{self.recompute.label}): Megatron-LM refuses the two together and torch's checkpoint "
                             "keeps its inputs outside save_on_cpu's hooks")
        return self

    @model_validator(mode="after")
    def _fp8(self) -> "TrainingSpec":
        """FP8 options need FP8, and Megatron-LM's FP8 runs bf16 or fp16 mixed precision."""
        if self.fp8 is None:
            if self.fp8_param_gather:
                raise ValueError("fp8_param_gather needs fp8 (a recipe: delayed, tensorwise or blockwise)")
            return self
        if self.precision not in ("bf16-mixed", "16-mixed"):
            raise ValueError(f"fp8 runs inside bf16-mixed or 16-mixed training (Megatron-LM --bf16 / --fp16 with "
                             f"--fp8-format), not {self.precision}")
        return self

    @model_validator(mode="after")
    def _optimizer_impl(self) -> "TrainingSpec":
        impls = OPTIMIZER_IMPLS_OF[self.optimizer]
        if self.optimizer_impl is not None and self.optimizer_impl not in impls:
            raise ValueError(f"optimizer {self.optimizer} has no {self.optimizer_impl} implementation (it has: "
                             f"{', '.join(impls)})")
        return self

    @property
    def optimizer_moments(self) -> int:
        """Full-size state tensors per parameter, in optimizer_state_bytes each: AdamW two (m, v), SGD
        with momentum, Lion and Muon one (Muon's AdamW share keeps two: memplan/optimizers.py), SGD
        without momentum none, Adafactor none (its factored second moment is r + c values per r x c
        matrix) and 8-bit Adam none at that size (two 1-byte states: `optimizer_dense_bytes`)."""
        return {"adamw": 2, "sgd": 1, "sgd-nomomentum": 0, "adafactor": 0, "adam8bit": 0, "muon": 1,
                "lion": 1}[self.optimizer]

    @property
    def optimizer_dense_bytes(self) -> int:
        """Bytes of optimizer state per parameter in its full-size tensors (the step's memory traffic):
        the moments above, or 8-bit Adam's two uint8 states."""
        return 2 if self.optimizer == "adam8bit" else self.optimizer_moments * self.optimizer_state_bytes


def _sized(value: Any) -> Any:
    """A byte size in a YAML file: a number with its unit ('80GB', '81559MiB'); a bare number is
    refused, as on the command line, because 80 could mean bytes, GB or GiB."""
    if isinstance(value, str):
        try:
            return parse_size(value)
        except MemplanError as err:
            raise ValueError(str(err)) from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError(f"give a size with its unit, e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes) (got {echo(value)})")
    return value


class RuntimeBytes(_Spec):
    """Device memory outside PyTorch's caching allocator for one training process (CUDA context,
    kernel images; for megatron-core also the communicator of one NCCL group)."""

    torch: int = Field(default=0, ge=0, description="a plain PyTorch process (transformers, the reference loop)")
    megatron: int = Field(default=0, ge=0, description="a megatron-core process with one NCCL group")

    @field_validator("torch", "megatron", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return _sized(value)

    def get(self, framework: str) -> int:
        return getattr(self, framework)


class GpuSpec(_Spec):
    """An accelerator's data-sheet figures (per GPU)."""

    # lax: YAML 1.1 reads 312.0e12 as a string; sizes and rates are parsed with their units above
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    name: str
    memory_bytes: int = Field(gt=0)
    peak_bf16_flops: float = Field(gt=0, description="dense bf16 FLOP/s")
    matmul_efficiency: float = Field(gt=0, le=1, description="achieved fraction of peak in large GEMMs")
    memory_bound_efficiency: float = Field(gt=0, le=1, description="achieved fraction of HBM bandwidth in "
                                           "elementwise kernels")
    attention_matmul_efficiency: float = Field(gt=0, le=1, description="achieved fraction of peak in the "
                                               "unfused QK^T and attention-over-V batched matmuls")
    matmul_overhead_s: float = Field(default=0.0, ge=0, description="fixed seconds per GEMM kernel on top of "
                                     "its FLOPs at matmul_efficiency (last partial wave of tiles, prologue)")
    calibration: str = Field(default="", description="the measurements the efficiencies above were fitted to; "
                             "empty: assumed, not measured on this GPU")
    calibrated_impls: tuple[str, ...] = Field(default=(), description="implementations (memplan impls) whose "
                                              "kernels those measurements ran")
    step_time_uncertainty: float = Field(default=0.0, ge=0, description="relative spread of a calibrated step "
                                         "time against published measurements")
    memory_bandwidth: float = Field(gt=0, description="HBM bytes/s")
    gpus_per_node: int = Field(default=8, gt=0)
    intra_node_bandwidth: float = Field(gt=0, description="bytes/s per GPU per direction (NVLink)")
    inter_node_bandwidth: float = Field(gt=0, description="bytes/s per GPU per direction (network)")
    peak_fp8_flops: Optional[float] = Field(
        default=None, gt=0, description="dense FP8 FLOP/s (tensor cores, no sparsity); None: the GPU has no FP8 "
        "tensor cores (FP8 training is refused)")
    host_bandwidth: Optional[float] = Field(
        default=None, gt=0, description="bytes/s per GPU per direction between pinned host memory and the GPU "
        "(PCIe copies: offload); None: not known, offloaded copies cannot be timed")
    runtime_bytes: RuntimeBytes = Field(
        default_factory=lambda: RuntimeBytes(),
        description="device memory a training process uses outside PyTorch's caching allocator, by framework")
    nccl_communicator_bytes: int = Field(default=0, ge=0, description="each further NCCL communicator")
    workspace_bytes: int = Field(default=0, ge=0, description="cuBLAS workspace, allocated inside PyTorch's pool "
                                 "(part of torch.cuda.max_memory_allocated)")
    fragmentation_margin: float = Field(
        default=0.0, ge=0, le=1, description="caching-allocator reserve above the allocated peak, as a fraction")
    source: str = ""

    @field_validator("memory_bytes", "nccl_communicator_bytes", "workspace_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return _sized(value)

    @field_validator("memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth",
                     mode="before")
    @classmethod
    def _rate(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().endswith("/s"):
            return float(_sized(value.strip()[:-2]))
        return value


class Config(_Spec):
    """A model, a parallel plan and training settings: everything an estimate needs."""

    model: ModelSpec
    parallel: ParallelSpec = ParallelSpec()
    training: TrainingSpec = TrainingSpec()

    @property
    def uneven(self) -> bool:
        """An uneven pipeline split (first / last stage layers given)."""
        par = self.parallel
        return par.first_stage_layers is not None or par.last_stage_layers is not None

    @property
    def split(self) -> tuple[int, int, int]:
        """Transformer layers on the first, on each middle and on the last pipeline stage (Megatron-LM
        get_num_layers_to_build): L/p each when even; a stage whose count is not given shares the rest evenly
        with the middle ones. Only meaningful once `_across` has checked it."""
        par, L = self.parallel, self.model.num_layers
        p = par.pp
        if not self.uneven:
            return (L // p,) * 3
        first, last = par.first_stage_layers, par.last_stage_layers
        rest, left = L - (first or 0) - (last or 0), p - (first is not None) - (last is not None)
        even = rest // left if left > 0 else 0
        first = first if first is not None else even
        last = last if last is not None else even
        return first, (L - first - last) // (p - 2) if p > 2 else 0, last

    def stage_layers(self, stage: int) -> int:
        """Transformer layers on pipeline stage `stage`."""
        first, middle, last = self.split
        return first if stage == 0 else last if stage == self.parallel.pp - 1 else middle

    @property
    def layers_per_chunk(self) -> int:
        """Layers in one model chunk: L / (p m); with uneven stages the largest chunk (a stage's layers / m)."""
        if not self.uneven:
            return self.model.num_layers // (self.parallel.pp * self.parallel.vpp)
        return max(n for n in self.split if n) // self.parallel.vpp

    @property
    def global_batch(self) -> int:
        t = self.training
        return t.global_batch if t.global_batch is not None else t.micro_batch * self.parallel.dp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on each data-parallel rank."""
        return self.global_batch // (self.training.micro_batch * self.parallel.dp)

    def plan_summary(self) -> dict[str, Any]:
        """The plan in one flat schema, shared by search rows and estimate's JSON (`plan`), with
        effective values: the ZeRO shard group (d unless HSDP) and the layers per model chunk the
        recompute mode applies to (all of them unless --recompute-num-layers says fewer)."""
        par, tr = self.parallel, self.training
        layers = tr.recompute_num_layers if tr.recompute_num_layers is not None else self.layers_per_chunk
        return dict(tp=par.tp, pp=par.pp, dp=par.dp, vpp=par.vpp, sp=par.sp, cp=par.cp, cp_comm_type=par.cp_comm_type,
                    ep=par.ep, etp=par.expert_tp, zero=par.zero, zero_shard=par.shard,
                    micro_batch=tr.micro_batch, recompute=tr.recompute.label, recompute_num_layers=layers,
                    num_microbatches=self.num_microbatches, global_batch=self.global_batch,
                    global_batch_tokens=self.global_batch * self.model.seq_length, gpus=par.gpus,
                    first_stage_layers=self.split[0], last_stage_layers=self.split[2])

    def _check_split(self) -> None:
        """Megatron-LM's rules for uneven stages (megatron/core/transformer/transformer_config.py, the
        "Uneven PP" checks of TransformerConfig.__post_init__): the layers left for the middle stages
        split evenly over them (none left when there are none), and with interleaving every stage's layers
        divide by m."""
        par, L = self.parallel, self.model.num_layers
        given = (par.first_stage_layers or 0) + (par.last_stage_layers or 0)
        left = par.pp - (par.first_stage_layers is not None) - (par.last_stage_layers is not None)
        rest = L - given
        if rest < 0 or bool(rest) != bool(left):
            raise ValueError(f"first / last stage layers ({par.first_stage_layers}, {par.last_stage_layers}) leave "
                             f"{rest} of L={L} layers for the {left} other stage(s) of p={par.pp}: each stage needs "
                             "layers, and every layer a stage")
        if left and rest % left:
            raise ValueError(f"the {rest} layers left by the first / last stage layers do not split evenly over the "
                             f"{left} other stage(s) of p={par.pp}")
        for name, n in zip(("first", "middle", "last"), self.split):
            if n and n % par.vpp:
                raise ValueError(f"the {n} layers of the {name} stage(s) are not divisible by m={par.vpp} "
                                 "interleaved chunks")

    @model_validator(mode="after")
    def _across(self) -> "Config":
        m, par, tr = self.model, self.parallel, self.training
        a, g, t, L = m.num_attention_heads, m.g, par.tp, m.num_layers
        if a % t:
            raise ValueError(f"tensor-parallel size t={t} does not divide the attention heads a={a}")
        if g % t:
            raise ValueError(f"tensor-parallel size t={t} does not divide the key/value heads {g}")
        if self.uneven:
            self._check_split()
        elif L % (par.pp * par.vpp):
            raise ValueError(
                f"layers L={L} are not divisible by p*m = {par.pp}*{par.vpp}: every model chunk needs whole layers"
                + (" (an uneven split, --first-stage-layers / --last-stage-layers, may fit them)"
                   if par.vpp == 1 else ""))
        first_chunk = self.split[0] // par.vpp
        if m.moe_first_dense_layers > first_chunk:
            raise ValueError(f"moe_first_dense_layers={m.moe_first_dense_layers} exceed the {first_chunk} "
                             f"layers of the first model chunk (L/(p m)): memplan places the dense layers on the first "
                             "pipeline stage")
        if tr.mst != 1 and (tr.recompute != Recompute.FULL or tr.recompute_num_layers not in (None, L)):
            raise ValueError("MsT runs with gradient checkpointing of every layer (mini-s' minisequence turns it "
                             "on): add --recompute full (without --recompute-num-layers)")
        if tr.optimizer_in_backward and self.num_microbatches > 1:
            raise ValueError("the optimizer step in the backward steps every micro-batch: it needs one micro-batch "
                             "per step (global batch = micro-batch x data-parallel)")
        if m.seq_length % tr.loss_chunks:
            raise ValueError(f"loss chunks {tr.loss_chunks} do not divide the sequence length s={m.seq_length}")
        if par.sp and m.seq_length % t:
            raise ValueError(f"sequence parallelism needs t={t} to divide the sequence length s={m.seq_length}")
        _check_cp_ep(m, par)
        if (par.ep > 1 or par.expert_tp != t) and (tr.optimizer not in ("adamw", "sgd", "sgd-nomomentum", "lion")
                                                   or tr.offload_optimizer_fraction > 0):
            raise ValueError("expert parallelism is modelled with the optimizers whose states are per-parameter "
                             f"copies (adamw, sgd, lion) and without optimizer offload (got {tr.optimizer}"
                             f"{', offload' if tr.offload_optimizer_fraction else ''})")
        gb, b, d = self.global_batch, tr.micro_batch, par.dp
        if gb % (b * d):
            raise ValueError(f"global batch {gb} is not divisible by micro-batch * data-parallel = {b}*{d}")
        if tr.recompute_num_layers is not None:
            if tr.recompute != Recompute.FULL:
                raise ValueError("recompute_num_layers only applies to full recompute")
            if tr.recompute_num_layers > self.layers_per_chunk:
                raise ValueError(
                    f"recompute_num_layers={tr.recompute_num_layers} exceeds the {self.layers_per_chunk} "
                    "layers of a model chunk"
                )
        return self


def _check_cp_ep(m: ModelSpec, par: ParallelSpec) -> None:
    """Context and expert parallelism as Megatron-LM / Transformer Engine accept them (memplan/parallel.py)."""
    s, t, cp = m.seq_length, par.tp, par.cp
    if cp > 1:
        if s % (2 * cp):
            raise ValueError(f"context parallelism needs 2*cp = {2 * cp} to divide the sequence length s={s} (the causal "
                             "load-balanced layout: 2 cp chunks; Megatron-LM arguments.py)")
        if par.sp and (s // cp) % t:
            raise ValueError(f"sequence parallelism needs t={t} to divide a context-parallel rank's s/cp = {s // cp} "
                             "tokens")
        if m.attention == "eager":
            raise ValueError("context parallelism needs flash attention (--attention flash): Transformer Engine's "
                             "unfused attention does not support it (dot_product_attention/utils.py "
                             "get_attention_backend)")
        if par.cp_comm_type == "a2a" and ((m.num_attention_heads // t) % cp or (m.g // t) % cp):
            raise ValueError(f"--cp-comm-type a2a needs cp={cp} to divide each tensor-parallel rank's query heads "
                             f"a/t = {m.num_attention_heads // t} and key/value heads g/t = {m.g // t} "
                             "(Transformer Engine AttnFuncWithCPAndQKVOA2A)")
    if (par.ep > 1 or par.etp is not None) and not m.is_moe:
        raise ValueError("expert parallelism (--ep / --etp) needs a mixture-of-experts model (num_experts)")
    if m.is_moe:
        if m.num_experts % par.ep:
            raise ValueError(f"expert-parallel size ep={par.ep} does not divide the experts E={m.num_experts} "
                             "(Megatron-LM arguments.py)")
        if m.fe % par.expert_tp:
            raise ValueError(f"expert tensor-parallel size etp={par.expert_tp} does not divide the expert MLP width "
                             f"f_e={m.fe}")
        if t > 1 and not par.sp:
            raise ValueError("a mixture-of-experts model with tensor parallelism needs sequence parallelism (--sp): "
                             "Megatron-LM's MoELayer refuses to train without it (moe_layer.py)")


def check_gpus(gpus: int) -> None:
    """A GPU count must be positive (the divisibility checks live with the plan)."""
    if gpus <= 0:
        raise MemplanError(f"GPU count must be positive (got {gpus})")


def describe_validation_error(err: ValidationError, where: str = "", known: tuple[str, ...] = ()) -> str:
    """One line from a pydantic error: the first problem (unknown keys first), naming its field
    (and file), with the closest known field name for a typo."""
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    prefix = f"{where}: " if where else ""
    if first["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(first["loc"][-1]), known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close and len(first["loc"]) == 1 else ""
        return f"{prefix}unknown field '{loc}'{hint}"
    msg = first["msg"].removeprefix("Value error, ")
    if loc:
        given = first.get("input")
        shown = f" (got {echo(given)})" if not isinstance(given, dict) and given is not None and "(got " not in msg \
            else ""
        return f"{prefix}{loc}: {msg}{shown}"
    return f"{prefix}{msg}"


def build(cls: type[_Spec], data: dict, where: str = "") -> Any:
    """Build a spec, turning validation errors into one-line MemplanErrors."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise MemplanError(describe_validation_error(err, where, tuple(cls.model_fields))) from None
