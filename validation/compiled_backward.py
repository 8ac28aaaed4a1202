"""What torchtitan's compiled block holds inside its backward: Inductor's generated backward, replayed symbolically
and measured on CPU.

torchtitan's apply_compile compiles each block (after its AC wrapper: validation/titan.py ``build_block``) with
``torch.compile``; AOTAutograd's partitioner splits the joint graph and Inductor generates the backward as a Python
wrapper (``call``) that allocates its buffers itself (``empty_strided_cpu``, ``reinterpret_tensor`` of a freed
buffer for reuse, ``del bufN``), runs its fused C++ kernels and extern GEMMs on them, and calls aten only for the
ops it does not lower (sdpa's backward, complex RoPE's multiply): a TorchDispatchMode sees none of the buffers.

``compile_block`` compiles the block with Inductor's own ``compile_fx`` (an ``inner_compile`` wrapper keeps the
backward's generated source and FX graph), dynamic in s and b, at the tiny widths of validation/compiled.py (h 48,
a 6, g 2, f 154, head 8).

``replay`` runs that generated ``call`` itself, its kernels no-ops, under FakeTensorMode with s and b symbolic (its
allocations then dispatch ``aten.empty_strided`` on fake tensors; storages followed by weakref until the wrapper
drops them): after every kernel, GEMM and fallback op it samples what is alive, the backward's inputs (the saved
tensors by their forward node names, the incoming gradient) and the buffers (each with its sympy size in bytes).
The fallback ops' own internal temporaries (sdpa's CPU backward's per-thread accumulators) are not seen there.

``measure`` runs the compiled block forward and backward on real CPU tensors under torch.profiler
(``profile_memory=True``): the bytes alive at the compiled backward node's peak that the block's forward and its
backward allocated (the block's input made inside the window, as a layer's input is the previous layer's output; the
incoming gradient made by the autograd node above the block; the loss's own scalars left out by address).

The CUDA backend (triton) fuses differently and its sdpa is FlexAttention's: neither is run here.
"""

from __future__ import annotations

import collections
import functools
import warnings
import weakref

import sympy
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .compiled import WIDTHS
from .titan import AC_MODES, Shape, build_block, loader_positions

SHAPE = Shape(h=WIDTHS["torchtitan"]["h"], a=WIDTHS["torchtitan"]["a"], g=WIDTHS["torchtitan"]["g"],
              f=WIDTHS["torchtitan"]["f"])
S_TRACE, B_TRACE = 24, 3  # the compile's hints (a dynamic kernel: later shapes reuse it)


def compile_block(ac: str, shape: Shape = SHAPE, block=None) -> dict:
    """The block compiled with Inductor (dynamic s, b), run once at S_TRACE, B_TRACE: ``compiled``, ``block`` and the
    backward's ``source`` (Inductor's generated wrapper module), ``graph`` (its FX GraphModule).  ``block``: another
    block already wrapped for ``ac`` (validation/compiled_moe_backward.py: the Qwen3 MoE and DeepSeek-V3 blocks),
    called the same way (x, None, positions); ``shape.h`` its width."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    if ac not in AC_MODES:
        raise ValueError(f"ac must be one of {AC_MODES}")
    warnings.filterwarnings("ignore")
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = (build_block(shape, ac) if block is None else block).train()
    out: dict = {"block": block}

    def inner(gm, example_inputs, **kw):
        compiled = compile_fx_inner(gm, example_inputs, **kw)
        if kw.get("is_backward"):
            out["source"], out["graph"] = compiled.source_code, gm
        return compiled

    out["compiled"] = torch.compile(block, backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=inner),
                                    dynamic=True)
    with _config(ac):
        x = torch.randn(B_TRACE, S_TRACE, shape.h, dtype=torch.bfloat16, requires_grad=True)
        out["compiled"](x, None, loader_positions(B_TRACE, S_TRACE)).float().sum().backward()
    if "source" not in out:
        raise RuntimeError("inductor compiled no backward")
    return out


def _config(ac: str):
    """No cached graph (a hit skips inner_compile); torchtitan's apply_compile setting for checkpointed blocks."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    stack.enter_context(torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=ac != "none"))
    stack.enter_context(torch._dynamo.config.patch(capture_scalar_outputs=True))  # the MoE's token dispatch
    return stack


