"""torchtitan 0.3.0's Llama 3 decoder layer: what its real code keeps for the backward, traced and measured.

``build_block(shape, ac)`` builds one ``Llama3TransformerBlock`` from torchtitan's own config code
(``_build_llama3_layers``: fused QKV linear, complex RoPE, RMSNorm, SwiGLU feed-forward) in bf16 and
wraps it with torchtitan's own activation-checkpointing classes (``FullAC``, ``SelectiveAC``: its per-op
save list and its every-other-matmul rule), as ``ActivationCheckpointing.apply`` wraps each block.

What a layer keeps is read off live storages, not saved-tensor hooks (a checkpointed block's saves go
through torch.utils.checkpoint's own hooks and SAC's cache): ``_Live`` (a ``TorchDispatchMode``) notes every
storage an op makes during the block's forward; after the forward, the ones still alive (other than the
block's output) are what the layer keeps.  The block's input (the previous layer's output) is made
before the block and is counted by the caller: every AC mode keeps it.

The block is called as torchtitan's Trainer calls it: with the dataloader's ``positions`` (``loader_positions``; its
text datasets always yield them), so each layer's RoPE gathers its own copy of the cache rows at those positions
(models/common/rope.py ``_reshape_for_broadcast``: ``rope_cache[positions.squeeze(0)]`` at b = 1, a ``gather`` over
the batch otherwise), which the rotation's multiplications keep for the backward under AC none.

The same code runs twice: with real tensors at given (s, b) (``measure_block``: bytes), and under
``FakeTensorMode`` with s and b symbolic (``trace_block``: each kept storage an exact polynomial in s, b,
refused if the ShapeEnv pinned s or b).

``build_block(float8=...)`` swaps the block's linears for torchao's Float8Linear with torchtitan's own
``Float8LinearConverter.convert`` (``float8_converter``: its SM89 check skipped, torch 2.13 runs the float8 GEMMs on
CPU); ``fsdp_rank(float8="tensorwise")`` converts the model as torchtitan <= 0.2 did, with FSDP2's float8 all-gather.

One substitution, said everywhere it shows: torchtitan's language models attend with compiled
FlexAttention, which has no backward on CPU.  The block here uses torchtitan's ``ScaledDotProductAttention``
inner module (is_causal) instead, whose CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``) keeps
q, k, v, out and the fp32 log-sum-exp, the set FlexAttention's autograd op (torch's
``FlexAttentionAutogradOp``) keeps; under SelectiveAC the CPU kernel is added to torchtitan's save list
(its ``get_save_ops`` hook), standing in for the ``flex_attention`` op torchtitan's list names.  The block
mask (shared by the layers, O(s^2 / 128^2)) is not in the layer.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import sympy
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .ranks import sum_reductions
from .trace_poly import symbolic_sizes

AC_MODES = ("none", "full", "selective-op")


@dataclass(frozen=True)
class Shape:
    """A Llama 3 layer's sizes: h (dim), a (heads), g (KV heads), f (FFN hidden)."""
    h: int = 64
    a: int = 4
    g: int = 2
    f: int = 160
    qwen3: bool = False  # torchtitan's Qwen3 block (_build_qwen3_layers: q / k RMSNorms on the head dim, CosSinRoPE)
    d: int = 0  # the Qwen3 block's head width (0: h / a; Qwen3's head_dim is its own, a d differs from h in 0.6B)


def _titan():
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _build_llama3_layers
    return FullAC, SelectiveAC, ComplexRoPE, ScaledDotProductAttention, _build_llama3_layers


def selective_ac(SelectiveAC, *save_also):
    """torchtitan's SelectiveAC with its shipped default Config: ``force_recompute_mm_shapes_by_fqns =
    ["moe.router.gate"]`` (torchtitan 0.3.0 distributed/activation_checkpoint.py: the MoE router gate's matmul, and
    any mm of its shape, recomputed and not counted in the every-other-matmul rule; a dense block has no such module,
    so nothing changes there), with the CPU attention kernel (flex_attention's stand-in) and ``save_also`` (ops)
    added to its save list."""
    class CpuSelectiveAC(SelectiveAC):
        def get_save_ops(self) -> set:
            return super().get_save_ops() | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                                             *save_also}
    return CpuSelectiveAC(CpuSelectiveAC.Config())


