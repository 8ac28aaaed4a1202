"""Traced inventories: what transformers' real code saves for the backward, read as data.

A traced inventory file (memplan/inventory/traced_file.py: what `memplan trace` recorded of transformers' own
code, every saved storage an exact polynomial in s and b) becomes here an `Inventory` like the hand-written ones, so
estimate, the timeline and the planner use it unchanged:

- each saved storage of a decoder layer is a layer term (a storage several layers share, such as
  the rotary cos / sin tables, is counted once per model chunk); a model whose layers differ (groups
  of layers) gets each group's terms weighted by its share of the layers, so the model's total is
  the groups' sum and a per-layer figure is the layers' mean (each term's mean bytes per layer are
  floored to whole bytes: exact when a group's share of a term's bytes is whole, else within a byte per
  term and layer);
- storages outside the layers belong to the first stage (embedding) or the last (final norm, LM
  head, loss);
- dtypes: the trace's activation dtype follows the precision (act), float32 is fp32, bool / 8-bit
  are 1-byte masks, int64 ids are 8 bytes;
- gradient checkpointing (full recompute) keeps each layer's input (torch.utils.checkpoint) and what
  the layers are given (traced, below; a /1 file: the input and, eager, the additive causal mask, as
  terms_hf's measured inventories count them);
- the step's transients (format /2): the tracer also runs the backward under the fake mode, as is and
  with gradient checkpointing, and follows every live storage (validation/transients.py); each op of a
  layer's backward (of the loss and the head) is a candidate moment: the layer's saves still alive, the
  tensors nobody saves, its own gradients made so far; only the candidates that can be the peak for some
  s, b are kept (`moments`), and what checkpointing keeps (`checkpoint`: each layer's input, and the tensors
  every checkpointed layer is given that no save counts: masks, position ids). A moment belongs to the
  layers it was traced in (a layer group's, the ends of a group apart), so no group is averaged at the peak;
- a file of format /1 (no transients) gets the moments terms_hf derives for the Llama layout, with the
  tensors each frees found by forward order (the saves made at or after the attention output projection,
  eager attention: after the softmax's, are gone when attention's backward runs) and the two found in op
  logs (`_first_moments`); the report says which.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from pathlib import Path

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly
from memplan.inventory.hf import checkpoint_mask, hf_layer_moments, hf_loss_moments
from memplan.inventory.step_order import expand
from memplan.inventory.traced_file import SYMBOLS, LayerGroup, TracedFile, TracedTerm, file_name, load, term_dtype
from memplan.inventory.types import OUTPUT_LAYER_W, Dtype, Inventory, Moment, Term, saved, transient


def _block(module: str) -> str:
    if "attn" in module or "attention" in module:
        return "attention"
    if "mlp" in module or "moe" in module or "feed_forward" in module:
        return "MLP"
    if "norm" in module or module.startswith("ln"):
        return "layer norms"
    return "other"


def _term(row: TracedTerm, scope: str, weight: Fraction, source: str) -> Term:
    dtype: Dtype = term_dtype(row.dtype)
    elements = Poly.parse_sum(row.elements) * weight
    share = "" if weight == 1 else f", in {weight} of the layers"
    op = row.op.rsplit(".", 1)[-1]
    return Term(row.id, f"{row.module or 'model'}: saved by {op} ({row.dtype}{share})", _block(row.module),
                elements, dtype, False, False, scope=scope, in_k22=False, source=source)


def _outside_scope(module: str) -> str:
    return "first" if any(k in module for k in ("embed", "wte", "wpe")) else "last"


def origin_text(traced: TracedFile) -> str:
    o = traced.origin
    when = f"; valid for {', '.join(traced.conditions)}" if traced.conditions else ""
    return (f"traced from transformers {o.transformers} ({o.architecture}, {o.impl}, {o.kernels} kernels, "
            f"torch {o.torch}{when})")


def traced_terms(traced: TracedFile) -> list[Term]:
    """The saved tensors of the trace as inventory terms (layer terms weighted by their group's
    share of the layers; shared storages once per model chunk)."""
    origin = f"traced: transformers {traced.origin.transformers}"
    terms: list[Term] = []
    seen_shared: set[str] = set()
    for k, group in enumerate(traced.layer_groups):
        weight = Fraction(len(group.layers), traced.num_layers)
        for row in _group_rows(group, k):
            if row.shared:
                if row.id not in seen_shared:
                    seen_shared.add(row.id)
                    terms.append(_term(row, "chunk", Fraction(1), origin))
            else:
                terms.append(_term(row, "layer", weight, origin))
    terms += [_term(row, _outside_scope(row.module), Fraction(1), origin) for row in traced.outside]
    return terms


def _group_rows(group: LayerGroup, k: int) -> list[TracedTerm]:
    """A group's terms, their ids made unique across groups (group k > 0: "<id>#g<k>"); shared
    storages keep theirs (they are one storage whichever layers save it)."""
    if k == 0:
        return group.terms
    return [r if r.shared else r.model_copy(update={"id": f"{r.id}#g{k}"}) for r in group.terms]


def _freed(rows: list[TracedTerm], sdpa: bool) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """What each backward moment of a layer has released (terms_hf._layer_moments' three moments),
    from the forward order of one group's saves; a norm on the MLP's output (Gemma 2 / 3) is
    back-propagated before the MLP, so its saves are gone at all three."""
    attention = [r for r in rows if _block(r.module) != "MLP"]
    mlp = [r for r in rows if _block(r.module) == "MLP"]
    after_down = _from(mlp, DOWN_PROJ, DOWN_PROJ_OPS)
    in_attention = (_from(attention, OUT_PROJ) if sdpa else _after_softmax(attention) or _from(attention, OUT_PROJ))
    post = _post_mlp_norm(rows)
    return after_down[1:] + post, after_down + post, in_attention + tuple(r.id for r in mlp if not r.shared)


def _post_mlp_norm(rows: list[TracedTerm]) -> tuple[str, ...]:
    """Ids of a norm's saves made after the MLP's last save (Gemma 2 / 3 post_feedforward_layernorm)."""
    last_mlp = max((i for i, r in enumerate(rows) if _block(r.module) == "MLP"), default=None)
    if last_mlp is None:
        return ()
    return tuple(r.id for r in rows[last_mlp + 1:] if _block(r.module) == "layer norms" and not r.shared)


def _first_moments(model: ModelSpec, traced: TracedFile) -> list:
    """Moments at the start of a layer's backward that the Llama layout does not have (derived from op
    logs of real CPU steps, validation/step.py; memplan validate --peak checks them):
    - a norm on the MLP's output (Gemma 2 / 3): its fp32 backward holds four s x b x h fp32 tensors
      beside the residual stream's gradient, every save of the layer still alive;
    - an MoE layer (transformers' grouped_mm experts): the combine's backward makes fp32 copies of the
      gradient for the k routed copies of each token (s b h, s b k h, k s b h twice) and a bf16 one."""
    src = "derived from op logs of real CPU steps (validation/step.py), checked by memplan validate --peak"
    dy = transient("grad_residual", "gradient of the layer output (residual stream)", "s b h", src=src)
    moments = []
    if any(_post_mlp_norm(g.terms) for g in traced.layer_groups):
        moments.append(Moment("post_mlp_norm_backward", "backward of the norm on the MLP's output (fp32)", "backward",
                              "layer", (dy, transient("grad_norm_fp32", "the norm's fp32 backward", "4 s b h", "fp32",
                                                src=src)), source=src))
    if model.is_moe:
        k = model.moe_top_k
        moments.append(Moment("moe_combine_backward", "backward of the experts' combine (fp32 copies per routed token)",
                              "backward", "layer",
                              (dy, transient("grad_combine_fp32", "fp32 gradients of the k routed copies", f"{3 * k} s b h",
                                      "fp32", src=src),
                               transient("grad_combine", "bf16 gradient of the k routed copies", f"{k} s b h", src=src)),
                              source=src))
    return moments


def _from(rows: list[TracedTerm], ends: tuple[str, ...], ops: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Ids of the saves made at or after the first save of a module whose name ends with one of
    `ends`, or of one of the calls `ops` (forward order): what that module's backward has released.
    None found: nothing (the moment then counts every save of the layer, the safe side)."""
    for i, row in enumerate(rows):
        call = row.id[len(row.module) + 1:].rsplit(".", 1)[0] if row.module else ""
        if row.module.rsplit(".", 1)[-1] in ends or (row.module.endswith("experts") and call in ops):
            return tuple(r.id for r in rows[i:] if not r.shared)
    return ()


def _after_softmax(rows: list[TracedTerm]) -> tuple[str, ...]:
    """Eager attention's backward peaks at the softmax backward: the saves made after the (last)
    softmax's (dropout mask, attention over V, the output projection, ...) are released by then."""
    last = max((i for i, r in enumerate(rows) if "softmax" in r.op), default=None)
    return () if last is None else tuple(r.id for r in rows[last + 1:] if not r.shared)


# The attention output projection and the MLP's down projection, by their transformers names.
OUT_PROJ = ("o_proj", "out_proj", "c_proj", "dense")
DOWN_PROJ = ("down_proj", "fc2", "c_proj", "w2")
# transformers' grouped_mm experts (Mixtral, Qwen3-MoE, DeepSeek-V3) run gate_up_proj, then down_proj: the
# second grouped GEMM of an `experts` module is its down projection
DOWN_PROJ_OPS = ("_grouped_mm#1",)


# (traced file, the model but its sequence length, impl, device) -> the inventory: its sizes are polynomials in s
# and b, so `--max-seq`'s lengths share one (the traced file kept in the value: its id stays its own)
_BUILT: dict[tuple, tuple[TracedFile, Inventory]] = {}


def traced_inventory(model: ModelSpec, impl: str, device: str, loss_chunks: int = 1) -> Inventory:
    """The inventory of a model whose saved tensors were traced (ModelSpec.inventory); built once per file, model
    (whatever its sequence length: no part of it reads it) and implementation."""
    assert model.inventory is not None
    if loss_chunks > 1:
        raise MemplanError("--loss-chunks is measured for the hand-written transformers inventories (GPT-2, "
                           "Llama layout); traced inventories have transformers' own loss only")
    traced = _cuda_or_cpu(model.inventory, impl) if device == "cuda" else load(model.inventory, impl, "cpu")
    key = (id(traced), model.model_dump_json(exclude={"seq_length"}), impl, device)
    if key not in _BUILT:
        if len(_BUILT) >= 16:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = (traced, _traced_inventory(model, traced, impl, device))
    return _BUILT[key][1]


def _traced_inventory(model: ModelSpec, traced: TracedFile, impl: str, device: str) -> Inventory:
    terms = traced_terms(traced)
    sdpa = impl == "hf-sdpa"
    if traced.checkpoint is not None and traced.moments:
        terms += _checkpoint_terms(traced)
        terms_by_id = tuple(terms)
        return Inventory(f"{impl}/{device}", terms_by_id, tuple(_traced_moments(model, traced, terms)), "backward",
                         False, "fused", "torch", origin=origin_text(traced) + "; transients traced",
                         traced_from=_least_values(traced.conditions),
                         traced_multiple=_multiples(traced.conditions),
                         step_order=tuple((row.recompute, traced.num_layers, expand(row, traced.num_layers))
                                          for row in traced.step_order))
    # gradient checkpointing keeps each layer's input (and, eager, the additive mask): not in a trace
    # without recompute, added as terms_hf's measured inventories add them
    terms.append(saved("layer_input", "layer input, kept by gradient checkpointing", "layer norms", "s b h",
                    only_full=True, k22=False, src="torch.utils.checkpoint keeps the decoder layer's input "
                    "(measured for Llama, validation/hf.py)"))
    if not sdpa:
        terms.append(checkpoint_mask())
    # each group's forward order decides what its layers' backward moments have released (a layer
    # term is weighted by its group's share, so every group's releases count at each moment)
    by_group = [_freed(_group_rows(g, k), sdpa) for k, g in enumerate(traced.layer_groups)]
    freed = tuple(tuple(i for f in by_group for i in f[j]) for j in range(3))
    moments = (_first_moments(model, traced) + _moe_moments(model, hf_layer_moments(model, sdpa, freed))
               + hf_loss_moments(model, final_norm=False))
    return Inventory(f"{impl}/{device}", tuple(terms), tuple(moments), "backward", False, "fused", "torch",
                     origin=origin_text(traced), traced_from=_least_values(traced.conditions),
                         traced_multiple=_multiples(traced.conditions))


def _checkpoint_terms(traced: TracedFile) -> list[Term]:
    """What gradient checkpointing keeps, traced (the file's `checkpoint`): each layer's input, and the
    tensors every checkpointed layer is given that no save counts already (Mistral's sliding-window
    bool mask, the int64 position ids; eager attention's additive mask): once per model chunk."""
    src = f"traced: transformers {traced.origin.transformers}, gradient checkpointing (validation/transients.py)"
    ck = traced.checkpoint
    assert ck is not None
    terms = []
    if ck.layer_input is not None:
        terms.append(saved("layer_input", "layer input, kept by gradient checkpointing", "layer norms",
                        ck.layer_input.elements, term_dtype(ck.layer_input.dtype), only_full=True, k22=False, src=src))
    for k, row in enumerate(ck.kept):
        if row.saved_as is not None:
            continue
        block = "attention" if "mask" in row.arg else "other"
        terms.append(saved(f"checkpoint_kept.{k}", f"{row.arg} of the layers (from layer {row.layer}), kept by "
                        f"gradient checkpointing ({row.dtype})", block, row.elements, term_dtype(row.dtype),
                        scope="chunk", only_full=True, k22=False, src=src))
    return terms


def _traced_moments(model: ModelSpec, traced: TracedFile, terms: list[Term]) -> list[Moment]:
    """The file's moments as the timeline's: each is self-contained for its layer (or the head): every
    saved term of the layers (of the head) is freed and what the trace found alive is listed as its
    transients, the layer's own saves unweighted (a layer group's, not the mean of the groups), the saves
    outside the layers that the timeline does not count at that point (the head's, in a layer's backward),
    and the tensors nobody saves. The layer's own gradients are counted in elements (`grad_elements`),
    the head's by parameter group."""
    src = f"traced: transformers {traced.origin.transformers}, live storages of a fake step (validation/transients.py)"
    layer_ids = tuple(t.id for t in terms if t.scope == "layer")
    last_ids = tuple(t.id for t in terms if t.scope == "last")
    outside = {r.id: r for r in traced.outside}
    rows = [{r.id: r for r in g.terms} for g in traced.layer_groups]
    ck = traced.checkpoint
    head = "word embedding" if model.tied_embeddings else OUTPUT_LAYER_W
    moments = []
    for n, m in enumerate(traced.moments):
        scope = "layer" if m.scope == "layer" else "last"
        ts = []

        def add(id: str, name: str, row) -> None:
            ts.append(transient(f"m{n}.{id}", name, row.elements, term_dtype(row.dtype), scope=scope, src=src))

        for id in m.alive:
            if id == "layer_input" and ck is not None and ck.layer_input is not None:
                add(id, "the layer's input, kept by gradient checkpointing", ck.layer_input)
                continue
            row = rows[m.group][id] if scope == "layer" else outside[id]
            if scope == "last" and (row.shared or _outside_scope(row.module) == "first"):
                continue  # counted with the stage's first-stage and chunk terms
            add(id, f"{id}: saved by {row.op.rsplit('.', 1)[-1]}, still alive", row)
        if scope == "layer":
            for id in m.outside:
                row = outside[id]
                if not row.shared and _outside_scope(row.module) == "last":
                    add(id, f"{id}: saved outside the layers, still alive", row)
        for k, t in enumerate(m.transients):
            add(f"t{k}", t.what, t)
        if scope == "layer":
            full = m.recompute == "full"
            # a recomputed layer's moment says which tensors given to the checkpointed layers are still alive
            # (one is freed once the last layer using it is done): the others are freed, not counted
            kept_ids: tuple[str, ...] = ()
            if full and ck is not None:
                kept_ids = tuple(r.saved_as or f"checkpoint_kept.{k}" for k, r in enumerate(ck.kept))
                for k in m.kept:
                    add(f"kept{k}", f"{ck.kept[k].arg}, kept by gradient checkpointing", ck.kept[k])
            moments.append(Moment(f"traced_{n}", f"layer backward{' (recomputed)' if full else ''}: after {m.at}",
                                  "backward", "layer", tuple(ts), freed=layer_ids + ("layer_input",) + kept_ids,
                                  grad_elements=m.grad_elements, applies="recomputed" if full else "plain",
                                  layers=tuple(m.layers) if set(m.layers) != set(range(traced.num_layers)) else (),
                                  source=src))
        else:
            grads = tuple(dict.fromkeys(head if ("lm_head" in g or "embed" in g) else "final norm" for g in m.grads))
            what = "loss forward" if m.phase == "loss" else "loss / head backward"
            moments.append(Moment(f"traced_{n}", f"{what}: after {m.at}", m.phase or "backward", "last", tuple(ts),
                                  freed=last_ids, grads=grads, source=src))
    return moments


def _moe_moments(model: ModelSpec, moments: list) -> list:
    """An MoE layer's backward transients: the MLP's f-wide gradients become those of the k s b routed
    token copies through f_e-wide experts, sized as a dense MLP k f_e wide (derived, not measured)."""
    if not model.is_moe:
        return moments
    width = Poly.parse(f"{model.moe_top_k} fe")
    out = []
    for m in moments:
        transients = tuple(dataclasses.replace(t, elements=t.elements.substitute("f", width)) for t in m.transients)
        out.append(dataclasses.replace(m, transients=transients, source=f"{m.source}; the MLP's gradients sized for "
                                       "the k routed copies of each token through f_e-wide experts"))
    return out


# what an estimate of a state-space hybrid (ModelSpec.layer_pattern) says its activations are, by the blocks it has:
# Mamba-2 mixers (S, P, M, Y), LFM2's short convolutions (C), Mamba-1 mixers (1, J, j, Z), gated DeltaNets (D, d) and
# Kimi Delta Attention (K, k, B, b), RecurrentGemma's RG-LRU blocks (R), RWKV's blocks (W), MiniMax's lightning
# attention (L)
_HYBRID_NOTES = (("SPMY", "its Mamba-2 layers' activations are what transformers' torch path saves (the chunked scan, "
                  "torch_forward; traced, s a multiple of the scan's chunk); on CUDA, transformers runs mamba-ssm's "
                  "fused kernels (mamba_chunk_scan_combined, causal_conv1d) when they are installed, which save other "
                  "tensors: not modelled"),
                 ("C", "its short-convolution layers' activations are what transformers' torch path saves (the gated "
                  "depthwise conv1d, causal_conv1d_fn's torch fallback; traced); on CUDA, transformers runs LFM2's with "
                  "causal-conv1d's fused kernel when it is installed, which saves other tensors: not modelled (LFM3's "
                  "stay on the torch path)"),
                 ("1JjZ", "its Mamba-1 mixers' activations are what mamba-ssm's and causal-conv1d's CUDA kernels save "
                  "(mamba_inner_fn; Jamba, Zamba: causal_conv1d_fn, selective_scan_fn), derived from their source and "
                  "stood in while tracing (validation/trace_mamba1.py; s a multiple of the scan's 2048-token chunk), not "
                  "measured; transformers' torch path (a loop over s) is not modelled"),
                 ("Dd", "its gated DeltaNet layers' activations are what transformers' torch path saves (causal_conv1d_fn's "
                  "and torch_chunk_gated_delta_rule's torch fallbacks, s padded to chunks of 64; its Python loop over the "
                  "chunks is traced at concrete s and b and fitted: validation/trace_fit.py, the fit's points in the "
                  "trace's conditions); on CUDA, transformers runs flash-linear-attention's chunk_gated_delta_rule and "
                  "causal-conv1d's kernels when they are installed, which save other tensors: not modelled; the "
                  "step's transients are the Llama layout's, derived (the fitted trace has no backward moments)"),
                 ("KkBb", "its Kimi Delta Attention layers' activations are what transformers' torch path saves "
                  "(causal_conv1d_fn's and chunk_kimi_delta_attention's torch fallbacks, s padded to chunks of 64; "
                  "its Python loop over the chunks is traced at concrete s and b and fitted: validation/trace_fit.py); "
                  "on CUDA, transformers runs flash-linear-attention's chunk_kda kernels when they are installed, "
                  "which save other tensors: not modelled; the step's transients derived"),
                 ("R", "its RG-LRU blocks' activations are what transformers' torch path saves (_rnn_scan's Python "
                  "loop over the tokens, traced at concrete s and b past the attention window and fitted: "
                  "validation/trace_fit.py); the step's transients are the Llama layout's, derived (the fitted trace "
                  "has no backward moments)"),
                 ("W", "its RWKV blocks' activations are what transformers' torch path saves "
                  "(rwkv_linear_attention_cpu's Python loop over the tokens, traced at concrete s and b and fitted: "
                  "validation/trace_fit.py); on CUDA, transformers runs the Hub's wkv kernel when the kernels package "
                  "loads it, which saves other tensors (k, v, the output): not modelled; the step's transients are the "
                  "Llama layout's, derived"),
                 ("L", "its lightning attention layers' activations are what transformers' torch path saves (its "
                  "Python loop over blocks of s, traced at concrete s and b and fitted: validation/trace_fit.py); the "
                  "step's transients are the Llama layout's, derived"))


def hybrid_note(model: ModelSpec) -> str:
    """The estimate's note on a hybrid's traced activations (the torch path's, not CUDA's fused kernels')."""
    parts = [text for blocks, text in _HYBRID_NOTES if set(blocks) & set(model.layer_pattern or "")]
    return "a state-space hybrid: " + "; ".join(parts)


def _multiples(conditions: list[str]) -> tuple[tuple[str, int], ...]:
    """The conditions "s % m == 0" of a trace (validation/trace_config.py scan_chunk: a Mamba-2 scan's chunk)."""
    out = []
    for text in conditions:
        parts = text.split()
        if len(parts) == 5 and parts[0] in SYMBOLS and parts[1] == "%" and parts[2].isdigit() and parts[3:] == ["==", "0"]:
            out.append((parts[0], int(parts[2])))
    return tuple(out)


def _least_values(conditions: list[str]) -> tuple[tuple[str, int], ...]:
    """The conditions "s >= N" / "b >= N" of a trace (a symbolic trace treats sizes 0 and 1 apart)."""
    out = []
    for text in conditions:
        sym, op, value = (text.split() + ["", ""])[:3]
        if sym in SYMBOLS and op == ">=" and value.isdigit():
            out.append((sym, int(value)))
    return tuple(out)


def _cuda_or_cpu(directory: str, impl: str) -> TracedFile:
    """CUDA kernels' trace when there is one; else a CPU kernels' one already there (the report says which); else
    one traced on first use with CUDA's kernels (with attention dropout CPU's sdpa keeps s x s tensors and its
    eager dropout a 2-byte mask that CUDA's kernels never make: validation/trace_cuda.py's CudaKernels)."""
    if (Path(directory) / file_name(impl, "cuda")).is_file() or not (Path(directory) / file_name(impl, "cpu")).is_file():
        return load(directory, impl, "cuda")
    return load(directory, impl, "cpu")
