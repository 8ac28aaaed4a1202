"""What torch.compile keeps for the backward of one transformers Llama decoder layer (attn_implementation "sdpa").

``trace_compiled_layer`` compiles one ``LlamaDecoderLayer`` (bf16, on CPU) with a backend that is inductor's own
``compile_fx`` with an ``inner_compile`` wrapper: AOTAutograd traces the joint graph, inductor's partitioner
(``min_cut_rematerialization_partition``, torch._functorch.partitioners) splits it, and the wrapper reads the
forward graph's outputs before handing the graph on to inductor's ``compile_fx_inner`` (so the code that runs is
inductor's C++ for CPU). The forward graph returns the layer's output, then the tensors saved for the backward,
then the SymInts the backward needs. s and b are symbolic (``dynamic=True``): each saved tensor's shape is read as
symbols (s, b from the ShapeEnv's hints, the sizes fixed by the config by a table of the config's widths), so the
result is a polynomial in s, b per tensor with the model's widths named (h, f, a, g, q; the head width is q /a).

The same compiled layer is then run on real tensors (with distinct s, b from the trace's so the dynamic kernel is
reused, not recompiled) and the bytes it keeps are measured: torch.profiler's allocation events
(``profile_memory=True``, validation/mcore_loss.py: inductor allocates inside its generated code, which a
TorchDispatchMode does not see) give the bytes alive after the forward that the forward allocated; the layer's input
and the rotary tables exist before and are not counted there. The eager layer is measured the same way for
comparison.

``ac="selective-op"`` (torchtitan): the block is first wrapped in torchtitan's SelectiveAC (validation/titan.py
``build_block``: ``create_selective_checkpoint_contexts`` with its save list and every-other-matmul policy, the CPU
attention kernel added for FlexAttention), then compiled, as torchtitan's parallelize_llama applies AC before
apply_compile: dynamo traces the checkpoint as a tagged region and the partitioner follows the policy's MUST_SAVE /
PREFER_RECOMPUTE tags. The eager figure is then eager SelectiveAC's (with the CPU generator state each checkpoint
stashes).

torchtitan's blocks are called as its Trainer calls them, with the dataloader's positions (validation/titan.py
``loader_positions``; ``positions=False`` leaves them out): their RoPE then gathers its cache rows at them, and a
saved [b, s, 1, w] tensor (``_rope_rows``) is those rows, named against the head width (a complex64 one as its fp32
pairs). The positions are a batch input made before the measured window; a checkpointed block saves them (a graph
input, int64 s b).

Nothing here computes a byte count from a formula: the trace reads the graph, the measurement reads allocations.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from .mcore_loss import allocation_peak

# the tiny layers: every width distinct, so a static size names one config field (transformers: q = a * head_dim
# differs from h; torchtune's heads are h / a wide, so there q = h, named h)
WIDTHS = {"hf-sdpa": dict(h=60, f=154, a=6, g=2, d=8), "torchtune": dict(h=48, f=154, a=6, g=2, d=8),
          "torchtitan": dict(h=48, f=154, a=6, g=2, d=8),
          "torchtitan-qwen3": dict(h=40, f=154, a=6, g=2, d=8),  # its dense Qwen3 block: q = a d = 48, not h
          # with torchao's float8 linears (float8=...): f a multiple of 16, so that torchtitan converts every linear
          "torchtitan-float8": dict(h=48, f=160, a=6, g=2, d=8)}


@dataclass(frozen=True)
class SavedTensor:
    node: str  # the forward graph's node name
    kind: str  # "input" (a graph input the layer was given: the layer input, the rotary tables), "parameter", "made",
    # "constant" (made from parameters alone, no s or b: QLoRA's dequantised weights; elements its value count)
    elements: str  # a polynomial in s, b and the config's widths ("s b h", "s b g q /a"); complex64: its fp32 pairs
    dtype: str  # torch dtype name: bfloat16, float32, complex64


@dataclass(frozen=True)
class CompiledLayer:
    saved: tuple[SavedTensor, ...]
    s: int  # the measured run's sequence length and micro-batch
    b: int
    after_forward: int  # bytes the forward allocated that are alive after it (the output and the saved tensors)
    output_bytes: int
    eager_after_forward: int  # the same for the eager layer (torch.autograd's own saves)


def _config():
    import transformers as tf

    w = WIDTHS["hf-sdpa"]
    return tf.LlamaConfig(hidden_size=w["h"], intermediate_size=w["f"], num_attention_heads=w["a"],
                          num_key_value_heads=w["g"], head_dim=w["d"], num_hidden_layers=1, vocab_size=64,
                          max_position_embeddings=4096, attn_implementation="sdpa")


def _names(w: dict[str, int]) -> dict[int, dict[str, int]]:
    """Each static width as exponents of memplan's symbols (the head width is q /a, torchtune's K / V expansion a /g);
    where q = h (torchtune) the width is named h; torchtitan's fused QKV output (a + 2 g) d is the pseudo-symbol
    "qkv" (``_elements`` writes it as the sum q + 2 g q /a)."""
    return {w["a"] * w["d"]: {"q": 1}, w["h"]: {"h": 1}, w["f"]: {"f": 1}, w["a"]: {"a": 1}, w["g"]: {"g": 1},
            w["d"]: {"q": 1, "a": -1}, w["g"] * w["d"]: {"g": 1, "q": 1, "a": -1}, w["a"] // w["g"]: {"a": 1, "g": -1},
            (w["a"] + 2 * w["g"]) * w["d"]: {"qkv": 1}}


def _dim(d, hints: dict[int, str], names: dict[int, dict[str, int]], static: bool) -> dict[str, int]:
    """One size as exponents: a SymInt by its free symbols' hints (the trace's s and b differ), an int by the table."""
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        env = d.node.shape_env
        out: dict[str, int] = {}
        for sym in expr.free_symbols:
            hint = int(env.var_to_val[sym])
            if hint not in hints:
                raise ValueError(f"size symbol {sym} = {hint} is neither s nor b")
            out[hints[hint]] = 1
        coeff = expr / _product(expr.free_symbols)
        if not coeff.is_Integer:
            raise ValueError(f"size {expr} is not a width times a product of s and b")
        if int(coeff) != 1:  # a width times s b (the MoE's routed copies: k s b rows)
            if int(coeff) not in names:
                raise ValueError(f"size {expr}: {coeff} is none of the config's widths {names}")
            for k, e in names[int(coeff)].items():
                out[k] = out.get(k, 0) + e
        return out
    if d == 1:
        return {}
    if static and d in hints:  # static shapes: s, b and s b are sizes distinct from every width
        return {k: 1 for k in hints[d].split()}
    if d not in names:
        raise ValueError(f"static size {d} is none of the config's widths {names}")
    return names[d]


def _tokens(d, hints: dict[int, str]) -> bool:
    """Whether a size holds s or b (a SymInt one of whose symbols has the trace's s or b as its hint)."""
    return isinstance(d, torch.SymInt) and any(int(d.node.shape_env.var_to_val[sym]) in hints
                                               for sym in d.node.expr.free_symbols)


def _product(symbols):
    out = 1
    for sym in symbols:
        out = out * sym
    return out


# DeepSeek-V3's MLA widths (validation/compiled_dsv3.py) after Llama's: r_q, r_kv, d_n, d_r, d_v, d_r / 2, d_n + d_r,
# d_n + d_v, r_kv + d_r, the shared experts' f_s, the router's expert groups G and limited groups lim
ORDER = ("s", "b", "k", "E", "a", "g", "h", "q", "f", "fe", "r", "rq", "rkv", "dn", "dr", "dv", "dr2", "dqk", "dkv",
         "rkvr", "fs", "G", "lim")


def _elements(shape, hints: dict[int, str], names: dict[int, dict[str, int]], static: bool) -> str:
    """The shape's element count as memplan writes a product: "s b g q /a" (with the fused QKV width, the sum
    "s b q + 2 s b g q /a")."""
    power = {k: 0 for k in ORDER}
    qkv = 0
    for d in shape:
        for k, e in _dim(d, hints, names, static).items():
            if k == "qkv":
                qkv += e
            else:
                power[k] += e
    if qkv:
        if qkv != 1:
            raise ValueError(f"shape {shape} has the fused QKV width {qkv} times")
        q = _monomial({**power, "q": power["q"] + 1})
        return f"{q} + 2 {_monomial({**power, 'q': power['q'] + 1, 'g': power['g'] + 1, 'a': power['a'] - 1})}"
    return _monomial(power)


def _monomial(power: dict[str, int]) -> str:
    up = [k if e == 1 else f"{k}^{e}" for k, e in power.items() if e > 0]
    down = [f"/{k}" if e == -1 else f"/{k}^{-e}" for k, e in power.items() if e < 0]
    return " ".join(up + down) or "1"


def _rope_rows(shape, names: dict[int, dict[str, int]]) -> str | None:
    """A saved [b, s, 1, w] tensor is RoPE's cache rows gathered at the positions (broadcast over the heads: no other
    saved tensor has a 1 there): its width named against the head width d (ComplexRoPE's fp32 pairs d, CosSinRoPE's
    cos and sin 2d), which a width table alone cannot tell from g d where g = 2."""
    if len(shape) != 4 or shape[2] != 1 or isinstance(shape[3], torch.SymInt):
        return None
    d = next(w for w, e in names.items() if e == {"q": 1, "a": -1})
    if shape[3] % d:
        raise ValueError(f"RoPE rows {shape}: width {shape[3]} is not a multiple of the head width {d}")
    return f"{shape[3] // d} s b q /a".removeprefix("1 ")


def _base(node):
    """The node whose storage a saved view shares (views and aliases followed to the tensor they view)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False):
        node = node.args[0]
    return node


def _hf_layer():
    """transformers' LlamaDecoderLayer and its inputs: the hidden states and the rotary cos / sin (one row)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = _config()
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16).train()

    def inputs(s: int, b: int, seed: int):
        torch.manual_seed(seed)
        x = torch.randn(b, s, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(s).unsqueeze(0))  # one row, as LlamaModel makes them
        rope = (cos.to(torch.bfloat16), sin.to(torch.bfloat16))
        return x, lambda layer, x: layer(x, position_embeddings=rope, attention_mask=None)

    return layer, inputs


