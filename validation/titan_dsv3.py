"""torchtitan 0.3.0's DeepSeek-V3 decoder layers (models/deepseek_v3: MLA attention, dense first layers, MoE with
shared experts): what its real code keeps for the backward, measured on CPU and traced with symbolic s, b.

``build_dsv3_block(shape, moe)`` builds one ``DeepSeekV3TransformerBlock`` from torchtitan's own
``_build_dsv3_layers`` (``build_mla_moe_layers`` with DeepSeek-V3's inits; layer 0 dense, layer 1 MoE) in bf16 with
the 671B flavour's attention and router kinds at tiny sizes (``DsvShape``): the q latent (q_lora_rank > 0: wq_a,
q_norm, wq_b; ``q_lora=0`` gives the smaller flavours' single wq), the kv latent (wkv_a, kv_norm, wkv_b), yarn
ComplexRoPE on the rope part, the sigmoid router with expert groups, route_norm and route_scale, shared experts;
torchtitan's own ``_debug_force_load_balance`` routes balanced.  ``wrap_dsv3_ac`` wraps it as
torchtitan's AC modes do; what a layer keeps is read off live storages (validation/titan.py ``kept_storages``).

One substitution: torchtitan attends with compiled FlexAttention (no CPU backward; the CPU sdpa flash kernel the
Llama 3 harness uses refuses MLA's value width d_v != d_n + d_r).  ``SavedAsFlex`` stands in as the inner attention:
one custom op (``flex_saved``, in SelectiveAC's save list where torchtitan's names flex_attention) that keeps what
torch's ``FlexAttentionAutogradOp`` saves (``ctx.save_for_backward(query, key, value, out, logsumexp)``: q, k and v
as passed, so v's view keeps wkv_b's whole output, the bf16 output, the fp32 log-sum-exp), its backward recomputed
with the math sdpa.  That save set is derived from torch 2.13's code, not measured.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from validation.titan import kept_storages, trace_kept
from validation.titan_moe import ep_states_run, wrap_ac


@dataclass(frozen=True)
class DsvShape:
    """A DeepSeek-V3 layer's sizes: h, heads a, q / kv latents rq / rkv, head widths dn, dr, dv, dense FFN f,
    expert FFN fe, experts E, shared experts ns, top-k k, expert groups / limited groups."""
    h: int = 64
    a: int = 4
    rq: int = 32
    rkv: int = 48
    dn: int = 16
    dr: int = 8
    dv: int = 12
    f: int = 96
    fe: int = 32
    E: int = 8
    ns: int = 1
    k: int = 2
    groups: int = 4
    limited: int = 2


@torch.library.custom_op("memplan_validation::flex_saved", mutates_args=())
def flex_saved(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention (B, N, L, H) with FlexAttention's outputs: out (q's dtype) and the fp32 log-sum-exp; one op,
    as torch's flex_attention is to the dispatch modes (SelectiveAC's save list, the kept-storage census)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    sq, sk = q.shape[-2], k.shape[-2]  # sk > sq: a cp rank's queries against the whole sequence (sizes only)
    scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1 + sk - sq),
                                float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return ((scores - lse.unsqueeze(-1)).exp() @ v.float()).to(q.dtype), lse


@flex_saved.register_fake
def _(q, k, v, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _setup(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, *output)  # FlexAttentionAutogradOp's save set
    ctx.scale = scale


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, _out, _lse = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=ctx.scale)
        return (*torch.autograd.grad(out, (q, k, v), grad_out), None)


flex_saved.register_autograd(_backward, setup_context=_setup)


class SavedAsFlex(torch.nn.Module):
    """torchtitan's inner-attention call (B, L, N, H in and out) with FlexAttention's saved set (``flex_saved``)."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, **_):
        out, _lse = flex_saved(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale)
        return out.transpose(1, 2)