def float8_converter(recipe: str):
    """torchtitan's own ``Float8LinearConverter`` for torchao's ``recipe`` (tensorwise, rowwise) with the shipped
    ``filter_fqns=["lm_head"]``; its hardware check (CUDA SM89+, else emulation, which would replace the recipe by
    emulated tensorwise) is what is skipped: torch 2.13 runs ``torch._scaled_mm`` and the float8 dtypes on CPU."""
    from functools import partial

    from torchao.float8 import Float8LinearConfig
    from torchtitan.components.quantization.float8 import Float8LinearConverter
    from torchtitan.components.quantization.utils import module_filter_fn

    conv = object.__new__(Float8LinearConverter)
    conv.config = Float8LinearConverter.Config(recipe_name=recipe, filter_fqns=["lm_head"])
    conv.torchao_config = Float8LinearConfig.from_recipe_name(recipe)
    conv.filter_fn = partial(module_filter_fn, filter_fqns=conv.config.filter_fqns)
    conv.enabled = True
    return conv


def build_block(shape: Shape, ac: str = "none", max_seq_len: int = 4096, float8: str | None = None,
                flex: bool = False) -> torch.nn.Module:
    """One torchtitan Llama 3 decoder layer (bf16), wrapped as torchtitan's AC mode ``ac`` wraps it; ``float8``: its
    linears swapped for torchao's Float8Linear by torchtitan's converter (``float8_converter``); ``flex``: its
    FlexAttention kept (validation/titan_cp.py runs it), else the sdpa inner module (module docstring)."""
    if ac not in AC_MODES:
        raise ValueError(f"ac must be one of {AC_MODES}")
    FullAC, SelectiveAC, ComplexRoPE, SDPA, build_layers = _titan()
    if shape.qwen3:
        from torchtitan.models.common import CosSinRoPE
        from torchtitan.models.qwen3 import _build_qwen3_layers
        d = shape.d or shape.h // shape.a
        cfg = _build_qwen3_layers(n_layers=1, dim=shape.h, n_heads=shape.a, n_kv_heads=shape.g, head_dim=d,
                                  hidden_dim=shape.f, attn_backend="flex",
                                  rope=CosSinRoPE.Config(dim=d, max_seq_len=max_seq_len, theta=1000000.0))[0]
    else:
        if shape.d:
            raise ValueError("Shape.d is the Qwen3 block's head width (Llama 3's is h / a)")
        cfg = build_layers(n_layers=1, dim=shape.h, n_heads=shape.a, n_kv_heads=shape.g, hidden_dim=shape.f,
                           rope=ComplexRoPE.Config(dim=shape.h // shape.a, max_seq_len=max_seq_len, theta=500000,
                                                   scaling="llama"), attn_backend="flex")[0]
    if not flex:
        cfg.attention.inner_attention = SDPA.Config()
    if float8:
        cfg = float8_converter(float8).convert(cfg)
    block = cfg.build()
    for p in list(block.parameters()):  # bf16 in place (fake tensors cannot be swapped by Module.to)
        p.data = p.data.to(torch.bfloat16)
    if ac == "full":
        block = FullAC(FullAC.Config())._wrap_block(block)
    elif ac == "selective-op":
        block = selective_ac(SelectiveAC)._wrap_block(block)
    return block


