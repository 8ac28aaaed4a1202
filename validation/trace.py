"""Trace what transformers' real model code saves for backward, as exact polynomials in s and b.

``trace_hf_config(config)`` builds the ``*ForCausalLM`` of a transformers ``config.json`` (from the
config alone: no weights, no network) under ``FakeTensorMode`` with a ``ShapeEnv``, gives it token
ids of shape ``[b, s]`` where s (sequence length) and b (micro-batch) are *symbols*, runs forward +
loss once in training mode, and records every storage autograd saves for backward
(``saved_tensors_hooks``; one entry per storage, views of one storage count once; parameters and
buffers excluded).  Under fake tensors nothing is allocated, so the real config's sizes are used
(h, a, g, f, v as the config says), and each storage's size comes
out as a symbolic expression: an exact polynomial in s and b with integer coefficients, which is
written in memplan's ``Poly`` syntax (``"5656 s b"``, ``"12 s^2 b + 64 s b"``).

The real config's sizes are used (no reduced model), but not every decoder layer runs: the
first layer of each kind, one in its middle, and the model's last two (``validation/compose.py``: layers with the same
modules, parameter shapes and per-layer settings, e.g. Gemma 3's sliding layers, whose sdpa keeps
an s x s mask, beside its global ones, or DeepSeek-V3's dense first layers before the MoE ones)
run, with the embedding, head and loss once, and every other layer takes its kind's terms
(``compose=False`` traces every layer: the reference tests compare the composition with).
Layers whose saved tensors are identical (same ids, ops, dtypes and polynomials) form one group.  MoE layers trace with
transformers' default ``grouped_mm`` experts: dropless top-k routing sends all k s b token copies
through grouped GEMMs, so every size is a polynomial; an expert loop over the experts that
received tokens (``experts_implementation="eager"``) is data-dependent and refused.

How a saved storage is named: from the context of its *first* save (``validation.hf``'s
machinery): the module path (relative to the decoder layer, ``self_attn.q_proj``, or to the model,
``model.norm``, ``""`` for the loss computed in the ``*ForCausalLM`` itself), the outermost torch call
in progress (``torch.nn.functional.linear``; ``scaled_dot_product_attention`` refined with the aten
kernel it reached, ``[flash_cpu]`` / ``[math]``), ``k`` the how-many-th saving call of that op in
that module and ``j`` the position of the tensor among what that call saved.  The id is
``<module>.<op>[#k].<j>``, e.g. ``self_attn.q_proj.linear.0``, ``mlp.mul.1``,
``input_layernorm.mul#1.0``: stable for a given code path and unique within a layer.  A storage
saved by several layers (the rotary cos / sin tables) is listed in every layer that saves it with
``shared: true``; it exists once per forward, so a consumer counts it once per id (memplan's
``chunk`` scope): shared ids are unique in the whole file (a second shared storage whose id is
taken, as Gemma 3's global rope tables beside its local ones, gets ``@<its first layer>``).  A
storage saved both outside and inside the layers would be listed in both, shared.

The trace is refused (``TraceRefused``) when it is not valid for every s and b:

* guards or replacements in the ShapeEnv that pin s or b (``Eq(s, 4096)``, ``s -> 4096``): some code
  turned a size into a Python int or compared it with a constant.  Wrapping the forward in
  ``torch._dispatch.python.enable_python_dispatcher()`` is what keeps torch's own C++ composite
  ops from doing that (``aten.matmul``'s C++ folding of batch dimensions reads sizes as ints; its
  Python port keeps them symbolic): without it eager attention specialises both s and b
  (``python_dispatcher=False`` shows it; tests check the refusal).  The python dispatcher also
  swaps in ``torch/_decomp``'s ``dropout``, which is not what an eager run executes (a bool
  ``native_dropout`` mask instead of the CPU kernel's bf16 ``bernoulli_`` one, a copy at p = 0),
  so dropout keeps its C++ kernel (validation/trace_saves.py ``_EAGER_ONLY``);
* a size that is not a polynomial in s and b, or a forward that depends on tensor values
  (data-dependent control flow or sizes).

Three kinds of code pin s whatever the tracer does, and are traced at concrete (s, b) instead, their saves fitted as
polynomials and checked at a held-out (s, b) (validation/trace_fit.py ``fit_step``): the gated delta rule's Python loop
over the chunks of s (Qwen3-Next, Qwen3.5, OLMo-hybrid: s a multiple of 64), a buffer sliced to s (GPT-Neo, GPT-1,
MPT) and a recurrence's loop over the tokens (RecurrentGemma's RG-LRU, past its attention window); such a trace has no
backward moments, and its conditions say it was fitted.

Range guards (``s >= 4096``: a sliding window that only masks when the sequence is longer than
the window) do not pin s; they are kept in the result's ``conditions`` with the symbols' ranges
(s, b >= 2 always: torch specialises sizes 0 and 1, so a trace never covers b = 1, where a few
kernels save differently, e.g. matmul keeps views instead of copies).  Which side of such a guard
is traced is chosen by the hints ``s_hint`` / ``b_hint`` (the values the ShapeEnv evaluates guards
at).

transformers treats fake tensors as tracing (``is_tracing(t)`` is true for a ``FakeTensor``) and
then takes branches an eager run never takes.  The one that changes saved tensors is
``masking_utils.find_packed_sequence_indices``: it cannot read fake position ids, answers
"packed" and makes ``create_causal_mask`` build an explicit mask (an ``s^2 b`` tensor saved by
sdpa, where a real run passes ``is_causal=True``).  The model builds its own position ids
(``arange(s)``: not packed), so the real answer, None, is given while tracing (validation/trace_saves.py
``eager_decisions``).  The other: BART's decoder and its copies make an all-ones padding mask (``torch.ones(b, s)``)
that ``_ignore_causal_mask_sdpa`` drops only by reading its values; while tracing, a mask made by ``torch.ones`` (and
not written into since) reads as no padding, as in the real run (``_all_ones_masks``).
Tests compare traces with real CPU runs at several (s, b) to catch any other such branch.

Kernels: ``kernels="cpu"`` is what torch's CPU kernels save (the trace runs them as fake CPU
tensors): dropout through ``F.dropout`` keeps a bf16 ``bernoulli_`` mask, sdpa reaches
``_scaled_dot_product_flash_attention_for_cpu`` without dropout and the fp32 math path (s^2
tensors) with dropout, layer norm keeps its mean and rstd in the activation dtype.
``kernels="cuda"`` emulates what the CUDA kernels save, still on fake CPU tensors (a CPU-only
torch cannot make fake CUDA tensors for a whole model), by swapping the ops whose CUDA kernels
save differently at dispatch level (validation/trace_cuda.py ``CudaKernels``): native_dropout's bool mask,
torch's choice of cuDNN / FlashAttention-2 / memory-efficient / math sdpa kernel (its default order on an H100:
``SDPA_ORDER``; ``sdpa=`` another) with their saved tensors (q, k, v, out, fp32 logsumexp, Philox
RNG state, the additive mask), fp32 layer-norm statistics.  It is derived from torch's dispatch
code, checked against memplan's CUDA inventories (terms_hf) and against an H100's saved bytes
(validation/cuda_dropout.py; tests/data/cuda_dropout.json, tests/test_cuda_dropout.py);
validation/trace_measure.py ``measure_hf_config(device="cuda")`` is the measurement (tests/test_trace.py,
skipped without CUDA).

The modules: validation/trace_config.py (configs, the cache key, the model built, FAMILIES), trace_saves.py
(recording saves, the dispatch set-up), trace_cuda.py (the CUDA kernels' emulation), trace_poly.py (guards,
polynomials), trace_run.py (one symbolic run), trace_inventory.py (the file's sections), trace_measure.py (real
runs, the check); this one composes a whole model's trace (``trace_hf_config``) and is the CLI.

CLI: ``python -m validation.trace --hf-config config.json [--impl hf-sdpa|hf-eager]
[--kernels cpu|cuda] [--out FILE.yaml]`` (YAML on stdout without ``--out``).
"""


