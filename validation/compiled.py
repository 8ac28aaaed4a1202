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

Nothing here computes a byte count from a formula: the trace reads the graph, the measurement reads allocations.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .mcore_loss import allocation_peak

# the tiny layer: every width distinct, so a static size names one config field (q = a * head_dim differs from h)
WIDTHS = dict(h=60, f=154, a=6, g=2, d=8)


@dataclass(frozen=True)
class SavedTensor:
    node: str  # the forward graph's node name
    kind: str  # "input" (a graph input the layer was given: the layer input, the rotary tables), "parameter", "made"
    elements: str  # a polynomial in s, b and the config's widths ("s b h", "s b g q /a")
    dtype: str  # torch dtype name: bfloat16, float32


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

    w = WIDTHS
    return tf.LlamaConfig(hidden_size=w["h"], intermediate_size=w["f"], num_attention_heads=w["a"],
                          num_key_value_heads=w["g"], head_dim=w["d"], num_hidden_layers=1, vocab_size=64,
                          max_position_embeddings=4096, attn_implementation="sdpa")


def _names() -> dict[int, str]:
    w = WIDTHS
    return {w["h"]: "h", w["f"]: "f", w["a"]: "a", w["g"]: "g", w["d"]: "q /a", w["a"] * w["d"]: "q",
            w["g"] * w["d"]: "g q /a"}


def _dim(d, hints: dict[int, str]) -> str:
    """One size as symbols: a SymInt by its free symbols' hints (the trace's s and b differ), an int by the table."""
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        env = d.node.shape_env
        names = []
        for sym in sorted(expr.free_symbols, key=str):
            hint = int(env.var_to_val[sym])
            if hint not in hints:
                raise ValueError(f"size symbol {sym} = {hint} is neither s nor b")
            names.append(hints[hint])
        if expr != _product(expr.free_symbols):
            raise ValueError(f"size {expr} is not a product of s and b")
        return " ".join(names)
    if d == 1:
        return ""
    names = _names()
    if d not in names:
        raise ValueError(f"static size {d} is none of the config's widths {names}")
    return names[d]


def _product(symbols):
    out = 1
    for sym in symbols:
        out = out * sym
    return out


def _elements(shape, hints: dict[int, str]) -> str:
    parts = [p for p in (_dim(d, hints) for d in shape) if p]
    text = " ".join(parts) or "1"
    # "q /a" in the middle of a product reads the same anywhere: move the division last
    words = text.replace("/a", "").split()
    if "/a" in text and "a" in words:  # a heads of q /a: q
        words.remove("a")
        return " ".join(sorted(words, key=_order))
    return " ".join(sorted(words, key=_order)) + (" /a" if "/a" in text else "")


def _order(word: str) -> int:
    return ["s", "b", "a", "g", "h", "q", "f"].index(word)


def _base(node):
    """The node whose storage a saved view shares (views and aliases followed to the tensor they view)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False):
        node = node.args[0]
    return node


def _inputs(cfg, s: int, b: int, seed: int):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    torch.manual_seed(seed)
    x = torch.randn(b, s, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(s).unsqueeze(0))  # one row, as LlamaModel makes them
    return x, cos.to(torch.bfloat16), sin.to(torch.bfloat16)


def _after_forward(layer, x, cos, sin) -> tuple[int, int, torch.Tensor]:
    """Bytes the forward leaves alive: the layer's input is made inside the window (a clone of the leaf, as a
    layer's input is the previous layer's output), so it counts when the layer keeps it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = layer(x.clone(), position_embeddings=(cos, sin), attention_mask=None)
    return allocation_peak(prof, 0)[1], out.numel() * out.element_size(), out


def _aot_backend(inner):
    """AOTAutograd with inductor's partitioner and decompositions, the graphs run as traced (no code generated)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def fw(gm, example_inputs):
        inner(gm, example_inputs)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                        partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())


def trace_compiled_layer(route: str = "inductor", s_trace: int = 24, b_trace: int = 3, s: int = 20,
                         b: int = 2) -> CompiledLayer:
    """Compile one Llama decoder layer (sdpa, bf16, CPU), read what the partitioner saves, measure what it keeps.
    `route` "inductor": torch.compile's default backend (C++ kernels); "aot": AOTAutograd with inductor's partitioner
    and decompositions, its graphs run by torch (seconds, no C++ compile: tests/test_compile.py's fast check)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    warnings.filterwarnings("ignore")
    cfg = _config()
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16).train()
    graphs: list = []

    def inner(gm, example_inputs, **kw):
        if not kw.get("is_backward"):
            graphs.append((gm, list(example_inputs)))
        return compile_fx_inner(gm, example_inputs, **kw) if route == "inductor" else None

    backend = (lambda gm, ex: compile_fx(gm, ex, inner_compile=inner)) if route == "inductor" else _aot_backend(inner)
    compiled = torch.compile(layer, backend=backend, dynamic=True)
    x, cos, sin = _inputs(cfg, s_trace, b_trace, 1)
    # no cached graph: a cache hit would skip the partitioner and inner_compile
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled(x, position_embeddings=(cos, sin), attention_mask=None).sum().backward()
    if len(graphs) != 1:
        raise RuntimeError(f"expected one forward graph, inductor compiled {len(graphs)}")
    gm, _ = graphs[0]
    hints = {s_trace: "s", b_trace: "b"}
    param_shapes = {tuple(p.shape) for p in layer.parameters()}
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
        static = all(isinstance(d, int) for d in shape)
        kind = "parameter" if node.op == "placeholder" and static and shape in param_shapes else (
            "input" if node.op == "placeholder" else "made")
        saved.append(SavedTensor(node.name, kind, "" if kind == "parameter" else _elements(shape, hints),
                                 str(val.dtype).removeprefix("torch.")))
    # the measured run: the dynamic kernel again (no recompile), then the eager layer
    x, cos, sin = _inputs(cfg, s, b, 2)
    compiled(x, position_embeddings=(cos, sin), attention_mask=None)  # warm: guards, first-call allocations
    x, cos, sin = _inputs(cfg, s, b, 3)
    after, out_bytes, out = _after_forward(compiled, x, cos, sin)
    del out
    x, cos, sin = _inputs(cfg, s, b, 4)
    eager_after, _, out = _after_forward(layer, x, cos, sin)
    del out
    return CompiledLayer(tuple(saved), s, b, after, out_bytes, eager_after)


def main(argv: list[str]) -> None:
    r = trace_compiled_layer(argv[0] if argv else "inductor")
    for t in r.saved:
        print(f"{t.node:12} {t.kind:10} {t.dtype:9} {t.elements}")
    print(f"s={r.s} b={r.b}: after forward {r.after_forward} B (output {r.output_bytes} B), eager {r.eager_after_forward} B")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