class _Live(TorchDispatchMode):
    """Every storage an op makes, with the op that made it first."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[StorageWeakRef, tuple[str, torch.dtype, object]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.made.setdefault(StorageWeakRef(st), (str(func.overloadpacket.__name__), t.dtype, st.nbytes()))
        return out

    def alive(self, exclude=()) -> list[tuple[str, torch.dtype, object]]:
        gc.collect()
        skip = {StorageWeakRef(t.untyped_storage()) for t in exclude}
        return [v for k, v in self.made.items() if not k.expired() and k not in skip]


def loader_positions(b, s) -> torch.Tensor:
    """The ``positions`` torchtitan 0.3.0's Trainer hands every decoder layer: its text dataset yields them with every
    sample (hf_datasets/text_datasets.py ``HuggingFaceTextDataset.__iter__``: int64, ``range`` within each document,
    restarting at document boundaries), the DataLoader stacks them to (b, s), ``post_dataloading_process`` passes them
    as a model kwarg (CP-sharded with the tokens), ``Decoder.forward`` to each layer's RoPE.  One document per sample
    here: the values do not change a size."""
    return torch.arange(s).unsqueeze(0).repeat(b, 1)


def kept_storages(block, x0, mask=None, positions: bool = True) -> tuple[list, torch.Tensor, bool]:
    """The storages the block keeps, its output, and whether it keeps its input (made here from the leaf
    ``x0`` by an op that saves nothing, so only the block can keep it alive); ``mask``: the attention's block mask
    (FlexAttention under context parallelism, validation/titan_cp.py); ``positions``: the block called with the
    dataloader's positions for x0's (b, s) as torchtitan's Trainer always calls it (``loader_positions``; a batch
    input, not counted), else with none (each layer's RoPE then broadcasts its own buffer's prefix)."""
    pos = loader_positions(x0.shape[0], x0.shape[1]) if positions else None
    x = x0 * 1
    x_ref = StorageWeakRef(x.untyped_storage())
    live = _Live()
    with live:
        out = block(x, mask, pos)
    del x
    params = list(block.parameters()) + list(block.buffers())
    kept = live.alive([out, *params] + ([pos] if pos is not None else []))
    return kept, out, not x_ref.expired()


def measure_block(shape: Shape, ac: str, s: int, b: int, seed: int = 0, float8: str | None = None,
                  positions: bool = True) -> dict:
    """Real tensors on CPU: the storages the layer makes and keeps after its forward (``rows``: op, dtype,
    bytes; ``total`` their bytes), ``input_kept`` whether it keeps its input; the backward is run once (the
    block works).  ``float8``: with torchao's float8 linears (``build_block``); ``float8_linears`` how many;
    ``positions``: the dataloader's positions passed, as torchtitan's Trainer does (``kept_storages``)."""
    torch.manual_seed(seed)
    block = build_block(shape, ac, float8=float8)
    x = torch.randn(b, s, shape.h, dtype=torch.bfloat16, requires_grad=True)
    kept, out, input_kept = kept_storages(block, x, positions=positions)
    rows = [(op, str(dtype).replace("torch.", ""), int(n)) for op, dtype, n in kept]
    out.float().square().mean().backward()
    linears = sum(type(m).__name__ == "Float8Linear" for m in block.modules())
    return {"rows": rows, "input_kept": input_kept, "total": sum(n for _, _, n in rows), "float8_linears": linears}


def measure_layer_ac(shape: Shape, layers: int, every: int, s: int, b: int, seed: int = 0) -> dict:
    """torchtitan's selective per-layer AC (torchtitan <= 0.2, ``selective_ac_option`` = ``every``; 0.3.0 has no
    such option) on ``layers`` chained blocks, with real tensors on CPU: its rule as its code wrote it (a count of
    the wrapped blocks from 1; ``checkpoint_wrapper(module, preserve_rng_state=False)`` where the count is a
    multiple of ``every``, the block as it is otherwise).  ``total``: bytes the stack keeps after its forward (the
    last block's output apart; the first block's input counted when a checkpoint keeps it), ``checkpointed``: the
    wrapped blocks (0-based); the backward is run once."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(seed)
    blocks, checkpointed, count = [], [], 0
    for i in range(layers):
        block = build_block(shape, "none")
        count += 1
        if count % every == 0:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
            checkpointed.append(i)
        blocks.append(block)
    x0 = torch.randn(b, s, shape.h, dtype=torch.bfloat16, requires_grad=True)
    x = x0 * 1
    x_ref = StorageWeakRef(x.untyped_storage())
    pos = loader_positions(b, s)
    live = _Live()
    with live:
        out = x
        for block in blocks:
            out = block(out, None, pos)
    del x
    params = [t for block in blocks for t in (*block.parameters(), *block.buffers())]
    kept = live.alive([out, *params, pos])
    input_bytes = 0 if x_ref.expired() else 2 * shape.h * s * b
    out.float().square().mean().backward()
    return {"total": sum(int(n) for _, _, n in kept) + input_bytes, "checkpointed": checkpointed}