def _tune_layer(lora: dict | None = None, w: dict | None = None):
    """torchtune 0.6.1's TransformerSelfAttentionLayer (llama3_2 builder, bf16) and its input (RoPE from its cache);
    ``lora``: dict(rank, targets (memplan's names), dropout, qlora): its lora_llama3_2 layer, only the adapters
    trainable (validation/torchtune.py ``_build``)."""
    from .torchtune import _build

    w = w or WIDTHS["torchtune"]
    torch.manual_seed(0)
    model = _build(64, 1, w["a"], w["g"], w["h"], w["f"], False, lora)
    layer = model.layers[0].train()

    def inputs(s: int, b: int, seed: int):
        torch.manual_seed(seed)
        return torch.randn(b, s, w["h"], dtype=torch.bfloat16, requires_grad=True), lambda layer, x: layer(x)

    return layer, inputs


def _titan_layer(float8: str | None = None, ac: str = "none", positions: bool = True, qwen3: bool = False):
    """torchtitan 0.3.0's Llama 3 block (validation/titan.py: its config code, bf16, sdpa standing in for
    FlexAttention), called as its decoder calls a layer (RoPE from its cache buffer, no mask; ``positions``: the
    dataloader's, as its Trainer always passes them, else none); ``float8``:
    its linears torchao's Float8Linear (validation/titan.py build_block); ``ac``: wrapped first in torchtitan's AC
    (build_block: "selective-op" its SelectiveAC, the save list and every-other-matmul policy), then compiled, as
    torchtitan's parallelize_llama applies AC before apply_compile; ``qwen3``: its dense Qwen3 block."""
    from .titan import Shape, build_block, loader_positions

    w = WIDTHS["torchtitan-float8" if float8 else "torchtitan-qwen3" if qwen3 else "torchtitan"]
    torch.manual_seed(0)
    layer = build_block(Shape(w["h"], w["a"], w["g"], w["f"], qwen3, w["d"] * qwen3), ac, float8=float8).train()

    def inputs(s: int, b: int, seed: int):
        torch.manual_seed(seed)
        pos = loader_positions(b, s) if positions else None  # a batch input, made before the measured window
        return (torch.randn(b, s, w["h"], dtype=torch.bfloat16, requires_grad=True),
                lambda layer, x: layer(x, None, pos))

    return layer, inputs