def wrap_dsv3_ac(block, ac: str):
    """``block`` as torchtitan's AC mode ``ac`` wraps it (validation/titan_moe.py ``wrap_ac``: SelectiveAC with its
    shipped default config, ``force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]``: the router gate's matmul
    recomputed, not counted in the every-other-matmul rule), ``flex_saved`` in SelectiveAC's save list where
    torchtitan's names flex_attention."""
    return wrap_ac(block, ac, save_also=(torch.ops.memplan_validation.flex_saved.default,))


def dsv3_layer_configs(shape: DsvShape, n_layers: int = 2, n_dense: int = 1, q_lora: bool = True,
                       balanced: bool = True) -> list:
    """torchtitan's own DeepSeek-V3 layer configs at ``shape`` (the first ``n_dense`` dense), the inner attention
    ``SavedAsFlex``; ``q_lora``: the 671B flavour's q latent, else the debug / 16B flavours' single wq."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.deepseek_v3 import _build_dsv3_layers

    cfgs = _build_dsv3_layers(
        n_layers=n_layers, n_dense_layers=n_dense, dim=shape.h, n_heads=shape.a, q_lora_rank=shape.rq if q_lora else 0,
        kv_lora_rank=shape.rkv, qk_nope_head_dim=shape.dn, qk_rope_head_dim=shape.dr, v_head_dim=shape.dv, mscale=1.0,
        dense_hidden_dim=shape.f, moe_hidden_dim=shape.fe, num_experts=shape.E, num_shared_experts=shape.ns,
        router_top_k=shape.k, router_score_func="sigmoid", router_num_expert_groups=shape.groups,
        router_num_limited_groups=shape.limited, router_route_scale=2.5, router_route_norm=True, attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=shape.dr, max_seq_len=1024, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=64))
    for cfg in cfgs:
        cfg.attention.inner_attention = _StandIn.Config()
        if cfg.moe is not None:
            cfg.moe.router._debug_force_load_balance = balanced
    return cfgs


def _stand_in_config():
    """``SavedAsFlex`` as a torchtitan Module (its Config builds it and carries the sharding config torchtitan's
    ``set_gqa_inner_attention_local_map`` installs: under TP the stand-in runs inside the same local_map, on the
    rank's heads, as FlexAttention does)."""
    from torchtitan.protocols.module import Module

    class FlexStandIn(Module, SavedAsFlex):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config=None):
            super().__init__()

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, **_):
            return SavedAsFlex.forward(self, q_BLNH, k_BLNH, v_BLNH, scale=scale)
    return FlexStandIn.Config


class _StandIn:
    Config = _stand_in_config()


def build_dsv3_block(shape: DsvShape, moe: bool, q_lora: bool = True, balanced: bool = True) -> torch.nn.Module:
    """One torchtitan DeepSeek-V3 decoder layer (bf16): the MoE one (``moe``) or a dense first layer."""
    block = dsv3_layer_configs(shape, q_lora=q_lora, balanced=balanced)[1 if moe else 0].build()
    for p in list(block.parameters()):
        p.data = p.data.to(torch.bfloat16)
    return block


def measure_dsv3(shape: DsvShape, ac: str, s: int, b: int, moe: bool = True, q_lora: bool = True,
                 seed: int = 0) -> dict:
    """Real tensors on CPU: the storages the layer keeps after its forward (``rows``: op, dtype, bytes), whether it
    keeps its input, their ``total``; the backward is run once."""
    torch.manual_seed(seed)
    block = wrap_dsv3_ac(build_dsv3_block(shape, moe, q_lora), ac)
    x = torch.randn(b, s, shape.h, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast refuses fp32 (validation/titan_moe.py)
        kept, out, input_kept = kept_storages(block, x)
        out.float().square().mean().backward()
    rows = [(op, str(dtype).replace("torch.", ""), int(n)) for op, dtype, n in kept]
    return {"rows": rows, "input_kept": input_kept, "total": sum(n for _, _, n in rows)}


def trace_dsv3(shape: DsvShape, ac: str, moe: bool = True, q_lora: bool = True, s_hint: int = 64,
               b_hint: int = 3) -> dict:
    """The layer under FakeTensorMode with s and b symbolic (validation/titan.py ``trace_kept``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_kept(lambda: wrap_dsv3_ac(build_dsv3_block(shape, moe, q_lora, balanced=False), ac), shape.h,
                          s_hint, b_hint)


def dsv3_model_config(shape: DsvShape, vocab: int, q_lora: bool = True, n_layers: int = 2, n_dense: int = 1,
                      mtp: int = 0):
    """A torchtitan DeepSeekV3Model config at ``shape`` (by default 2 layers: a dense layer, an MoE layer), ``mtp``
    MTP layers (torchtitan's ``_build_mtp_layers`` on the last layer's config, as model_registry makes them)."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_mtp_layers

    layers = dsv3_layer_configs(shape, n_layers, n_dense, q_lora)
    return DeepSeekV3Model.Config(vocab_size=vocab, dim=shape.h, layers=layers,
                                  tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=shape.h),
                                  norm=RMSNorm.Config(normalized_shape=shape.h),
                                  lm_head=Linear.Config(in_features=shape.h, out_features=vocab),
                                  mtp_layers=_build_mtp_layers(layers[-1], dim=shape.h, num_mtp_layers=mtp))