def trace_block(shape: Shape, ac: str, s_hint: int = 256, b_hint: int = 3) -> dict:
    """The same under FakeTensorMode with s and b symbolic (forward only): ``rows`` (op, dtype, bytes as a
    sympy polynomial in the symbols s, b), ``total``, ``input_kept``."""
    return trace_kept(lambda: build_block(shape, ac), shape.h, s_hint, b_hint)


def trace_kept(make_block, h: int, s_hint: int = 256, b_hint: int = 3) -> dict:
    """What the block ``make_block()`` (built under the fake mode) keeps for a (b, s, h) input, s and b symbolic
    (``trace_block``; validation/titan_moe.py); refused if the ShapeEnv pinned s or b."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    env, names, sizes = symbolic_sizes(s_hint, b_hint)
    with FakeTensorMode(shape_env=env, allow_non_fake_inputs=False):
        block = make_block()
        x = torch.randn(sizes["b"], sizes["s"], h, dtype=torch.bfloat16, requires_grad=True)
        kept, out, input_kept = kept_storages(block, x)
        del out
    pinned = [str(g) for g in env.guards if {str(v) for v in getattr(g.expr, "free_symbols", ())} & {"s0", "s1"}
              and ("Eq(" in str(g.expr) and "Mod" not in str(g.expr))]
    if env.replacements:
        pinned += [f"{k} -> {v}" for k, v in env.replacements.items() if v.is_number]
    if pinned:
        raise RuntimeError(f"trace pinned s or b: {pinned}")
    rows = []
    for op, dtype, n in kept:
        expr = sympy.expand(n.node.expr.xreplace(names) if isinstance(n, torch.SymInt) else sympy.Integer(n))
        rows.append((op, str(dtype).replace("torch.", ""), expr))
    return {"rows": rows, "input_kept": input_kept, "total": sympy.expand(sum((e for _, _, e in rows), sympy.Integer(0)))}


# ---------------------------------------------------------------------------------------------
# FSDP2: torchtitan's apply_fsdp_to_decoder on a whole tiny model, ranks over gloo on CPU


def build_model(shape: Shape, layers: int, vocab: int, ac: str = "none", tp_sharding: bool = False,
                float8: str | None = None, max_seq_len: int = 512) -> torch.nn.Module:
    """A torchtitan Llama3Model (fp32, as torchtitan builds it before FSDP's mixed precision) with ``layers``
    blocks, the sdpa inner attention in place of compiled FlexAttention (module docstring); ``tp_sharding``: the
    sharding configs torchtitan's ``Llama3Model.Config.update_from_config`` sets (``set_llama3_sharding_config``,
    sequence parallelism on), which ``parallelize_llama`` applies when TP is on; ``max_seq_len``: each block's RoPE
    cache length (``update_from_config`` sets it to the Trainer's ``training.seq_len``)."""
    _, _, ComplexRoPE, SDPA, build_layers = _titan()
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model

    blocks = build_layers(n_layers=layers, dim=shape.h, n_heads=shape.a, n_kv_heads=shape.g, hidden_dim=shape.f,
                          rope=ComplexRoPE.Config(dim=shape.h // shape.a, max_seq_len=max_seq_len, theta=500000,
                                                  scaling="llama"), attn_backend="flex")
    for cfg in blocks:
        cfg.attention.inner_attention = SDPA.Config()
    config = Llama3Model.Config(dim=shape.h, vocab_size=vocab, layers=blocks,
                                tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=shape.h),
                                norm=RMSNorm.Config(normalized_shape=shape.h),
                                lm_head=Linear.Config(in_features=shape.h, out_features=vocab))
    if float8:  # torchtitan's converter runs before update_from_config sets the sharding (models/llama3/__init__.py)
        config = float8_converter(float8).convert(config)
    if tp_sharding:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config
        set_llama3_sharding_config(config, enable_sp=True)
    return config.build()


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        t = getattr(t, "_data", t)  # torchao's Float8TrainingTensor: its float8 data
        st = t.untyped_storage()
        seen[StorageWeakRef(st)] = st.nbytes()
    return sum(seen.values())