def _after_forward(layer, x, call) -> tuple[int, int, torch.Tensor]:
    """Bytes the forward leaves alive: the layer's input is made inside the window (a clone of the leaf, as a
    layer's input is the previous layer's output), so it counts when the layer keeps it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = call(layer, x.clone())
    return allocation_peak(prof, 0)[1], out.numel() * out.element_size(), out


def _aot_backend(inner, bw_inner=None):
    """AOTAutograd with inductor's partitioner and decompositions, the graphs run as traced (no code generated);
    ``inner`` sees the forward graph, ``bw_inner`` the backward's."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def fw(gm, example_inputs):
        inner(gm, example_inputs)
        return make_boxed_func(gm.forward)

    def bw(gm, example_inputs):
        if bw_inner is not None:
            bw_inner(gm, example_inputs)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw, bw_compiler=bw,
                        partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table(),
                        keep_inference_input_mutations=True)  # buffers updated in the graph, as inductor's


def trace_compiled_layer(route: str = "inductor", impl: str = "hf-sdpa", s_trace: int = 24, b_trace: int = 3,
                         s: int = 20, b: int = 2, dynamic: bool = True, float8: str | None = None,
                         lora: dict | None = None, widths: dict | None = None, ac: str = "none",
                         built=None, positions: bool = True, qwen3: bool = False) -> CompiledLayer:
    """Compile one Llama decoder layer (bf16, CPU; `impl` hf-sdpa: transformers', torchtune: torchtune's), read what
    the partitioner saves, measure what it keeps. `dynamic` False: static shapes (a fifth of the CPU time), traced and
    measured at s_trace, b_trace (sizes none of the widths: s, b and s b are read off their values).
    `lora`: torchtune's LoRA layer (validation/torchtune.py ``_build``); `widths`: the layer's h, f, a, g, d (default
    WIDTHS[impl]; torchao's NF4 needs weights of 16,384-value multiples).
    `route` "inductor": torch.compile's default backend (C++ kernels); "aot": AOTAutograd with inductor's partitioner
    and decompositions, its graphs run by torch (seconds, no C++ compile: tests/test_compile.py's fast check).
    ``float8`` (tensorwise, rowwise): torchtitan's block with torchao's float8 linears (widths "torchtitan-float8").
    ``built``: (layer, inputs, names) of another block (validation/compiled_moe.py: torchtitan's Qwen3 MoE block; its
    sizes named by ``names``, which may name a width that multiplies s b), ``ac`` already applied to it.
    ``positions`` (torchtitan): the block called with the dataloader's positions; ``qwen3``: its dense Qwen3 block."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    warnings.filterwarnings("ignore")
    if float8 and impl != "torchtitan":
        raise ValueError("float8 is torchtitan's (impl torchtitan)")
    if lora is not None and impl != "torchtune":
        raise ValueError("lora: torchtune's LoRALinear layer only")
    widths = widths or WIDTHS[f"{impl}-float8" if float8 else f"{impl}-qwen3" if qwen3 else impl]
    if ac != "none" and impl != "torchtitan":
        raise ValueError("ac is torchtitan's (impl torchtitan)")
    layer, inputs, names = built if built else (None, None, _names(widths))
    layer, inputs = (layer, inputs) if built else (_titan_layer(float8, ac, positions, qwen3) if impl == "torchtitan" else
                                                   _tune_layer(lora, widths) if lora else
                                                   {"hf-sdpa": _hf_layer, "torchtune": _tune_layer}[impl]())
    graphs: list = []

    def inner(gm, example_inputs, **kw):
        if not kw.get("is_backward"):
            graphs.append((gm, list(example_inputs)))
        return compile_fx_inner(gm, example_inputs, **kw) if route == "inductor" else None

    backend = (lambda gm, ex: compile_fx(gm, ex, inner_compile=inner)) if route == "inductor" else _aot_backend(inner)
    compiled = torch.compile(layer, backend=backend, dynamic=dynamic)
    if not dynamic:
        s, b = s_trace, b_trace
    x, call = inputs(s_trace, b_trace, 1)
    # no cached graph: a cache hit would skip the partitioner and inner_compile
    # torchtitan's apply_compile sets skip_fwd_side_effects_in_bwd_under_checkpoint (its blocks are checkpointed)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=ac != "none"):
        call(compiled, x).sum().backward()
    if len(graphs) != 1:
        raise RuntimeError(f"expected one forward graph, inductor compiled {len(graphs)}")
    gm, _ = graphs[0]
    hints = {s_trace: "s", b_trace: "b"}
    if lora:
        if lora["rank"] in names:
            raise ValueError(f"LoRA rank {lora['rank']} must differ from the widths {names}")
        names[lora["rank"]] = {"r": 1}
    if not dynamic:
        hints[s_trace * b_trace] = "s b"
        if set(hints) & set(names) or len(hints) < 3:
            raise ValueError(f"static s {s_trace}, b {b_trace}: their sizes must differ from the widths {names}")
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    saved, seen = [], set()
    for node in outputs[1:]:  # the layer's one output first
        node = _base(node)
        if node in seen:
            continue  # a view of a storage already listed
        seen.add(node)
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # SymInts for the backward
        shape = tuple(val.shape)
        if val.dtype == torch.complex64:  # torchtitan's ComplexRoPE rows: counted as their fp32 pairs
            shape = shape[:-1] + (shape[-1] * 2,)
        rope = _rope_rows(shape, names) if node.op != "placeholder" else None
        # a graph input with no s or b in its shape is a parameter or a buffer (torchtune's RoPE cache)
        tokens = any(_tokens(d, hints) or (not dynamic and d in hints) for d in shape)
        kind = ("input" if tokens else "parameter") if node.op == "placeholder" else ("made" if tokens else "constant")
        # a constant's size may be symbolic without s or b (the CPU generator state full AC stashes): its hint
        elements = ("" if kind == "parameter" else str(optimization_hint(val.numel())) if kind == "constant"
                    else rope or _elements(shape, hints, names, not dynamic))
        saved.append(SavedTensor(node.name, kind, elements, str(val.dtype).removeprefix("torch.")))
    # the measured run: the dynamic kernel again (no recompile), then the eager layer
    x, call = inputs(s, b, 2)
    call(compiled, x)  # warm: guards, first-call allocations
    after, out_bytes, out = _after_forward(compiled, *inputs(s, b, 3))
    del out
    eager_after, _, out = _after_forward(layer, *inputs(s, b, 4))
    del out
    return CompiledLayer(tuple(saved), s, b, after, out_bytes, eager_after)


def titan_saved_rope_rows(qwen3: bool, positions: bool, s: int = 24, b: int = 3) -> list[tuple[str, str, int]]:
    """torchtitan's block (validation/titan.py ``build_block``, AC none; ``qwen3``: its Qwen3 block) compiled with
    AOTAutograd and inductor's partitioner (``_aot_backend``, static shapes), called with the dataloader's positions as
    its Trainer calls it or without: the forward graph's saved tensors that are not graph inputs and have a complex or
    fp32 [b, s, 1, width] shape, i.e. the RoPE rows (dtype, bytes; each a view of one gathered storage)."""
    from .titan import Shape, build_block, loader_positions

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = build_block(Shape(qwen3=qwen3), "none").train()
    graphs: list = []
    compiled = torch.compile(block, backend=_aot_backend(lambda gm, _: graphs.append(gm)), dynamic=False)
    x = torch.randn(b, s, block.attention_norm.normalized_shape[0], dtype=torch.bfloat16, requires_grad=True)
    compiled(x * 1, None, loader_positions(b, s) if positions else None)
    out = next(n for n in graphs[0].graph.nodes if n.op == "output").args[0]
    rows = []
    for node in out[1:]:
        t = getattr(node, "meta", {}).get("val")
        if (isinstance(t, torch.Tensor) and node.op != "placeholder" and t.dim() == 4 and tuple(t.shape[:3]) == (b, s, 1)
                and t.dtype in (torch.complex64, torch.float32)):
            rows.append((node.name, str(t.dtype).replace("torch.", ""), t.numel() * t.element_size()))
    return rows


def _allocations_by_owner(prof) -> list[tuple[int, str]]:
    """(bytes, owner) of every allocation (+) and free (-) in the profile, in time order; the owner is the innermost
    enclosing ``record_function`` region named "memplan:..." or autograd node (``evaluate_function: XBackward0``)."""
    from torch._C._profiler import _EventType

    out, stack = [], [(node, node.name) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, owner = stack.pop()
        stack.extend((c, c.name if "evaluate_function" in c.name or c.name.startswith("memplan:") else owner)
                     for c in node.children)
        if node.typed[0] == _EventType.Allocation:
            out.append((node.start_time_ns, node.typed[1].alloc_size, owner))
    return [(n, owner) for _, n, owner in sorted(out, key=lambda x: x[0])]


def measure_compiled_tune_loss(s: int, b: int, vocab: int, layers: int, heads: int, kv_heads: int, hidden: int,
                               ffn: int, chunks: int, route: str = "inductor") -> dict[str, int]:
    """torchtune's CEWithChunkedOutputLoss compiled as its recipes' ``compile: True`` compiles it
    (training.compile_loss: ``loss.compute_cross_entropy = torch.compile(loss.compute_cross_entropy)``, inductor;
    torchtune.training does not import with torchao 0.18, so that one line is written here) on the real bf16 chunks
    of torchtune's Llama (``set_num_output_chunks``), as ``_loss_step`` calls it (shifted labels, ``del logits``).
    Inductor's kernels allocate outside the dispatcher: the bytes are read off torch.profiler's allocation events
    over the whole step (the CPU allocator reports the size of a free only for blocks made while it profiles), after
    one warm step (the compilation). Every figure counts from what the model holds when it returns, less its logits;
    in bytes: ``logits`` (the model's N bf16 chunks), ``saved`` (the distinct storages the loss saves for its
    backward, by a saved-tensors hook), ``loss_forward`` (the peak from the model's output to ``_loss_step``'s
    return, the logits included), ``after_forward`` (alive when it has returned) and ``loss_backward`` (the peak of
    the backward before the output projection's first ``MmBackward0``). `route` "aot": AOTAutograd with inductor's
    partitioner, its graphs run by torch (seconds, no C++): the same saved tensors, not inductor's fused peaks."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from .instruments import saved_storages
    from .torchtune import _build, _plain_tensors, import_torchtune

    warnings.filterwarnings("ignore")
    import_torchtune()
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    torch.manual_seed(0)
    model = _build(vocab, layers, heads, kv_heads, hidden, ffn, False)
    loss_fn = CEWithChunkedOutputLoss(chunks)
    backend = "inductor" if route == "inductor" else _aot_backend(lambda gm, example_inputs: None)
    loss_fn.compute_cross_entropy = torch.compile(loss_fn.compute_cross_entropy, backend=backend)
    model.set_num_output_chunks(chunks)
    result: dict[str, int] = {}
    for _ in range(2):  # the first step compiles (and keeps what compiling allocated)
        saved, pack = saved_storages([*_plain_tensors(model), *model.parameters()])
        batch_labels = torch.randint(0, vocab, (b, s))
        tokens = torch.randint(0, vocab, (b, s))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("memplan:model"):
                logits = model(tokens)
            start = sum(c.untyped_storage().nbytes() for c in logits)
            with record_function("memplan:loss"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                labels = torch.hstack((batch_labels[..., 1:], torch.full((b, 1), -100, dtype=torch.long)))
                loss = loss_fn(logits, labels)
                del logits, labels
            loss.backward()
            del loss
        live, peaks, phase = 0, {"memplan:loss": 0, "backward": 0}, "memplan:model"
        for n, owner in _allocations_by_owner(prof):
            if phase == "memplan:model" and owner == "memplan:loss":
                phase, base = owner, live - start
            elif phase == "memplan:loss" and owner != phase:
                phase, after = "backward", live
            if phase == "backward" and "MmBackward0" in owner:
                break
            live += n
            if phase != "memplan:model":
                peaks[phase] = max(peaks[phase], live)
        model.zero_grad(set_to_none=True)
        result = {"logits": start, "saved": sum(saved.values()), "loss_forward": peaks["memplan:loss"] - base,
                  "after_forward": after - base, "loss_backward": peaks["backward"] - base}
    return result


LOSS_CASES = ((4, 64, 2), (2, 64, 2), (8, 64, 1))  # (chunks, s, b) of tests/data/torchtune_compiled_loss.json
LOSS_DIMS = dict(vocab=64, layers=2, heads=4, kv_heads=2, hidden=32, ffn=48)  # tests/test_torchtune.py's model


def _write_loss(path: str) -> None:
    """Measure LOSS_CASES with inductor and write them as JSON (tests/data/torchtune_compiled_loss.json)."""
    import importlib.metadata
    import json

    cases = [{"chunks": n, "s": s, "b": b, **LOSS_DIMS, **measure_compiled_tune_loss(s, b, chunks=n, **LOSS_DIMS)}
             for n, s, b in LOSS_CASES]
    doc = {"command": f"PYTHONPATH=. python -m validation.compiled loss {path}",
           "measured_with": f"torchtune {importlib.metadata.version('torchtune')}, torch {torch.__version__} "
                            "(inductor on CPU)", "cases": cases}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    print(json.dumps(cases, indent=1))


def main(argv: list[str]) -> None:
    if argv[:1] == ["loss"]:  # torchtune's compiled chunked loss: loss PATH (writes the test fixture)
        _write_loss(argv[1])
        return
    # torchtitan: a third word "selective-op" (its SelectiveAC block compiled, dynamic) or a float8 recipe (static
    # shapes, s 28, b 5)
    ac = "selective-op" if argv[2:] == ["selective-op"] else "none"
    float8 = argv[2] if argv[2:] and ac == "none" else None
    r = trace_compiled_layer(argv[0] if argv else "inductor", argv[1] if argv[1:] else "hf-sdpa", ac=ac,
                             **(dict(s_trace=28, b_trace=5, dynamic=False, float8=float8) if float8 else {}))
    for t in r.saved:
        print(f"{t.node:12} {t.kind:10} {t.dtype:9} {t.elements}")
    print(f"s={r.s} b={r.b}: after forward {r.after_forward} B (output {r.output_bytes} B), eager {r.eager_after_forward} B")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
