"""The cases `memplan validate` measures saved tensors on (`ValidationCase`) and their grids: the reference layer
(small shapes, the paper's layers under FakeTensorMode), transformers GPT-2 / Llama, megatron-core's local spec
(dense, MoE, multi-head latent attention) and the traced families.

torch is imported only to list the traced families (their configs live with the tracer).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Iterable, Optional

from memplan.core.harness import harness

# Small shapes for real runs (s, b, h, a, f) and the paper's layers for fake runs.
SHAPES = [(64, 2, 64, 4, None), (32, 3, 96, 8, 160)]
PAPER_LAYERS = {"gpt3-175b": (2048, 1, 12288, 96), "gpt3-530b": (2048, 1, 20480, 128)}


@dataclass(frozen=True)
class ValidationCase:
    name: str
    scope: str  # "layer" or "model"
    s: int
    b: int
    h: int
    a: int
    f: Optional[int]
    t: int
    sp: bool
    recompute: str
    backend: str  # ledger | live | fake | cuda
    v: int = 512
    L: int = 2
    impl: str = "torch"  # torch (validation/layers.py) | hf-eager | hf-sdpa (transformers) | megatron-local
    arch: str = "gpt2"  # hf-*: gpt2 | llama; megatron-local: gpt | llama
    g: Optional[int] = None  # llama: key/value heads
    head_dim: Optional[int] = None  # llama: width of one head (None = h/a)
    dropout: float = 0.1
    # megatron-local mixture of experts (experts > 0): megatron-core's MoELayer in every layer, balanced routing,
    # aux loss on (memplan/inventory/moe.py)
    experts: int = 0
    topk: int = 2
    fe: Optional[int] = None
    fs: int = 0
    ep: int = 1
    etp: Optional[int] = None
    dispatcher: str = "alltoall"
    capacity: Optional[float] = None
    pad: bool = False
    aux_loss: float = 0.01  # --moe-aux-loss-coeff (Megatron-LM's default is 0)
    z_loss: Optional[float] = None  # --moe-z-loss-coeff
    router_dtype: Optional[str] = None  # --moe-router-dtype
    pre_softmax: bool = False  # --moe-router-pre-softmax
    gelu: bool = False  # GeLU experts (and dense MLP) instead of SwiGLU
    loads: tuple[int, ...] = ()  # routed copies per expert from each rank's tokens (() balanced: validation/mcore.py)
    mcore_version: str = "0.16"  # the megatron-core modelled (validate.run sets the one measured)
    # megatron-local multi-head latent attention (kv_lora > 0: megatron-core's MLASelfAttention, memplan/inventory/mla.py)
    kv_lora: int = 0
    q_lora: Optional[int] = None
    dn: int = 32
    dr: int = 16
    dv: int = 24
    # hf-* Llama: peft LoRA of this rank (0: none) on `lora_targets` (empty: peft's default), with lora dropout
    lora: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = 0.0
    modules: tuple[str, ...] = ("core_attn",)  # selective recompute: Megatron-LM's --recompute-modules

    @property
    def layers(self) -> int:
        return 1 if self.scope == "layer" else self.L


def grid(device: str = "cpu", tps: Iterable[int] = (1, 2, 4), recomputes: Iterable[str] = ("none", "selective", "full"),
         fake: bool = True, scopes: Iterable[str] = ("layer", "model")) -> list[ValidationCase]:
    """The CI grid: small shapes x t x SP x recompute x (layer, model), the t = 1 cases also through
    the live-storage tracker, plus the 175B / 530B layers at t = 8 under FakeTensorMode."""
    base = "cuda" if device == "cuda" else "ledger"
    cases = []
    for s, b, h, a, f in SHAPES:
        for t in tps:
            for sp in ([False, True] if t > 1 else [False]):
                for rec in recomputes:
                    for scope in scopes:
                        name = f"s{s} b{b} h{h} a{a}" + (f" f{f}" if f else "")
                        cases.append(ValidationCase(name, scope, s, b, h, a, f, t, sp, rec, base))
                        if t == 1 and device == "cpu" and (s, b, h, a, f) == SHAPES[0]:
                            cases.append(ValidationCase(name, scope, s, b, h, a, f, t, sp, rec, "live"))
    if fake:
        for name, (s, b, h, a) in PAPER_LAYERS.items():
            for sp in (False, True):
                for rec in recomputes:
                    cases.append(ValidationCase(f"{name} layer", "layer", s, b, h, a, None, 8, sp, rec, "fake"))
    return cases


def hf_grid(fake: bool = True) -> list[ValidationCase]:
    """transformers GPT-2 and Llama, eager and sdpa, built from a config (no weights), CPU, bf16:
    small shapes (GQA and not; GPT-2 with and without dropout) per layer and per 2-layer model, and
    a llama3-8b-shaped layer at s = 4096 under FakeTensorMode (the README's table)."""
    cases = []
    for impl in ("hf-eager", "hf-sdpa"):
        for arch, g, dropouts in (("gpt2", None, (0.1, 0.0)), ("llama", 2, (0.0,)), ("llama", 4, (0.0,))):
            for dropout in dropouts:
                if impl == "hf-sdpa" and dropout > 0:
                    continue  # sdpa with dropout on CPU is torch's fp32 math kernel: not modelled
                for scope in ("layer", "model"):
                    f = 4 * 64 if arch == "gpt2" else 160
                    name = f"{arch} s32 b2 h64 a4" + (f" g{g}" if g else "") + (f" p{dropout}" if dropout else "")
                    cases.append(ValidationCase(name, scope, 32, 2, 64, 4, f, 1, False, "none", "ledger",
                                                impl=impl, arch=arch, g=g, dropout=dropout))
        # heads wider in total than h, as Mistral-Nemo (32 x 128 > 5120) and Gemma: q = 4 x 24 = 96, h = 64
        for scope in ("layer", "model"):
            cases.append(ValidationCase("llama s32 b2 h64 a4 g2 head_dim24", scope, 32, 2, 64, 4, 160, 1, False,
                                        "none", "ledger", impl=impl, arch="llama", g=2, head_dim=24, dropout=0.0))
        if fake:
            cases.append(ValidationCase("llama3-8b layer s4096", "layer", 4096, 1, 4096, 32, 14336, 1, False, "none",
                                        "fake", v=128256, impl=impl, arch="llama", g=8, dropout=0.0))
    return cases


MCORE_SHAPE = dict(s=32, b=2, h=64, a=4)  # every megatron-core case; llama: g = 2, f = 160, no dropout


def mcore_case(arch: str, t: int = 1, sp: bool = False, recompute: str = "none", scope: str = "layer",
               backend: str = "ledger", modules: tuple[str, ...] = ("core_attn",)) -> ValidationCase:
    """One megatron-core local-spec case (validation/mcore.py): GPT (LayerNorm, GeLU, learned positions,
    dropout 0.1) or Llama-like (RMSNorm, SwiGLU, RoPE, GQA 4 heads / 2 groups, f = 160, no dropout);
    scope "model" is a 2-layer GPTModel with its loss."""
    llama = arch == "llama"
    name = f"mcore {arch}" + (f" recompute {'+'.join(modules) or 'no module'}" if modules != ("core_attn",) else "")
    return ValidationCase(name, scope, MCORE_SHAPE["s"], MCORE_SHAPE["b"], MCORE_SHAPE["h"],
                          MCORE_SHAPE["a"], 160 if llama else None, t, sp, recompute, backend, v=256, L=2,
                          impl="megatron-local", arch=arch, g=2 if llama else None, dropout=0.0 if llama else 0.1,
                          modules=modules)


def mcore_grid(tps: Iterable[int] = (1, 2), recomputes: Iterable[str] = ("none", "selective", "full"),
               archs: Iterable[str] = ("gpt", "llama"), scopes: Iterable[str] = ("layer", "model")
               ) -> list[ValidationCase]:
    """megatron-core's local spec on CPU: GPT and Llama-like, one layer and a GPTModel, t = 1 and 2 (gloo
    processes), SP on and off, recompute none / selective / full; the GPT cases at t = 1 also through the
    live-storage tracker (retained after forward = the saved bytes)."""
    cases = []
    for arch in archs:
        for t in tps:
            for sp in ([False, True] if t > 1 else [False]):
                for rec in recomputes:
                    for scope in scopes:
                        cases.append(mcore_case(arch, t, sp, rec, scope))
                        if arch == "gpt" and t == 1:
                            cases.append(mcore_case(arch, t, sp, rec, scope, "live"))
    if "selective" in recomputes and "layer" in scopes:  # Megatron-LM's --recompute-modules (inventory/recompute.py)
        # "mlp" on the Llama-like layer only: with biases megatron-core 0.16.1's MLP checkpoint recurses in backward
        cases += [mcore_case(arch, 1, False, "selective", modules=m) for arch in archs
                  for m in (("layernorm",), ("mlp",), ("core_attn", "layernorm", "mlp")) if arch == "llama" or "mlp" not in m]
    if "llama" in archs and "layer" in scopes:  # megatron-core's MoELayer (memplan/inventory/moe.py)
        cases += mcore_moe_cases()
        if "selective" in recomputes:
            cases += mcore_module_cases()
        if 2 in tps:
            cases += mcore_moe_cases(two=True)
        # megatron-core's MLASelfAttention (memplan/inventory/mla.py)
        cases += [mcore_mla_case(None)] + [mcore_mla_case(recompute=r) for r in recomputes] + [mcore_mla_case(experts=4)]
        if 2 in tps:
            cases += [mcore_mla_case(t=2), mcore_mla_case(t=2, sp=True)]
    return cases


def mcore_moe_case(dispatcher: str = "alltoall", ep: int = 1, capacity: Optional[float] = None, pad: bool = False,
                   fs: int = 0, scope: str = "layer", t: int = 1, etp: Optional[int] = None, topk: int = 2,
                   **router) -> ValidationCase:
    """One megatron-core MoE case: the Llama-like layer of mcore_case with megatron-core's MoELayer as its MLP
    (4 SequentialMLP experts of f_e = 96, top-2, aux loss 0.01, routing forced to be balanced); t > 1 with SP (MoE
    needs it), etp = t unless given; `router`: ValidationCase's aux_loss, z_loss, router_dtype, pre_softmax, gelu,
    loads (uneven routing)."""
    base = mcore_case("llama", t, t > 1, scope=scope)
    name = f"mcore moe {dispatcher} ep{ep}" + (f" t{t} etp{etp or t}" if t > 1 else "") + (
        f" k{topk}" if topk != 2 else "") + (f" C{capacity:g}" + (" pad" if pad else "") if capacity else "") + (
        f" fs{fs}" if fs else "") + "".join(f" {k}={v}" for k, v in router.items())
    return dataclasses.replace(base, name=name, experts=4, topk=topk, fe=96, fs=fs, ep=ep, etp=etp,
                               dispatcher=dispatcher, capacity=capacity, pad=pad, **router)


def mcore_moe_cases(two: bool = False) -> list[ValidationCase]:
    """The megatron-core MoE cases of `validate --mcore` (one process): dispatchers, capacity with and without
    padding, shared experts, and Megatron-LM's router options (no aux loss, its default; the z-loss with the
    router in fp32; the softmax before the top-k at k = 1, which megatron-core requires there; GeLU experts);
    uneven routing with and without a capacity (each expert dropping what exceeds its own capacity);
    `two`: those of two gloo processes (ep = 2, or t = 2 with SP and etp = 2 / 1)."""
    if two:
        return [mcore_moe_case(ep=2), mcore_moe_case("allgather", ep=2), mcore_moe_case(t=2, fs=64),
                mcore_moe_case("allgather", t=2), mcore_moe_case(t=2, etp=1), mcore_moe_case("allgather", t=2, etp=1)]
    return [mcore_moe_case(), mcore_moe_case("allgather"), mcore_moe_case(capacity=1.0, pad=True),
            mcore_moe_case(capacity=0.5), mcore_moe_case(fs=64), mcore_moe_case(aux_loss=0.0),
            mcore_moe_case(z_loss=1e-3, router_dtype="fp32"), mcore_moe_case(topk=1, pre_softmax=True, aux_loss=0.0),
            mcore_moe_case(gelu=True, fs=64), mcore_moe_case(capacity=1.0, loads=UNEVEN),
            mcore_moe_case(loads=UNEVEN)]


# uneven routing of the 64 tokens x top-2 of mcore_moe_case over 4 experts: 1.75, 1.25, 0.5, 0.5 x the average 32
UNEVEN = (56, 40, 16, 16)


def mcore_module_cases() -> list[ValidationCase]:
    """Selective recompute of the MoE and MLA modules (memplan/inventory/recompute.py) on the MoE and MLA layers of
    mcore_moe_case / mcore_mla_case: the whole MoE layer, the shared experts, MLA's up projections (with and
    without the q down projection), and three modules at once on DeepSeek-V3's layer."""
    def selective(case: ValidationCase, *modules: str) -> ValidationCase:
        return dataclasses.replace(case, name=f"{case.name} recompute {'+'.join(modules)}", recompute="selective",
                                   modules=modules)

    return [selective(mcore_moe_case(fs=64), "moe"), selective(mcore_moe_case(fs=64), "shared_experts"),
            selective(mcore_mla_case(), "mla_up_proj"), selective(mcore_mla_case(None), "mla_up_proj"),
            selective(mcore_mla_case(experts=4), "core_attn", "mla_up_proj", "shared_experts")]


def mcore_mla_case(q_lora: Optional[int] = 40, t: int = 1, sp: bool = False, recompute: str = "none",
                   experts: int = 0) -> ValidationCase:
    """One megatron-core multi-head latent attention case: the Llama-like layer of mcore_case (no GQA) with
    megatron-core's MLASelfAttention and its latent norms: a = 4 heads of d_n = 32 + d_r = 16 (Q / K) and
    d_v = 24 (V), r_kv = 48, r_q = 40 (None: the direct q projection); `experts` > 0: the MoE layer of
    mcore_moe_case as its MLP (DeepSeek-V3's layer)."""
    base = dataclasses.replace(mcore_case("llama", t, sp, recompute), g=None)
    name = f"mcore mla r_q{q_lora}" + (f" t{t}" + (" sp" if sp else "") if t > 1 else "") + (
        f" {recompute}" if recompute != "none" else "") + (" moe" if experts else "")
    moe = dict(experts=experts, topk=2, fe=96, fs=64) if experts else {}
    return dataclasses.replace(base, name=name, kv_lora=48, q_lora=q_lora, dn=32, dr=16, dv=24, **moe)


def mcore_available() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def traced_grid() -> list[ValidationCase]:
    """Every family the tracer is checked on (validation/trace_config.py FAMILIES: Qwen2, Qwen3, Gemma 1-3,
    Phi-3, Mistral's sliding window, Mixtral, DeepSeek-V3), each a small model at two (s, b) on CPU:
    a traced inventory, as memplan reads it, against a real run. Imports torch (the family configs
    live with the tracer)."""
    families = importlib.import_module(harness().__name__ + ".trace_config").FAMILIES
    cases = []
    for family, (cfg, impl) in families.items():
        for s, b in ((16, 2), (40, 3)):
            cases.append(ValidationCase(f"{family} s{s} b{b} (traced)", "model", s, b, cfg["hidden_size"],
                                        cfg["num_attention_heads"], cfg.get("intermediate_size"), 1, False, "none",
                                        "ledger", v=cfg["vocab_size"], L=cfg["num_hidden_layers"], impl=impl,
                                        arch=family, g=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
                                        dropout=0.0))
    return cases