def _unsharded_bytes(groups) -> int:
    """bf16 unsharded parameter bytes allocated now, over FSDP2's parameter groups (FSDP2 frees an unsharded
    parameter by resizing its storage to 0; a prefetched group's all-gather output exists before its unsharded
    parameters are made from it)."""
    tensors = [t for g in groups for p in g.fsdp_params for t in getattr(p, "all_gather_outputs", [])]
    tensors += [p._unsharded_param for g in groups for p in g.fsdp_params if hasattr(p, "_unsharded_param")]
    return storage_bytes(tensors)


def fsdp_rank(rank: int, world: int, shape: Shape, layers: int, vocab: int, s: int, b: int, replicate: int = 1,
              float8: str | None = None) -> dict:
    """One rank of a 1-step FSDP2 run (torchtitan's ``apply_fsdp_to_decoder``: bf16 params, fp32 reduce,
    reshard_after_forward by torchtitan's default policy): per-rank bytes of the sharded fp32 parameters,
    gradients and AdamW moments (storages, padding included), and the bf16 unsharded parameters alive: the
    most inside a block's forward (its feed-forward's end) and backward (its feed-forward's and attention's
    start), and after the forward (before the backward).  On CPU nothing runs ahead of the compute (no
    streams), so what a GPU's prefetch adds is not seen here.  ``replicate`` > 1: HSDP as torchtitan's
    parallelize_llama sets it up (data_parallel_replicate_degree): the 2-D mesh (dp_replicate, fsdp) given to
    fully_shard, which replicates over the first dimension and shards over the second (world / replicate ranks).
    Parameter shapes (all, one layer's) and count for the derivation."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    torch.manual_seed(0)
    model = build_model(shape, layers, vocab)
    if float8 == "tensorwise":  # torchtitan <= 0.2's float8: torchao's conversion with the float8 all-gather
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                   module_filter_fn=lambda _m, fqn: "lm_head" not in fqn)
    total_params = sum(p.numel() for p in model.parameters())
    layer_shapes = [tuple(p.shape) for p in model.layers["0"].parameters()]
    mesh = (init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)) if replicate == 1 else
            init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("dp_replicate", "fsdp")))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
    modules = sum_reductions(model)
    groups = [g for m in modules if (g := m._get_fsdp_state()._fsdp_param_group) is not None]
    peaks = {"forward": 0, "backward": 0}

    def sample(phase):
        peaks[phase] = max(peaks[phase], _unsharded_bytes(groups))

    handles = []
    for block in model.layers.values():  # inside each block: its parameters unsharded, the next one's prefetched
        handles.append(block.feed_forward.register_forward_hook(lambda *_: sample("forward")))
        handles.append(block.feed_forward.register_full_backward_pre_hook(lambda *_: sample("backward")))
        handles.append(block.attention.register_full_backward_pre_hook(lambda *_: sample("backward")))
    tokens = torch.randint(0, vocab, (b, s))
    logits = model(tokens)
    after_forward = _unsharded_bytes(groups)
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    for h in handles:
        h.remove()
    local = [p.to_local() for p in model.parameters()]
    grads = [p.grad.to_local() for p in model.parameters()]
    moments = [st[k].to_local() for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return {"params": storage_bytes(local), "grads": storage_bytes(grads), "adam": storage_bytes(moments),
            "unsharded_forward_peak": peaks["forward"], "unsharded_backward_peak": peaks["backward"],
            "unsharded_after_forward": after_forward, "layer_shapes": layer_shapes, "total_params": total_params,
            "shapes": [tuple(p.shape) for p in model.parameters()]}


def measure_fsdp(shape: Shape, layers: int, vocab: int, world: int, s: int = 16, b: int = 2,
                 replicate: int = 1, float8: str | None = None) -> list[dict]:
    """``fsdp_rank`` on ``world`` spawned ranks over gloo (``replicate``: HSDP's replicas)."""
    from .ranks import run_ranks
    return run_ranks(fsdp_rank, world, (shape, layers, vocab, s, b, replicate, float8))


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: torchtitan's parallelize_llama with tensor_parallel_degree = ranks, over gloo on CPU


class _AcShim:
    """``ac_config`` for parallelize_llama: ``build`` gives torchtitan's FullAC / SelectiveAC (the CPU attention
    kernel added to SelectiveAC's save list, as in build_block), which parallelize_llama applies after TP."""

    def __init__(self, ac: str) -> None:
        self.ac = ac

    def build(self, **_):
        FullAC, SelectiveAC, *_ = _titan()
        if self.ac == "full":
            return FullAC(FullAC.Config())
        return selective_ac(SelectiveAC)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class LiveLocal(_Live):
    """``_Live`` for a tensor-parallel block: a DTensor op's output counted by its local tensor's storage (the
    wrapper's own storage is sized like the global tensor), and only storages an op allocates (an output that
    aliases an input's storage, e.g. the transpose of an unsharded weight, is not new)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        seen = {StorageWeakRef(local_tensor(t).untyped_storage()) for t in flat if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = local_tensor(t).untyped_storage()
                if StorageWeakRef(st) not in seen:
                    self.made.setdefault(StorageWeakRef(st), (str(func.overloadpacket.__name__), t.dtype, st.nbytes()))
        return out

    def alive(self, exclude=()) -> list[tuple[str, torch.dtype, object]]:
        return super().alive([local_tensor(t) for t in exclude])


def tp_model(world: int, shape: Shape, layers: int, vocab: int, ac: str = "none", tp: int = 0,
             backend: str = "partial_dtensor", compile_backend: str = "", float8: str | None = None,
             max_seq_len: int = 512) -> tuple:
    """torchtitan's own ``parallelize_llama`` on this rank (``tp_rank``'s set-up): the model and its ParallelDims;
    ``compile_backend`` a registered torch.compile backend's name: its ``apply_compile`` on each block (after TP and
    AC, before FSDP, as torchtitan's CompileConfig(enable=True, components=["model"]) does)."""
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.parallelize import parallelize_llama

    pd.device_type = "cpu"
    torch.manual_seed(0)
    parallelism = ParallelismConfig(tensor_parallel_degree=tp or world, spmd_backend=backend)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    model = build_model(shape, layers, vocab, tp_sharding=True, float8=float8, max_seq_len=max_seq_len)
    compile_config = (CompileConfig(enable=True, components=["model"], backend=compile_backend) if compile_backend
                      else CompileConfig())
    parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                      compile_config=compile_config, ac_config=None if ac == "none" else _AcShim(ac), dump_folder="")
    sum_reductions(model)
    return model, dims


