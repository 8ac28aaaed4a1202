"""The model spec: a decoder-only transformer's architecture (`ModelSpec`), with its dense, mixture-of-experts
and multi-head latent attention fields and the checks that involve the architecture alone."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, PositiveInt, model_validator

from memplan.core.hybrid import check_hybrid, layer_blocks
from memplan.core.spec_checks import EXTRA_TENSORS, ExtraTensors, check_experts, check_gate, check_latent
from memplan.core.spec_base import Spec

# The most layers a model may have: real ones have at most a few hundred; a config of 10^9 layers is a typo, and
# the per-layer work (stages, events, a trace) must stay bounded.
MAX_LAYERS = 16_384

class ModelSpec(Spec):
    """A decoder-only transformer's architecture (no weights)."""

    name: str = "custom"
    num_layers: int = Field(gt=0, le=MAX_LAYERS, description="L, transformer layers")
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
    # What the emitted launch needs to build the same model (memplan/launch/megatron.py); the memory does not depend
    # on them (a sliding window changes no stored tensor under flash attention; None: the framework's default).
    gate_activation: Literal["silu", "gelu", "relu2"] = Field(
        default="silu", description="the gated MLP's activation (mlp: swiglu): silu (SwiGLU, Llama), gelu (GeGLU, "
        "Gemma's gelu_pytorch_tanh) or relu2 (squared ReLU, BitNet)")
    rope_theta: Optional[float] = Field(
        default=None, gt=0, description="RoPE base (transformers rope_theta; Megatron-LM --rotary-base, default 10000)")
    norm_eps: Optional[float] = Field(
        default=None, gt=0, lt=1, description="the norms' epsilon (transformers rms_norm_eps / layer_norm_epsilon; "
        "Megatron-LM --norm-epsilon, default 1e-5)")
    sliding_window: Optional[int] = Field(
        default=None, gt=0, description="tokens a sliding-window layer attends to, itself included (transformers "
        "sliding_window; Megatron-LM --window-size W-1,0)")
    sliding_window_pattern: Optional[int] = Field(
        default=None, gt=1, description="with sliding_window: every N-th layer attends to all tokens, the others "
        "slide (Gemma 3's sliding_window_pattern, Gemma 2's 2; Megatron-LM --window-attn-skip-freq N); None: every "
        "layer slides")
    # Gemma 4 (issue 22): the full-attention layers' own head width and K / V heads, keys used as values there,
    # layers that reuse earlier layers' K / V, per-layer input embeddings. Which layers attend to all tokens is
    # sliding_window / sliding_window_pattern's (every N-th layer; no sliding_window: every layer).
    full_attention_head_dim: Optional[int] = Field(
        default=None, gt=0, description="the full-attention layers' head width (default head_dim; Gemma 4 "
        "global_head_dim, per_layer_config head_dim): their Q, K, V and output projections and q / k norms")
    full_attention_kv_heads: Optional[int] = Field(
        default=None, gt=0, description="the full-attention layers' key/value heads (default g; Gemma 4 "
        "num_global_key_value_heads)")
    full_attention_layers: Optional[int] = Field(
        default=None, ge=0, description="how many layers attend to all tokens where they are not every N-th "
        "(MiMo-V2-Flash's layer_types: the first and every sixth); None: from sliding_window / sliding_window_pattern")
    value_head_dim: Optional[int] = Field(
        default=None, gt=0, description="d_v, the V heads' width where it is not head_dim (MiMo-V2-Flash v_head_dim): "
        "v_proj h -> g d_v, o_proj a d_v -> h (latent attention has its own v_head_dim)")
    sinks_sliding_only: bool = Field(
        default=False, description="attention_sinks on the sliding-window layers only (MiMo-V2-Flash)")
    full_attention_k_eq_v: bool = Field(
        default=False, description="the full-attention layers' keys serve as their values: no V projection "
        "(Gemma 4 attention_k_eq_v)")
    kv_shared_layers: int = Field(
        default=0, ge=0, description="the last N layers reuse the K / V of the last earlier layer of their kind: no K "
        "/ V projections nor key norm of their own (Gemma 4 num_kv_shared_layers)")
    kv_shared_double_mlp: bool = Field(
        default=False, description="the K / V-sharing layers' MLP is 2f wide (Gemma 4 use_double_wide_mlp)")
    per_layer_input_size: int = Field(
        default=0, ge=0, description="p, per-layer input embeddings (0: none; Gemma 4 hidden_size_per_layer_input): "
        "a table of per_layer_input_vocab x L p and an h -> L p projection on the first stage, a gate h -> p, a "
        "projection p -> h and a norm in each layer")
    per_layer_input_vocab: Optional[int] = Field(
        default=None, gt=0, description="rows of the per-layer input table (default v; Gemma 4 "
        "vocab_size_per_layer_input)")
    moe_router_scales: bool = Field(
        default=False, description="a learned h-wide scale on the router's input and one scale per expert (Gemma 4 "
        "router.scale, per_expert_scale)")
    moe_block_norms: int = Field(
        default=0, ge=0, le=4, description="norms of each MoE layer's block beside the layer's own (Gemma 4: 3, "
        "post_feedforward_layernorm_1 / _2 and pre_feedforward_layernorm_2)")
    # The parameters of the layouts transformers' families add (issue 22): they change the parameter count;
    # the activations of such a layer are traced from transformers' code (--impl hf-*) or approximated by the
    # sequential pre-norm layer of the other inventories (the config reader's notes say which).
    cross_attention_layers: int = Field(default=0, ge=0, description="layers of the L attending to image states "
        "(Mllama): a self-attention layer's weights, q / k norms a head wide, 2 tanh gates; text-only steps skip them")
    vocab_extra_rows: int = Field(default=0, ge=0, le=64, description="word-embedding rows beyond v (Mllama: 8)")
    layer_layout: Literal["sequential", "parallel", "post-norm"] = Field(
        default="sequential", description="where a layer's sub-layers and norms sit: sequential pre-norm (GPT, Llama; "
        "what the --impl megatron* inventories model and --emit megatron builds), attention and MLP in parallel on "
        "the same input (Falcon, GPT-NeoX's use_parallel_residual, Cohere) or norms on the sub-layers' outputs "
        "(post-norm: OLMo-2)")
    norms_per_layer: Optional[int] = Field(
        default=None, ge=1, le=4, description="norms in one layer (default 2, 4 with sandwich_norms): 1 in a "
        "parallel attention + MLP block with one shared norm (Falcon-7B, Cohere), 2 as post-norms (OLMo-2)")
    norm_bias: Optional[bool] = Field(
        default=None, description="a LayerNorm's bias (default: a LayerNorm has one, an RMSNorm none; Cohere's "
        "LayerNorm has none)")
    norm_params: bool = Field(
        default=True, description="whether the norms (the q / k norms too) have learned weights (False: OLMo's "
        "LayerNorm and nanochat's RMSNorm have none)")
    position_offset: int = Field(
        default=0, ge=0, le=8, description="learned position rows beyond s (OPT's and BioGPT's 2: their position "
        "ids start at 2)")
    position_rows: Optional[int] = Field(
        default=None, ge=1, description="rows of the learned position table (transformers' max_position_embeddings "
        "/ n_positions, whatever s trains); None: s (K22's (V + s) h, Megatron-LM's --max-position-embeddings "
        "defaulting to --seq-length)")
    final_norm: bool = Field(
        default=True, description="a norm after the last layer (False: GPT-1, openai-gpt, whose post-norm layers "
        "end in their own LayerNorm)")
    embedding_norm: bool = Field(
        default=False, description="a norm on the word embeddings' output on the first stage (BLOOM's "
        "word_embeddings_layernorm)")
    encoder_kind: Optional[Literal["bert", "seq2seq"]] = Field(
        default=None, description="a family that is not decoder-only, trained as a causal LM: bert, a BERT-like "
        "encoder with is_decoder (BertLMHeadModel, RobertaForCausalLM); seq2seq, an encoder-decoder model's decoder "
        "alone (PLBartForCausalLM, ...: its encoder left out, each layer's cross-attention q / k / v / out h x q with "
        "their biases and its norm counted, not run). Only --impl hf-* (a trace of transformers' code) estimates one")
    token_type_rows: int = Field(
        default=0, ge=0, description="rows of a token-type (segment) embedding table added to the word embeddings "
        "(BERT type_vocab_size)")
    head_transform: bool = Field(
        default=False, description="a transform before the output head: a dense h x h with bias, an activation and "
        "a norm (BERT cls.predictions.transform, RoBERTa lm_head.dense / layer_norm)")
    embedding_widths: Optional[tuple[PositiveInt, PositiveInt]] = Field(
        default=None, description="(e, e_out), factorised embeddings: the word, position and token-type tables and "
        "the embedding norm e wide, a projection e -> h with bias before the first layer; the head transform h -> "
        "e_out and the output layer e_out x v (ELECTRA / RoFormer embedding_size: (e, e); RemBERT input_ / "
        "output_embedding_size). None: h wide, no projection")
    frozen_position_rows: int = Field(
        default=0, ge=0, description="rows of a frozen sinusoidal position table held as a parameter (requires_grad "
        "false: weights only, no gradient or optimizer state): RoFormer's encoder.embed_positions, head_dim wide; Pegasus's and "
        "Marian's decoder.embed_positions, h wide (frozen_position_width)")
    frozen_position_width: Literal["head", "hidden"] = Field(
        default="head", description="the frozen position table's width: head_dim (RoFormer's rotary table) or h "
        "(Pegasus's and Marian's sinusoidal embeddings, added to the word embeddings)")
    extra_tensors: ExtraTensors = Field(default=(), description=EXTRA_TENSORS)  # RoCBERT, X-MOD, XLM, ...
    qk_norm_width: Literal["head", "full"] = Field(
        default="head", description="with qk_norm: one head_dim-wide weight for the queries and one for the keys "
        "(head: Qwen3, Gemma 3) or a weight per element of the whole Q and K (full: q + q g/a, OLMo-2, Cohere)")
    attention_bias: bool = Field(
        default=False, description="biases on the Q, K, V and output projections only (transformers "
        "attention_bias: gpt-oss, Phi-3.5-MoE, Granite; `bias` puts one on every linear)")
    mlp_bias: bool = Field(
        default=False, description="biases on the MLP's two linears only (GPT-J, CodeGen; `bias` puts one on every "
        "linear)")
    out_bias: bool = Field(
        default=False, description="a bias on the attention's output projection alone (GPT-Neo, with mlp_bias)")
    head_bias: bool = Field(default=False, description="a bias on the output head, v wide (Phi-3.5-MoE lm_head_bias)")
    looped_stacks: bool = Field(default=False, description="HRM's two stacks of num_layers / 2 layers run in a loop "
                                "each step, and its h-wide start state z_L_init (a parameter) on the first stage")
    dynamic_mask: bool = Field(default=False, description="Doge's dynamic-mask attention (A per K / V head, dt_proj K / "
                               "V width -> K / V heads) and its two h-wide residual scales per layer")
    key_bias: bool = Field(
        default=True, description="with bias, attention_bias or qkv_bias: whether K's projection has its bias too "
        "(False: Whisper's k_proj, in the self- and the cross-attention)")
    attention_sinks: bool = Field(
        default=False, description="a learned sink logit per attention head and layer (gpt-oss self_attn.sinks)")
    attention_output_gate: Optional[Literal["head", "full"]] = Field(
        default=None, description="a learned gate on the attention output, a linear from the layer input without "
        "bias: one value per channel of the attention output (full: h x q, AFMoE self_attn.gate_proj) or per head "
        "(head: h x a)")
    attention_gate_bias: bool = Field(default=False, description="a learned bias per head on that gate (Beam gate_bias)")
    differential_attention: bool = Field(
        default=False, description="differential attention: four learned vectors head_dim wide per layer (DiffLlama "
        "lambda_q1, lambda_k1, lambda_q2, lambda_k2)")
    sub_norms: bool = Field(
        default=False, description="norms inside the sub-layers: on the attention output before its projection (h "
        "wide) and on the gated MLP's product before its output projection (f wide) (BitNet attn_sub_norm, "
        "ffn_sub_norm)")
    activation_params: int = Field(
        default=0, ge=0, description="learned scalars of the MLP's activation per layer (Apertus's xIELU: alpha_p, "
        "alpha_n)")
    moe_bias: bool = Field(
        default=False, description="biases on the router (E) and on each routed expert's projections (gpt-oss)")
    moe_router_bias: bool = Field(
        default=False, description="a learned bias on the router's E logits, without expert biases (ERNIE 4.5's "
        "e_score_correction_bias; moe_bias includes it)")
    moe_shared_gate: bool = Field(
        default=False, description="a sigmoid gate on the shared experts' output, one h-wide weight per MoE layer "
        "(Qwen2-MoE shared_expert_gate)")
    # State-space hybrids (issue 22: Mamba-2, Bamba, Nemotron-H, Granite 4, Falcon-H1; LFM2's short convolutions,
    # which use ssm_conv_kernel and the three ssm_*_bias fields, not ssm_heads): what each layer holds, and
    # the Mamba-2 mixer's widths (transformers Mamba2Mixer: in_proj h -> 2 I + 2 G N + H, a depthwise convolution
    # over I + 2 G N channels, dt_bias / A_log / D per head, a gated RMSNorm I wide, out_proj I -> h; I = H P).
    layer_pattern: Optional[str] = Field(
        default=None, pattern=r"^[ASPM*E\-Cac1JjZYDdKkBbRWLXO]+$", description="one character per layer (None: every "
        "layer attention + MLP): A attention + MLP, S Mamba-2 mixer + MLP, P attention and mixer in parallel + MLP (two "
        "norms each), M mixer, * attention, - MLP f wide, E experts alone (one norm each; Nemotron-H's "
        "hybrid_override_pattern); C LFM2's gated short convolution + MLP, D a gated DeltaNet + MLP, K Kimi Delta "
        "Attention + MLP (B: Bailing's; two norms each); the MLP of A / S / P / C / D / K / B is the model's experts when "
        "it has them; a / c / d / k / b: the same with an f-wide dense MLP in a mixture-of-experts model; 1 / J / j: a "
        "Mamba-1 mixer alone (one norm), with the MLP, with an f-wide dense MLP; Z Zamba's: a mixer after a use of the "
        "shared attention + MLP block; Y Zamba 2's: a Mamba-2 mixer after a use of a shared block; R RecurrentGemma's "
        "RG-LRU recurrent block + MLP, W an RWKV block: time mixing + channel mixing, L MiniMax's lightning "
        "attention + MLP, X an xLSTM mLSTM block + MLP, O JetMoE's mixture of attention "
        "experts + MLP (two norms each; core/hybrid.py)")
    ssm_heads: Optional[int] = Field(default=None, gt=0, description="H, the Mamba-2 mixer's heads (mamba_n_heads)")
    ssm_head_dim: int = Field(default=64, gt=0, description="P, a mixer head's width (mamba_d_head): I = H P")
    ssm_state_size: int = Field(default=128, gt=0, description="N, the state per group (mamba_d_state)")
    ssm_groups: int = Field(default=1, gt=0, description="G, the B / C groups (mamba_n_groups)")
    ssm_conv_kernel: int = Field(default=4, gt=0, description="the depthwise convolution's width (mamba_d_conv)")
    ssm_conv_bias: bool = Field(default=True, description="the convolution's bias (mamba_conv_bias)")
    ssm_proj_bias: bool = Field(default=False, description="in_proj's bias (mamba_proj_bias)")
    ssm_out_bias: bool = Field(default=False, description="out_proj's bias (Falcon-H1 projectors_bias; else "
                               "mamba_proj_bias)")
    ssm_norm: bool = Field(default=True, description="the gated RMSNorm before out_proj (Falcon-H1 mamba_rms_norm); "
                           "Mamba-1: Jamba's dt / B / C RMSNorms")
    ssm_dt_rank: Optional[int] = Field(default=None, gt=0, description="R, a Mamba-1 mixer's dt rank (time_step_rank, "
                                       "mamba_dt_rank): x_proj I -> R + 2 N, dt_proj R -> I")
    shared_blocks: int = Field(default=1, gt=0, description="Zamba 2's shared attention + MLP blocks (num_mem_blocks), "
                               "used in turn by the Y layers")
    shared_adapter_rank: int = Field(default=0, ge=0, description="Zamba 2: the rank of each use's LoRA adapter on "
                                     "the shared MLP's gate_up (adapter_rank; 0: none)")
    shared_attention_adapter: bool = Field(default=False, description="Zamba 2: each use's LoRA adapters on q, k and v "
                                           "too (use_shared_attention_adapter)")
    # Mixture of experts (all None / 0: a dense model). An MoE layer's MLP is a router (E x h) choosing k of
    # E routed experts for each token, each expert an MLP of width f_e (gated as `mlp` says), plus shared
    # experts every token goes through; the first `moe_first_dense_layers` layers keep a dense MLP f wide.
    # Expert parallelism (ParallelSpec ep, etp) splits the routed experts over GPUs (memplan/memory/parallel.py).
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
        "DeepSeek-V3 n_shared_experts x moe_intermediate_size; Megatron-LM --moe-shared-expert-intermediate-size)")
    moe_first_dense_layers: int = Field(
        default=0, ge=0, description="layers before the first MoE layer, each with a dense MLP f wide "
        "(DeepSeek-V3 first_k_dense_replace; Megatron-LM --moe-layer-freq [0]*k+[1]*(L-k))")
    # How Megatron-LM routes an MoE layer's tokens at run time (not architecture, but what the layer saves
    # depends on it: memplan/inventory/moe.py); --impl megatron / megatron-local only.
    moe_imbalance: float = Field(
        default=1.0, ge=1.0, le=1024.0, description="the busiest GPU's share of the routed tokens relative to the "
        "average (1.0: perfectly balanced routing); scales the routed-token activations on the peak GPU")
    moe_expert_loads: Optional[tuple[float, ...]] = Field(
        default=None, description="the busiest GPU's E/ep routed experts' loads (all E at ep = 1), each relative to "
        "the average expert: with moe_capacity_factor each keeps min(load, C) of the average, the rest dropped; in "
        "place of moe_imbalance (their mean)")
    moe_capacity_factor: Optional[float] = Field(
        default=None, gt=0, le=1024.0, description="each expert takes at most C k s b / E tokens, the others are "
        "dropped (Megatron-LM --moe-expert-capacity-factor; None: no dropping)")
    moe_pad_to_capacity: bool = Field(
        default=False, description="pad every expert's input to its capacity (Megatron-LM "
        "--moe-pad-expert-input-to-capacity; needs moe_capacity_factor)")
    moe_token_dispatcher: Literal["alltoall", "allgather", "flex"] = Field(
        default="alltoall", description="Megatron-LM --moe-token-dispatcher-type (flex: DeepEP's fused all-to-all, "
        "CUDA only, derived)")
    moe_aux_loss_coeff: float = Field(
        default=0.0, ge=0.0, description="the load-balancing loss's coefficient (Megatron-LM --moe-aux-loss-coeff, "
        "default 0): > 0 keeps the router's softmax over all E logits, the tokens per expert and the loss")
    moe_z_loss_coeff: Optional[float] = Field(
        default=None, ge=0.0, description="the router's z-loss coefficient (Megatron-LM --moe-z-loss-coeff; None: "
        "no z-loss): keeps the logits (E per token) and their logsumexp")
    moe_router_dtype: Optional[Literal["fp32"]] = Field(
        default=None, description="the router's logits and probabilities in fp32 (Megatron-LM --moe-router-dtype "
        "fp32; None: the activations' dtype)")
    megatron_core_version: Literal["0.16", "0.19"] = Field(
        default="0.16", description="the megatron-core whose MoE permutation is modelled: 0.16 (0.16.1, measured: "
        "the routing map and the probabilities scattered to E columns) or 0.19 (0.19.2, derived from its code: "
        "an int64 sort index over tokens x experts)")
    moe_grouped_gemm: bool = Field(
        default=False, description="the routed experts as grouped GEMMs (Megatron-LM --moe-grouped-gemm: Transformer "
        "Engine's TEGroupedMLP, the grouped_gemm package's GroupedMLP with --transformer-impl local); CUDA only")
    moe_permute_fusion: bool = Field(
        default=False, description="Transformer Engine's fused token permutation (Megatron-LM --moe-permute-fusion): "
        "an int32 row_id_map in place of the routing map, the scattered probabilities and the int64 index; CUDA only")
    moe_shared_expert_overlap: bool = Field(
        default=False, description="the shared experts on a second CUDA stream beside the alltoall dispatcher "
        "(Megatron-LM --moe-shared-expert-overlap): their fc1 keeps its own all-gathered input at t > 1")
    moe_router_pre_softmax: bool = Field(
        default=False, description="softmax over all E logits before the top-k (Megatron-LM "
        "--moe-router-pre-softmax; megatron-core requires it for k = 1): keeps E fp32 scores per token, not k")
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
    mla_down_replicated: bool = Field(
        default=False, description="the MLA's latent down projections (q_a_proj / wq_a, kv_a_proj_with_mqa / wkv_a: "
        "h x (r_q + r_kv + d_r)) kept whole on every tensor-parallel rank, not split over t (torchtitan's DeepSeek-V3 "
        "sharding; --impl torchtitan sets it), and so its MTP layers' eh_proj (2h x h)")
    mla_indexer: Optional[tuple[PositiveInt, PositiveInt]] = Field(
        default=None, description="(H_i, D_i): a lightning indexer in every latent-attention layer (DeepSeek-V3.2, GLM-5 "
        "index_n_heads, index_head_dim): wq_b r_q -> H_i D_i, wk h -> D_i, k_norm a LayerNorm D_i with bias, "
        "weights_proj h -> H_i, whole on every GPU; its top-k mask is in the traced activations (--impl hf-*)")
    mla_query_gate: bool = Field(
        default=False, description="the query latent beside its norm's output (2 r_q) projected to the queries and a "
        "gate on the attention output a d_v wide, in place of q_b_proj (A.X-K2 q_gate_proj)")
    gated_norm_rank: int = Field(
        default=0, ge=0, description="r: a low-rank sigmoid gate (h -> r -> h, no biases) after the input norm of "
        "every layer and the post-attention norm of each MoE layer (A.X-K2 AXK2GatedRMSNorm; 0: none)")
    mtp_layers: int = Field(
        default=0, ge=0, le=MAX_LAYERS, description="multi-token-prediction modules on the last stage (DeepSeek-V3 "
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
    def layer_norms(self) -> int:
        """Norms in one layer: norms_per_layer, else 4 with sandwich_norms, else 2."""
        return self.norms_per_layer or (4 if self.sandwich_norms else 2)

    @property
    def encoder_description(self) -> str:
        """What an encoder_kind model is, for the refusals of the layouts that model decoder-only LMs."""
        return {"bert": "a BERT-like encoder trained as a causal LM (Megatron-LM's BERT is another model)",
                "seq2seq": "an encoder-decoder model's decoder trained alone (Megatron-LM's T5 is another model)"}.get(
                    self.encoder_kind or "", "a decoder-only LM")

    @property
    def has_norm_bias(self) -> bool:
        """Whether each norm has a bias (a LayerNorm unless norm_bias says otherwise)."""
        if not self.norm_params:
            return False
        return self.norm == "layernorm" if self.norm_bias is None else self.norm_bias and self.norm == "layernorm"

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
        if self.layer_pattern:
            return self.layer_blocks["moe"]
        return self.num_layers - self.moe_first_dense_layers if self.is_moe else 0

    @property
    def layer_blocks(self) -> dict[str, int]:
        """A hybrid's blocks over the whole model (core/hybrid.py LAYER_BLOCKS): attention, ssm, conv, dense, moe,
        norm."""
        return layer_blocks(self.layer_pattern, self.is_moe)

    @property
    def full_layers(self) -> int:
        """Layers attending to all tokens: full_attention_layers, else every layer without sliding_window, every N-th
        with sliding_window_pattern N, none with a window on every layer."""
        if self.full_attention_layers is not None:  # MiMo-V2-Flash: counted from its layer_types
            return self.full_attention_layers
        if self.sliding_window is None:
            return self.num_layers
        return self.num_layers // self.sliding_window_pattern if self.sliding_window_pattern else 0

    @property
    def kv_shared_full_layers(self) -> int:
        """The K / V-sharing layers (the last kv_shared_layers) that attend to all tokens."""
        L, n = self.num_layers, self.sliding_window_pattern
        shared = range(L - self.kv_shared_layers, L)
        if self.sliding_window is None:
            return len(shared)
        return sum((i + 1) % n == 0 for i in shared) if n else 0

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
        if self.sliding_window_pattern is not None and self.sliding_window is None:
            raise ValueError("sliding_window_pattern needs sliding_window (the tokens a sliding layer attends to)")
        if self.norms_per_layer is not None and self.sandwich_norms and self.norms_per_layer != 4:
            raise ValueError(f"sandwich_norms means four norms per layer (norms_per_layer={self.norms_per_layer})")
        for name in ("moe_bias", "moe_router_bias", "moe_shared_gate"):
            if getattr(self, name) and not self.is_moe:
                raise ValueError(f"{name} is a mixture-of-experts field: it needs num_experts (the routed experts)")
        rows = self.position_rows if self.position_embedding == "learned" else self.frozen_position_rows or None
        if rows is not None and self.seq_length > rows:  # a learned table, or RoFormer's frozen one
            kind = ("learned" if self.position_embedding == "learned" else
                    "frozen rotary" if self.frozen_position_width == "head" else "frozen sinusoidal")
            raise ValueError(f"s = {self.seq_length:,} tokens is longer than the {kind} position table's {rows:,} rows")
        if self.kv_shared_layers >= self.num_layers:
            raise ValueError(f"kv_shared_layers={self.kv_shared_layers} leaves no layer with K / V of its own among "
                             f"the num_layers={self.num_layers}")
        if self.cross_attention_layers >= self.num_layers:
            raise ValueError(f"cross_attention_layers={self.cross_attention_layers} leaves no self-attention layer")
        if self.kv_shared_double_mlp and not self.kv_shared_layers:
            raise ValueError("kv_shared_double_mlp widens the K / V-sharing layers' MLP: it needs kv_shared_layers")
        if self.per_layer_input_vocab is not None and not self.per_layer_input_size:
            raise ValueError("per_layer_input_vocab is the per-layer input table's: it needs per_layer_input_size")
        if (self.moe_router_scales or self.moe_block_norms) and not self.is_moe:
            raise ValueError("moe_router_scales and moe_block_norms are mixture-of-experts fields: they need "
                             "num_experts (the routed experts)")
        if self.num_attention_heads % (self.full_attention_kv_heads or 1):
            raise ValueError(f"attention heads a={self.num_attention_heads} are not divisible by the full-attention "
                             f"layers' key/value heads {self.full_attention_kv_heads}")
        if self.embedding_widths and self.tied_embeddings and len(set(self.embedding_widths)) > 1:
            raise ValueError(f"embedding_widths {self.embedding_widths}: a tied output layer is the word embeddings', "
                             "e_out = e")
        if self.moe_shared_gate and not self.moe_shared_ffn_hidden_size:
            raise ValueError("moe_shared_gate gates the shared experts: it needs moe_shared_ffn_hidden_size")
        check_latent(self)
        check_gate(self)
        check_experts(self)
        check_hybrid(self)  # the layer pattern's checks (core/hybrid.py)
        return self