def measure_dsv3_mtp(shape: DsvShape, mtp: int, ac: str, s: int, b: int, vocab: int = 128, seed: int = 0) -> int:
    """Bytes of the saved tensors alive after the forward and the loss of the 2-layer model with ``mtp`` MTP layers
    (``dsv3_model_config``, bf16, balanced routing), its ``layers`` wrapped as torchtitan's AC ``ac`` wraps them (its
    ActivationCheckpointing.apply wraps model.layers only, not the MTP layers), run as torchtitan's trainer runs it:
    the dataloader's positions passed to the model, MTPLoss (CrossEntropy's cross_entropy_loss without MTP layers);
    every saved tensor's storage counted once (validation/titan_pp.py's hooks), the parameters not; the backward is
    run once."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.deepseek_v3 import MTPLoss

    from validation.titan_pp import _SavedPeak

    torch.manual_seed(seed)
    model = dsv3_model_config(shape, vocab, mtp=mtp).build()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    for i, block in list(model.layers.named_children()):
        model.layers.register_module(i, wrap_dsv3_ac(block, ac))
    tokens = torch.randint(0, vocab, (b, s))
    labels, positions = tokens.roll(-1, 1), torch.arange(s).repeat(b, 1)
    saved = _SavedPeak([*model.parameters(), *model.buffers()])
    with warnings.catch_warnings(), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        warnings.simplefilter("ignore")  # CPU autocast refuses fp32 (validation/titan_moe.py)
        out = model(tokens, positions)
        loss = MTPLoss(MTPLoss.Config())(out, labels, positions=positions)[0] if mtp else cross_entropy_loss(out, labels)
        kept = saved.live
        loss.backward()
    return kept


def dsv3_ep_states_rank(rank: int, world: int, ep: int, shape: DsvShape, vocab: int, s: int, b: int) -> dict:
    """validation/titan_moe.py ``ep_states_rank`` with torchtitan's own ``parallelize_deepseekv3`` and
    ``set_deepseek_v3_sharding_config`` on the 2-layer DeepSeek-V3 model (``dsv3_model_config``)."""
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    return ep_states_run(world, ep, dsv3_model_config(shape, vocab), set_deepseek_v3_sharding_config,
                         parallelize_deepseekv3, vocab, s, b)


def measure_dsv3_ep_states(shape: DsvShape, ep: int = 2, world: int = 2, vocab: int = 256, s: int = 16,
                           b: int = 2) -> list[dict]:
    """``dsv3_ep_states_rank`` on ``world`` spawned ranks over gloo."""
    from .ranks import run_ranks
    return run_ranks(dsv3_ep_states_rank, world, (ep, shape, vocab, s, b))


if __name__ == "__main__":
    import json
    import sys

    mode = sys.argv[1] if len(sys.argv) > 1 else "none"
    print(json.dumps({kind: measure_dsv3(DsvShape(), mode, 32, 2, moe=kind == "moe")
                      for kind in ("dense", "moe")}))