def tp_rank(rank: int, world: int, shape: Shape, layers: int, vocab: int, s: int, b: int, ac: str = "none",
            tp: int = 0, backend: str = "partial_dtensor", float8: str | None = None) -> dict:
    """One rank of a 1-step run of torchtitan's own ``parallelize_llama`` with ``tensor_parallel_degree`` =
    ``tp`` (default ``world``; sequence parallelism on, the ``partial_dtensor`` backend: DTensor TP; 0.3.0's default
    ``spmd_types`` stops in torch 2.13's fully_shard with TP) and FSDP2 over the world / tp data-parallel ranks (a
    size-1 mesh at tp = world: torchtitan always applies it), the loss torchtitan's ``cross_entropy_loss`` (its
    vocab-parallel ``_LossParallelCrossEntropy`` under TP).  Measured: ``layer`` the storages layer 0 made in its
    forward and still holds at its end (op, dtype, bytes; the block's output and the parameters apart),
    ``input_kept`` whether it keeps its input (``input_bytes`` its local bytes); ``tail`` the same for the final norm and the LM head; ``loss`` the storages the loss's forward made and holds until
    the backward; ``params`` / ``grads`` / ``adam`` per-rank fp32 state bytes after an AdamW step, with every
    parameter's local shape.  One substitution beyond the sdpa one: torchtitan picks its mesh's device type
    from the accelerator it finds (CUDA when none), set to "cpu" here."""
    return tp_step(*tp_model(world, shape, layers, vocab, ac, tp, backend, float8=float8), vocab, s, b, backend)