# -- the symbolic replay of the generated backward --

class _Live(TorchDispatchMode):
    """Storages first seen as an op's output (or registered as an input), until the replay drops them."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[str, str, object]] = {}  # cdata -> (name, dtype, nbytes (SymInt or int))
        self.refs: dict[int, weakref.ref] = {}
        self.samples: list[tuple[str, tuple]] = []
        self.quiet = True  # while the inputs are made (add names them)

    def add(self, t: torch.Tensor, name: str) -> None:
        st = t.untyped_storage()
        if st._cdata in self.live:
            return
        self.live[st._cdata] = (name, str(t.dtype).removeprefix("torch."), st.nbytes())
        self.refs[st._cdata] = weakref.ref(st, functools.partial(self._free, st._cdata))

    def _free(self, cdata: int, _ref) -> None:
        self.live.pop(cdata, None)
        self.refs.pop(cdata, None)

    def sample(self, at: str) -> None:
        self.samples.append((at, tuple(self.live.values())))

    supports_higher_order_operators = True  # full AC's recomputed sdpa: run_with_rng_state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            if func.name() != "run_with_rng_state":
                raise NotImplementedError(f"the replay runs no {func.name()}")
            out, op = args[1](*args[2:], **(kwargs or {})), f"{args[1].overloadpacket}".replace("aten.", "")
        else:
            out = func(*args, **(kwargs or {}))
            if func.namespace == "prim" or self.quiet:
                return out
            op = str(func.overloadpacket).replace("aten.", "")
        for i, x in enumerate(pytree.tree_leaves(out)):
            if isinstance(x, torch.Tensor):
                self.add(x, f"buf:{op}" + (f"[{i}]" if i else ""))
        if op not in ("empty_strided", "as_strided"):
            self.sample(op)
        return out


class _Kernels:
    """extern_kernels and the fused kernels: no work, a sample each; an extern kernel that returns its output (no
    ``out=``: the MoE's ``_grouped_mm``) runs as its aten op on the fake tensors (its output then a buffer)."""

    def __init__(self, live: _Live) -> None:
        self.live = live

    def __getattr__(self, name: str):
        def run(*a, **k):
            if "out" in k or name.startswith("cpp_") or not hasattr(torch.ops.aten, name):
                return self.live.sample(name)
            return getattr(torch.ops.aten, name)(*a, **k)

        return run


def replay(source: str, graph, s_hint: int = 256, b_hint: int = 5) -> tuple[list, dict]:
    """Run the generated backward ``source`` under FakeTensorMode with s, b symbolic (module docstring): the samples
    [(after what, ((name, dtype, bytes as a sympy polynomial in s, b), ...))] and {input name: its role} (the saved
    tensors by their forward node names: "saved"; the incoming gradient: "tangent"; the dataloader's positions, which
    a checkpointed block takes for its RoPE gather: "batch"; "param" / "sym" the others).  Saved tensors that are views
    of one storage (Qwen3's cos and sin rows, two slices of one gather) are made as views of one storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .trace_poly import symbolic_sizes

    env, names, sizes = symbolic_sizes(s_hint, b_hint)
    to_ours = {}  # the compile's symbols (hints S_TRACE, B_TRACE) -> our SymInts
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        for v in [n.meta["val"]] if isinstance(n.meta["val"], torch.SymInt) else n.meta["val"].shape:
            if isinstance(v, torch.SymInt):
                for sym in v.node.expr.free_symbols:
                    hint = int(v.node.shape_env.var_to_val[sym])
                    # s, b; another symbol (the CPU generator state's size a checkpoint stashes) its value
                    ours = {S_TRACE: "s", B_TRACE: "b"}.get(hint)
                    to_ours[str(sym)] = sizes[ours] if ours else hint

    def size(d):
        return eval(str(d.node.expr), {}, to_ours) if isinstance(d, torch.SymInt) else d  # a product / sum of symbols

    namespace = {"__name__": "memplan_replay"}
    code = source.replace("async_compile = AsyncCompile()", "async_compile = None").replace(
        "async_compile.wait(globals())", "")
    live = _Live()
    kernels = _Kernels(live)
    # the kernels' definitions (async_compile.cpp_pybinding(...)) are dropped: each name a sampling no-op
    code = _drop_kernel_definitions(code)
    exec(compile(code, "<inductor backward>", "exec"), namespace)
    for name in list(namespace):
        if name.startswith(("cpp_fused", "cpp_")):
            namespace[name] = getattr(kernels, name)
    namespace.update(extern_kernels=kernels, assert_size_stride=lambda *a: None, assert_alignment=lambda *a: None,
                     empty_strided_cpu=lambda size_, stride, dtype: torch.empty_strided(size_, stride, dtype=dtype),
                     reinterpret_tensor=lambda t, size_, stride, offset: t.as_strided(size_, stride, offset))
    roles = {}
    with FakeTensorMode(shape_env=env, allow_non_fake_inputs=False), live, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args, bases = [], {}
        shared = collections.Counter(n.meta["val"].untyped_storage()._cdata for n in placeholders
                                     if isinstance(n.meta["val"], torch.Tensor))
        for n in placeholders:
            v = n.meta["val"]
            if isinstance(v, torch.SymInt):
                args.append(size(v))
                roles[n.name] = "sym"
                continue
            st = v.untyped_storage()
            if shared[st._cdata] > 1:  # saved views of one storage (the RoPE rows' cos and sin halves): one storage
                if st._cdata not in bases:
                    bases[st._cdata] = torch.empty(size(st.nbytes()) // v.element_size(), dtype=v.dtype)
                t = bases[st._cdata].as_strided([size(d) for d in v.shape], [size(d) for d in v.stride()],
                                                size(v.storage_offset()))
            else:
                t = torch.empty_strided([size(d) for d in v.shape], [size(d) for d in v.stride()], dtype=v.dtype)
            tokens = any(isinstance(d, torch.SymInt) for d in v.shape)
            # the dataloader's positions (an int64 s b input of the forward): a batch input the training loop holds, as
            # a parameter not counted; the MoE's int64 saves (top-k ids, sort and token indices) are saved tensors
            roles[n.name] = ("param" if not tokens else "batch" if v.dtype == torch.int64 and
                             n.name.startswith("primals") else
                             "tangent" if n.name.startswith("tangents") else "saved")
            live.add(t, n.name)
            args.append(t)
        params = [a for a, n in zip(args, placeholders) if roles[n.name] == "param"]  # the module holds them
        del t, v, bases
        call = namespace["Runner"](partitions=[]).call
        live.quiet = False
        outputs = call(args)
        del args, outputs, params
    samples = [(at, tuple((name, dtype, sympy.expand(_poly(nbytes, names))) for name, dtype, nbytes in items))
               for at, items in live.samples]
    return samples, roles


def _poly(nbytes, names: dict) -> sympy.Expr:
    if isinstance(nbytes, torch.SymInt):
        return nbytes.node.expr.xreplace(names)
    return sympy.Integer(nbytes)


def _drop_kernel_definitions(code: str) -> str:
    """The generated module without its C++ kernels' source (``name = async_compile.cpp_pybinding([...], r'''...''')``
    becomes ``name = None``): the replay runs no kernel."""
    out, skipping = [], False
    for line in code.split("\n"):
        if skipping:
            if line.startswith("''')"):
                skipping = False
            continue
        if "= async_compile." in line and line.split(" = ")[0].isidentifier():
            out.append(line.split(" = ")[0] + " = None")
            skipping = "r'''" in line and not line.rstrip().endswith("''')")
            continue
        out.append(line)
    return "\n".join(out)


