"""One symbolic run of a model (``symbolic_run``, ``symbolic_saves``): forward + loss (and, for a step, the backward
with every live storage followed, validation/transients.py) under FakeTensorMode with s and b symbols of a ShapeEnv,
the saved storages' sizes as polynomials in s and b, the conditions the run holds under; refused (``TraceRefused``)
when it is not valid for every s and b (validation/trace.py's docstring)."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable

import sympy
import torch

from . import layer_order as order_
from .trace_config import KERNELS
from .trace_cuda import SDPA_ORDER, CudaKernels
from .trace_poly import TraceRefused, as_poly_expr, check_guards, exact_divisions, merge_divisibility
from .trace_saves import Saves, eager_decisions, with_python_dispatcher




def symbolic_saves(build: Callable[[], torch.nn.Module], forward: Callable[..., torch.Tensor],
                   make_inputs: Callable[[Any, Any], tuple], s_hint: int = 4096, b_hint: int = 2,
                   python_dispatcher: bool = True, kernels: str = "cpu"
                   ) -> tuple[torch.nn.Module, list[dict], list[str]]:
    """Run ``forward(model, *make_inputs(s, b))`` once under FakeTensorMode with s and b symbolic.

    ``build()`` makes the module inside the fake mode (its parameters fake, concrete shapes);
    ``make_inputs(s, b)`` gets SymInts.  Returns the model, the saved storages (``Saves.storages``
    with ``nbytes`` a sympy polynomial in the symbols ``s`` and ``b``) and the conditions the trace
    holds under (ranges of s and b, range guards, divisibility assumed).  Raises ``TraceRefused``
    when the ShapeEnv specialised s or b or a size is not a polynomial in them.
    """
    run = symbolic_run(build, forward, make_inputs, s_hint, b_hint, python_dispatcher, kernels)
    return run["model"], run["storages"], run["conditions"]


def symbolic_run(build: Callable[[], torch.nn.Module], forward: Callable[..., torch.Tensor],
                 make_inputs: Callable[[Any, Any], tuple], s_hint: int = 4096, b_hint: int = 2,
                 python_dispatcher: bool = True, kernels: str = "cpu", step: dict | None = None,
                 shapes: dict | None = None, sdpa: tuple[str, ...] = SDPA_ORDER, s_multiple: int = 1) -> dict:
    """``symbolic_saves``' run, as a dict (model, storages, conditions); with ``step`` (``layers``:
    model -> (decoder layers' module path, their number), ``checkpoint``: gradient checkpointing on)
    also the backward (``loss.backward()`` under the same fake mode, so the gradients are symbolic
    too) with every live storage followed (validation/transients.py): ``sampler`` (the candidate
    moments per layer and of the head), ``kept`` (checkpointing: the tensors every checkpointed
    layer is given, alive when the backward starts, and a layer's input), ``args`` (decoder layers'
    input tensors by (argument, first layer): the records, to match the two runs).  ``shapes``: a dict the
    runs of one trace share, which keeps the first run's ShapeEnv, symbols s, b and their SymInts, so a
    later run finds the first one's fake-tensor dispatch cache (it lives on the ShapeEnv) and its guards
    (decided the same way again); the conditions and sizes come out as with a ShapeEnv of its own. It keeps the
    fake mode and the model too: a later run takes the first one's model (``build`` is called once) without its
    gradients (kept in ``shapes``: freeing them would log frees into the first run's allocation order). ``sdpa``: the CUDA sdpa kernels tried, in order (``kernels="cuda"``; ``CudaKernels``).
    ``s_multiple`` m > 1: s is m times a symbol of the ShapeEnv (s a multiple of m, the condition ``s % m == 0``), so a
    scan that pads s to chunks of m (Mamba-2's torch path: ``chunk_size``) leaves no symbolic remainder to guard on;
    the sizes come out in s all the same."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    if s_multiple > 1 and (s_hint % s_multiple or s_hint // s_multiple in (1, b_hint)):
        raise ValueError("s_hint must be a multiple of s_multiple, at least twice it, its quotient not b_hint")
    if s_hint < 2 or b_hint < 2 or s_hint == b_hint:
        raise ValueError("need distinct hints s_hint, b_hint >= 2 (torch specialises sizes 0 and 1)")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}")
    if kernels == "cuda" and not python_dispatcher:
        raise ValueError("the CUDA kernels are emulated through the python dispatcher")
    shapes = {} if shapes is None else shapes
    if "env" not in shapes:
        env = ShapeEnv(duck_shape=False)
        symbols = {}
        sizes = {}
        for name, hint in (("s", s_hint // s_multiple), ("b", b_hint)):
            sym = env.create_symbol(hint, source=ConstantSource(f"memplan_{name}"), dynamic_dim=DimDynamic.DYNAMIC)
            symbols[sym] = name
            sizes[name] = env.create_symintnode(sym, hint=hint)
        sizes["s"] = sizes["s"] * s_multiple  # s = m c: the symbol is c, the sizes are read back in s (named)
        shapes.update(env=env, symbols=symbols, sizes=sizes, hints=(s_hint, b_hint, s_multiple))
    elif shapes["hints"] != (s_hint, b_hint, s_multiple):
        raise ValueError("a shared ShapeEnv needs the same hints")
    env, symbols, sizes = shapes["env"], shapes["symbols"], shapes["sizes"]
    scale = {"s": s_multiple, "b": 1}
    named = {sym: sympy.Symbol(name, integer=True, positive=True) / scale[name] for sym, name in symbols.items()}
    cuda = CudaKernels(named, sdpa) if kernels == "cuda" else None
    run: dict = {}
    polys_conditions: list[str] = []
    if "mode" not in shapes:
        shapes["mode"] = FakeTensorMode(shape_env=env, allow_non_fake_inputs=False)
    with shapes["mode"]:
        model = shapes.get("model")
        if model is None:
            model = shapes["model"] = build()
        else:  # the first run's model, its gradients set aside (kept alive, as a first model's are): as a fresh one
            for p in model.parameters():
                shapes.setdefault("grads", []).append(p.grad)
                p.grad = None
        saves = Saves(model)
        tracking = _tracking(model, saves, named, step, polys_conditions, run) if step else contextlib.nullcontext()
        with eager_decisions(model), saves.recording(aten=not step), tracking as live:
            with with_python_dispatcher(python_dispatcher, cuda.overrides() if cuda else None), \
                    (cuda.norm_stats() if cuda else contextlib.nullcontext()), data_dependence_refused():
                # the inputs live as long as the model's code keeps them (a training loop's batch dies with its step)
                loss = forward(model, *make_inputs(sizes["s"], sizes["b"]))
                if step:
                    run["sampled"] = step.get("sampled") or _representatives(live, saves)
                    live.sampler.layers = set(run["sampled"])
                    live.set(phase="backward", layer=None)
                    # the lowest layer whose input the checkpoint keeps (Gemma 4's first layer's input, the
                    # embeddings, is saved outside the layers already, by its per-layer input projection)
                    first = min((k[1] for k, v in live.buckets.items() if k[0] == "input" and v), default=0)
                    run["kept"] = {"inputs": list(live.buckets.get(("input", first), {}).values()),
                                   "extras": list(live.buckets.get(("extra",), {}).values())}
                    hooks = order_.engine_hooks(loss, live) if step.get("order") else []
                    loss.backward()
                    for h in hooks:
                        h.remove()
                del loss
    conditions = check_guards(env, symbols, scale) + (cuda.assumed if cuda else [])
    conditions += [f"s % {s_multiple} == 0"] if s_multiple > 1 else []
    out = []
    for st in saves.storages():
        st["nbytes"] = as_poly_expr(st["nbytes"], named, st, conditions)
        out.append(st)
    run.update(model=model, storages=out, conditions=merge_divisibility(conditions + polys_conditions))
    return run


def _representatives(live, saves: Saves) -> list[int]:
    """The decoder layers whose backward is sampled: of each kind of layer (the same saves, by module,
    op, k, j, dtype and size) the first two and the last two; the others repeat them."""
    kinds: dict[tuple, list[int]] = {}
    for i in range(live.num_layers):
        recs = live.buckets.get(("saved", i), {}).values()
        sig = tuple(sorted((*(str(x) for x in saves.ctx[r.key][:4]), str(r.dtype), str(r.nbytes)) for r in recs))
        kinds.setdefault(sig, []).append(i)
    return sorted({i for layers in kinds.values() for i in layers[:2] + layers[-2:]})


def grad_hooks(model, live) -> list:
    """A hook on every trainable parameter telling ``live`` its gradient is made; a frozen one (AFMoE's expert_bias,
    Laguna's e_score_correction_bias: parameters with requires_grad false) gets no gradient and no hook."""
    return [p.register_post_accumulate_grad_hook(partial(lambda name, p: live.grad_made(p, name), name))
            for name, p in model.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def _tracking(model, saves: Saves, named: dict, step: dict, conditions: list[str], run: dict):
    """The live-storage tracker of a step's run (``symbolic_run``), with its hooks: forward and backward
    labels per decoder layer (validation/step.py), the layers' inputs, every save, every gradient."""
    from . import transients
    from .step import _LayerHooks

    path, n = step["layers"](model)
    checkpoint = step["checkpoint"]
    if checkpoint:  # transformers 5.x renamed gradient_checkpointing_enable (deprecated alias)
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    live = transients.LiveStorages(named, path, n)
    live.module = lambda: saves.modules.current
    live.before = saves.aten.note  # saves.recording(aten=False): the kernels logged from this mode
    polys = transients.Polys(named, conditions, exact_divisions)
    sampler = transients.Sampler(live, polys, checkpointed=checkpoint, head=not checkpoint)
    run.update(sampler=sampler, polys=polys, args={})
    saves.live = live
    layers = list(model.get_submodule(path))
    handles = []

    def inputs(i, module, args, kwargs):
        if live.phase == "backward":  # a checkpointed layer's recompute
            return
        for label, rec in live.layer_inputs(i, args, kwargs, checkpoint).items():
            if rec is not None:
                run["args"].setdefault(rec.cdata, (label, i, rec))

    if step.get("order"):  # the allocations and frees in order (validation/layer_order.py)
        live.log = run["log"] = []
        for layer in layers if checkpoint else ():
            _flag_reruns(layer, live)
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(partial(inputs, i), with_kwargs=True))
    handles += grad_hooks(model, live)
    hooks = _LayerHooks(live, layers)
    live.sampler = sampler
    try:
        with live:
            yield live
    finally:
        live.sampler = None
        hooks.close()
        for h in handles:
            h.remove()


def _flag_reruns(layer, live) -> None:
    """``live.rerun`` set while a checkpointed layer's forward runs again in the backward: transformers checkpoints
    the layer's ``forward`` through ``_gradient_checkpointing_func`` (its module hooks stay outside the recompute)."""
    checkpointed = getattr(layer, "_gradient_checkpointing_func", None)
    if checkpointed is None:
        return

    def flagged(fn, *args, **kwargs):
        def run(*a, **k):
            again = live.phase == "backward"
            live.rerun = again
            try:
                return fn(*a, **k)
            finally:
                live.rerun = live.rerun and not again

        return checkpointed(run, *args, **kwargs)

    layer._gradient_checkpointing_func = flagged


@contextlib.contextmanager
def data_dependence_refused():
    """Control flow or sizes that depend on tensor values cannot be traced symbolically: refuse."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        yield
    except (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise TraceRefused(
            "the forward depends on tensor values (data-dependent control flow or sizes, e.g. a loop over the "
            "experts that received tokens; transformers' grouped_mm experts, its default, route all k s b token "
            f"copies and trace): {type(err).__name__}: {first[:200]}") from None