def tp_step(model, dims, vocab: int, s: int, b: int, backend: str = "partial_dtensor") -> dict:
    """``tp_rank``'s measured step on a parallelized torchtitan ``model`` (any of its decoder models: Llama 3, Qwen3
    MoE, validation/titan_moe.py ``moe_tp_rank``)."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    out: dict = {}
    live = LiveLocal()
    block = model.layers["0"]

    def pre(_module, args):
        out["x"] = StorageWeakRef(local_tensor(args[0]).untyped_storage())
        out["input_bytes"] = local_tensor(args[0]).untyped_storage().nbytes()
        live.__enter__()

    def post(module, _args, output):
        live.__exit__(None, None, None)
        params = [local_tensor(t) for t in (*module.parameters(), *module.buffers())]
        out["layer"] = [(op, str(dt).replace("torch.", ""), int(n)) for op, dt, n in live.alive([output, *params])]

    tail = LiveLocal()

    def tail_post(module, _args, output):
        tail.__exit__(None, None, None)
        params = [local_tensor(t) for m in (model.norm, model.lm_head) for t in m.parameters()]
        out["tail"] = [(op, str(dt).replace("torch.", ""), int(n)) for op, dt, n in tail.alive([output, *params])]

    handles = [block.register_forward_pre_hook(pre), block.register_forward_hook(post),
               model.norm.register_forward_pre_hook(lambda *_: (tail.__enter__(), None)[1]),
               model.lm_head.register_forward_hook(tail_post)]
    ctx = dist_utils.get_spmd_context(parallel_dims=dims)
    tokens = torch.randint(0, vocab, (b, s))
    with ctx():
        labels = tokens.clone()
        extra = {"positions": loader_positions(b, s)}  # as the Trainer passes them (kept_storages)
        if backend == "spmd_types":  # the Trainer's post_dataloading_process
            tokens, labels, extra = annotate_input_spmd_types(dims, tokens, labels, extra)
        logits = model(tokens, **extra)
        out["input_kept"] = not out.pop("x").expired()  # layer 0's input: the embedding's output, kept by no other op
        out["logits_local"] = tuple(local_tensor(logits).shape)
        loss_live = LiveLocal()
        with loss_live:
            loss = cross_entropy_loss(logits, labels, global_vocab_size=vocab)
        out["loss"] = [(op, str(dt).replace("torch.", ""), int(n)) for op, dt, n in loss_live.alive([loss])]
        del logits
        loss.backward()
    for h in handles:
        h.remove()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    out["params"] = storage_bytes([local_tensor(p) for p in model.parameters()])
    out["grads"] = storage_bytes([local_tensor(p.grad) for p in model.parameters()])
    out["adam"] = storage_bytes([local_tensor(st[k]) for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")])
    out["local_shapes"] = {n: tuple(local_tensor(p).shape) for n, p in model.named_parameters()}
    out["float8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    return out


def measure_tp(shape: Shape, layers: int, vocab: int, world: int = 2, s: int = 16, b: int = 2,
               ac: str = "none", tp: int = 0, float8: str | None = None) -> list[dict]:
    """``tp_rank`` on ``world`` spawned ranks over gloo (``tp``: the TP degree, default ``world``; ``float8``: the
    blocks' linears torchao's Float8Linear, torchtitan's converter applied before its sharding configs)."""
    from .ranks import run_ranks
    return run_ranks(tp_rank, world, (shape, layers, vocab, s, b, ac, tp, "partial_dtensor", float8))