# -- the real run --

def _events(prof) -> list[tuple[int, int, int, str, int]]:
    """(time, bytes (+ allocated, - freed), address, owner, end of the outermost enclosing aten op or -1) of the
    profile's allocations in time order; the owner is the innermost enclosing autograd node (``evaluate_function:
    ...``) or ``memplan:`` region.  The outermost op: sdpa's CPU backward allocates its own buffers inside nested aten
    ops and frees them before it returns (its scratch; seen at the Qwen3 block's peak, tests/test_compiled_qwen3.py);
    inside a validation custom op (``memplan_validation::``: DeepSeek-V3's ``flex_lse_backward``, FlexAttention's one
    backward kernel) that op, whatever it calls."""
    from torch._C._profiler import _EventType

    out, stack = [], [(node, node.name, -1) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, owner, op_end = stack.pop()
        outer = node.name.startswith(("aten::", "memplan_validation::")) and op_end == -1
        stack.extend((c, c.name if "evaluate_function" in c.name or c.name.startswith("memplan:") else owner,
                      node.end_time_ns if outer else op_end) for c in node.children)
        if node.typed[0] == _EventType.Allocation:
            out.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].ptr, owner, op_end))
    return sorted(out)


def measure(compiled, h: int, s: int, b: int, ac: str, seed: int = 0) -> dict:
    """Real tensors on CPU (module docstring): ``peak`` the bytes alive at the compiled backward's peak that the block
    made (its saved tensors still alive, the incoming gradient, Inductor's buffers, its weight gradients made),
    ``peak_scratch`` the same with the CPU kernels' own scratch (allocated and freed inside one aten op: oneDNN's bf16
    GEMMs, sdpa's CPU backward), ``saved`` what its forward left alive (the block's input and saves), ``incoming``
    the incoming gradient (bytes)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(seed)
    x0 = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    pos = loader_positions(b, s)  # a batch input the training loop holds: made before the window
    with _config(ac):
        compiled(x0.clone(), None, pos).float().sum().backward()  # warm (guards; the first call's allocations)
        compiled.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("memplan:block"):
                x = x0.clone()
                out = compiled(x, None, pos)
                del x
            with record_function("memplan:loss"):
                loss = out.float().sum()
                del out
            loss.backward()
            del loss
    events = _events(prof)
    made, scratch = {}, set()
    for i, (t, n, ptr, owner, op_end) in enumerate(events):  # scratch: freed before its op ends
        if n > 0:
            made[ptr] = (i, op_end)
        elif ptr in made:
            j, end = made.pop(ptr)
            if end >= t:
                scratch |= {i, j}
    out = {}
    for key, skip in (("peak", scratch), ("peak_scratch", set())):
        live, peak, made, saved, incoming, in_node = 0, 0, set(), 0, 0, False
        for i, (_, n, ptr, owner, _) in enumerate(events):
            if i in skip:
                continue
            if n > 0:
                if owner != "memplan:block" and not ("evaluate_function" in owner and "SumBackward" not in owner):
                    continue  # the loss's scalars and its seed: not the block's
                made.add(ptr)
            elif ptr not in made:
                continue
            else:
                made.discard(ptr)
            if "CompiledFunctionBackward" in owner and not in_node:
                in_node, saved = True, live - incoming
            if not in_node and "ToCopyBackward" in owner and n > 0:
                incoming += n
            live += n
            if in_node and "CompiledFunctionBackward" in owner:
                peak = max(peak, live)
        out |= {key: peak, "saved": saved, "incoming": incoming}
    return out


def front(samples: list, roles: dict) -> list[dict]:
    """The replay's non-dominated samples: bytes (the parameters and the positions left out, as ``measure`` leaves
    them out) ``a`` s b + ``d`` s + ``c`` (``d``: a tensor of s rows for all b, as the RoPE cache's rows copied whole
    when the block was called without positions) with no other sample at least as large in all three; each with
    ``at``, the saved inputs ``alive`` and the ``buffers`` (name, dtype, bytes)."""
    s, b = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)
    rows = []
    for at, items in samples:
        items = [i for i in items if roles.get(i[0]) not in ("param", "batch")]
        total = sympy.expand(sum(e for _, _, e in items))
        a, d = total.coeff(s * b), total.coeff(s).subs(b, 0)
        c = total.subs({s: 0, b: 0})
        if sympy.expand(total - a * s * b - d * s - c) != 0:
            raise ValueError(f"after {at}: {total} is not a s b + d s + c")
        rows.append({"at": at, "a": int(a), "d": int(d), "c": int(c),
                     "alive": sorted(n for n, _, _ in items if roles.get(n) in ("saved", "tangent")),
                     "buffers": [(n, dt, str(e)) for n, dt, e in items if n not in roles]})
    key = lambda r: (r["a"], r["d"], r["c"])  # noqa: E731
    return [r for r in rows if not any(key(o) != key(r) and all(x >= y for x, y in zip(key(o), key(r)))
                                       for o in rows)]


SIZES = ((32, 2), (64, 3))  # the measured shapes of tests/data/titan_compiled_backward.json
# the second widths: another FFN-to-hidden ratio, one KV head, a wider head (Llama 3's q = h holds in both)
SHAPES = (SHAPE, Shape(h=64, a=4, g=1, f=224))
# torchtitan's dense Qwen3 block (q_norm, k_norm, CosSinRoPE), its head width its own: q = a d differs from h in both
# (tests/data/titan_compiled_backward_qwen3.json, ``qwen3`` as the first word)
QWEN3_SHAPES = (Shape(h=40, a=6, g=2, f=154, qwen3=True, d=8), Shape(h=64, a=8, g=4, f=224, qwen3=True, d=12))


def record(path: str, shapes: tuple[Shape, ...] = SHAPES) -> None:
    """Every AC mode at ``shapes``: compile, measure at SIZES and replay; written as JSON
    (tests/data/titan_compiled_backward.json; QWEN3_SHAPES: titan_compiled_backward_qwen3.json)."""
    import json

    cases = []
    for shape in shapes:
        for ac in AC_MODES:
            c = compile_block(ac, shape)
            measured = [{"s": s, "b": b, **measure(c["compiled"], shape.h, s, b, ac)} for s, b in SIZES]
            samples, roles = replay(c["source"], c["graph"])
            rows = {(r["a"], r["d"], r["c"]): r for r in front(samples, roles)}  # one per distinct (a, d, c)
            qwen3 = dict(qwen3=True, d=shape.d) if shape.qwen3 else {}
            cases.append({"ac": ac, "widths": dict(h=shape.h, a=shape.a, g=shape.g, f=shape.f, **qwen3),
                          "measured": measured, "front": list(rows.values())})
            print(json.dumps(cases[-1], indent=1))
    kind = "qwen3 " if shapes == QWEN3_SHAPES else ""
    write_recording(path, f"validation.compiled_backward {kind}{path}", cases)


RERUN_KEYS = ("peak", "saved", "incoming")  # what a re-run compares (peak_scratch depends on the thread count)


def rerun(case: dict) -> tuple[list[dict], set]:
    """A recorded case (``record``'s JSON) compiled and measured again: per recorded shape its RERUN_KEYS, and the
    replayed front's (a, d, c) rows."""
    ac = case["ac"]
    c = compile_block(ac, Shape(**case["widths"]))
    measured = [{k: v for k, v in measure(c["compiled"], case["widths"]["h"], row["s"], row["b"], ac).items()
                 if k in RERUN_KEYS} for row in case["measured"]]
    samples, roles = replay(c["source"], c["graph"])
    return measured, {(r["a"], r["d"], r["c"]) for r in front(samples, roles)}


def write_recording(path: str, module_args: str, cases: list) -> None:
    """A recording as JSON: the command that re-makes it (``python -m MODULE_ARGS``), the versions, the cases."""
    import importlib.metadata
    import json

    doc = {"command": f"OMP_NUM_THREADS=1 PYTHONPATH=. python -m {module_args}",
           "measured_with": f"torchtitan {importlib.metadata.version('torchtitan')}, torch {torch.__version__} "
                            "(inductor on CPU, OMP_NUM_THREADS=1)", "cases": cases}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "qwen3":  # torchtitan's dense Qwen3 block
        record(sys.argv[2], QWEN3_SHAPES)
    else:
        record(sys.argv[1])