from __future__ import annotations

from pathlib import Path
from typing import Callable

from . import hf as _hf  # sets HF_HUB_OFFLINE before transformers is imported

import torch  # noqa: E402

from . import compose as compose_  # noqa: E402
from . import layer_order as order_  # noqa: E402
from . import trace_mamba1 as mamba1_  # noqa: E402
from .trace_config import (IMPLS, KERNELS, build_model, config_sha256, decoder_layers_path, hf_config,  # noqa: E402
                           load_config, num_hidden_layers, scan_chunk)
from .trace_cuda import SDPA_ORDER  # noqa: E402
from .trace_fit import fit_step, fitted_run  # noqa: E402
from .trace_inventory import inventory_from_saves, moments_sections  # noqa: E402
from .trace_poly import TraceRefused, poly_text  # noqa: E402
from .trace_run import symbolic_run  # noqa: E402
from .trace_saves import forward_loss  # noqa: E402

FORMAT = "memplan-traced-inventory/2"


def trace_hf_config(config: dict | str | Path, impl: str = "hf-sdpa", kernels: str = "cpu",
                    dtype: str = "bfloat16", s_hint: int = 4096, b_hint: int = 2,
                    python_dispatcher: bool = True, experts: str | None = None, moments: bool = True,
                    compose: bool = True, progress: Callable[[str], None] | None = None,
                    sdpa: tuple[str, ...] = SDPA_ORDER, layer_order: bool = False, steps: dict | None = None) -> dict:
    """The traced inventory of a transformers config: what one training forward + loss saves for
    backward, per decoder-layer group and outside the layers, as polynomials in s and b; with
    ``moments`` also the step's transient tensors (validation/transients.py): the backward run
    under the fake mode, once as is and once with gradient checkpointing.

    Returns the inventory file's data (plain, YAML-serialisable): ``format``, ``origin`` (library
    versions, the config's sha256, architecture, impl, kernels, dtype), ``conditions`` (what the
    polynomials assume about s and b), ``num_layers``, ``layer_groups``, ``outside`` and, with
    ``moments``, ``checkpoint`` (what gradient checkpointing keeps) and ``moments``.

    ``compose``: trace of each kind the first decoder layer and one in the middle, and the model's last two only
    (validation/compose.py ``representatives``), with the embedding,
    head and loss, and give every other layer the terms of its kind (validation/compose.py; False: the whole
    model, the reference the composition is tested against). ``progress`` is told, in one line, what is traced.
    ``sdpa``: with ``kernels="cuda"``, the sdpa kernels tried in order (default torch's on an H100: ``SDPA_ORDER``;
    one name forces that kernel, as ``torch.nn.attention.sdpa_kernel`` does). ``layer_order`` (with ``moments``):
    also ``layer_order``, one layer of each group's allocations and frees in order (validation/layer_order.py),
    ``step_order``, the whole step's in the compact form memplan's allocation stream reads (``layer_order.step_row``),
    and, into ``steps`` when a dict, each run's whole step in order (``layer_order.step_order``) by recompute.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}")
    cfg = load_config(config)
    mamba1_.check(cfg, kernels)  # Mamba-1 mixers: CUDA's kernels stood in (validation/trace_mamba1.py)
    # a gated DeltaNet's loop over the chunks of s, a buffer sliced to s: saves fitted (trace_fit.py)
    fit = fit_step(cfg)
    fit_chunk = fit.step
    moments = moments and fit_chunk == 1
    # the key before transformers' config classes normalise the dict in place (a rope_scaling dict gains keys):
    # the key memplan looks a config.json up by (memplan/inventory/traced_file.py config_sha256)
    key = config_sha256(cfg)
    tf = _hf._transformers()
    vocab = int(hf_config(cfg).vocab_size)
    holder: dict = {}

    def build():
        model = build_model({**cfg, **(fit.overrides or {})}, impl, dtype, experts)
        n = num_hidden_layers(model)
        holder.update(layers=n, path=decoder_layers_path(model, n))
        holder["index"], holder["kinds"] = (compose_.reduce(model, holder["path"], n) if compose
                                            else (list(range(n)), None))
        if progress is not None and not holder.get("told"):
            holder["told"] = True
            kinds = f" ({len(holder['kinds'])} kind{'s' * (len(holder['kinds']) > 1)})" if compose else ""
            how = ("at concrete s and b, fitted (s pinned by a Python loop or a slice)" if fit_chunk > 1 else
                   "with symbolic s and b")
            progress(f"tracing {cfg['model_type']} ({impl}, {kernels} kernels) {how}: "
                     f"{len(holder['index'])} of {n} decoder layers{kinds}, the embedding, head and loss; "
                     f"{'forward' if fit_chunk > 1 else 'forward and backward'}"
                     f"{', then with gradient checkpointing' if moments else ''}")
        return model

    def make_inputs(s, b):
        return torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s))

    def layers(model):
        return holder["path"], len(holder["index"])

    sampled: list[int] = []  # the checkpointed run samples the layers the plain run chose
    shapes: dict = {}
    # a Mamba-2 mixer's scan: s a multiple of its chunk; mamba-ssm's Mamba-1 scan keeps states per 2048 tokens
    chunk = mamba1_.CHUNK if cfg.get("model_type") in mamba1_.MODEL_TYPES else scan_chunk(cfg)
    if chunk > 1:  # the hint: a multiple of the chunk, at least two chunks, their count not b's hint
        chunks = max(2, -(-s_hint // chunk))
        s_hint = chunk * (chunks + (chunks == b_hint))

    def run(checkpoint: bool) -> dict:
        with mamba1_.stand_ins(cfg, kernels):
            out = symbolic_run(build, forward_loss, make_inputs, s_hint, b_hint, python_dispatcher, kernels,
                               step={"layers": layers, "checkpoint": checkpoint, "sampled": sampled,
                                     "order": layer_order} if moments else None,
                               shapes=shapes, sdpa=sdpa, s_multiple=chunk)
        sampled[:] = out.get("sampled", [])
        return out

    if fit_chunk > 1:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=False)
        with mode:
            built = build()
        runs = [fitted_run(built, mode, forward_loss, make_inputs, fit_chunk, python_dispatcher, kernels, sdpa,
                           fit.multiple, fit.start, fit.why, fit.least)]
    else:
        runs = [run(checkpoint) for checkpoint in ((False, True) if moments else (False,))]
    model, storages = runs[0]["model"], runs[0]["storages"]
    conditions = list(dict.fromkeys(c for r in runs for c in r["conditions"]))
    num_layers, path = holder["layers"], holder["path"]
    for r in runs:
        compose_.renumber(r, path, holder["index"])
    same = compose_.copies(holder["kinds"]) if compose else {}
    ids: dict = {}
    body = inventory_from_saves(storages, path, num_layers, ids, same)
    origin = {
        "transformers": tf.__version__,
        "torch": torch.__version__.split("+")[0],
        "config_sha256": key,
        "architecture": type(model).__name__,
        "model_type": cfg["model_type"],
        "impl": impl,
        "kernels": kernels,
        "dtype": dtype,
    }
    data = {"format": FORMAT, "origin": origin, "conditions": conditions, **body}
    if moments:
        data.update(moments_sections(runs, body, ids, path, num_layers, same,
                                      compose_.stand_ins(holder["kinds"]) if compose else {}))
    if layer_order and moments:
        steps = {} if steps is None else steps
        data["layer_order"] = order_.file_rows(runs, body["layer_groups"], list(holder["index"]), num_layers,
                                                    poly_text, steps)
        data["step_order"] = [order_.step_row(events, recompute, list(holder["index"]), same, num_layers)
                              for recompute, events in steps.items()]
    return data



# ---------------------------------------------------------------------------------------------
# CLI


def to_yaml(data: dict) -> str:
    """The inventory as YAML: keys in the file's order, layer index lists on one line."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def represent_list(dumper, items):
        flow = all(isinstance(x, int) for x in items)
        return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)

    Dumper.add_representer(list, represent_list)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m validation.trace", description=__doc__.split("\n")[0])
    p.add_argument("--hf-config", required=True, help="a transformers config.json")
    p.add_argument("--impl", choices=IMPLS, default="hf-sdpa")
    p.add_argument("--kernels", choices=KERNELS, default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--s-hint", type=int, default=4096, help="the sequence length range guards are decided at")
    p.add_argument("--out", help="write the YAML here (default: stdout)")
    p.add_argument("--layer-order", action="store_true",
                   help="also record the allocations and frees in order: one layer of each group (layer_order) and "
                        "the whole step (step_order, which memplan's allocation stream reads)")
    a = p.parse_args(argv)
    try:
        data = trace_hf_config(a.hf_config, a.impl, a.kernels, a.dtype, s_hint=a.s_hint,
                               progress=lambda line: print(line, file=sys.stderr, flush=True),
                               layer_order=a.layer_order)
    except (NotImplementedError, TraceRefused, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = to_yaml(data)
    if a.out:
        Path(a.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
