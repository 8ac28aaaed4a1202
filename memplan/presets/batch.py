"""From a preset to a runnable config: the global batch scaled to the GPU count, the note that says how the batch was
chosen, `make_config` (estimate's Config from a preset and the user's options) and `search_inputs` (search's)."""

from __future__ import annotations

from typing import Any, Optional

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.spec_base import build
from memplan.core.specs import Config, check_gpus
from memplan.core.training import TrainingSpec
from memplan.presets.files import ModelPreset


def scaled_global_batch(preset: ModelPreset, gpus: int) -> int:
    """The preset's global batch scaled with the GPU count (same batch per model replica, as K22
    did for 530B on 280 and 2240 GPUs); unchanged when it does not scale to a whole number."""
    base = preset.training["global_batch"]
    preset_gpus = preset.parallel.get("tp", 1) * preset.parallel.get("pp", 1) * preset.parallel.get("dp", 1)
    return base * gpus // preset_gpus if (base * gpus) % preset_gpus == 0 else base


def _sequences(tokens: int, seq_length: int, multiple: int = 1) -> int:
    """The whole number of sequences of length s nearest to `tokens`, a multiple of `multiple` (b x d)."""
    return max(multiple, round(tokens / seq_length / multiple) * multiple)


def _batch(preset: ModelPreset, gpus: Optional[int], seq_length: int, sequences: Optional[int],
           tokens: Optional[int], multiple: int = 1) -> Optional[int]:
    """The global batch in sequences: as given; from a token count; else the preset's, scaled with the
    GPU count and, when s differs from the preset's, keeping the preset's tokens per step."""
    if sequences is not None and tokens is not None:
        raise MemplanError("give --global-batch (sequences) or --global-batch-tokens, not both")
    if sequences is not None:
        return sequences
    if tokens is not None:
        return _sequences(tokens, seq_length, multiple)
    if "global_batch" not in preset.training:
        return None
    base = scaled_global_batch(preset, gpus) if gpus is not None else preset.training["global_batch"]
    if seq_length == preset.model.seq_length:
        return base
    return _sequences(base * preset.model.seq_length, seq_length, multiple)


def batch_note(preset: ModelPreset, seq_length: int, global_batch: int, sequences: Optional[int] = None,
               tokens: Optional[int] = None, gpus: Optional[int] = None) -> Optional[str]:
    """Where a global batch in sequences came from, when it was derived: from tokens, or from the
    preset's batch scaled to another GPU count or kept in tokens at another s."""
    per_step = f"global batch {global_batch:,} sequences x s = {seq_length:,} = {global_batch * seq_length:,} tokens"
    if sequences is not None or ("global_batch" not in preset.training and tokens is None):
        return None
    if tokens is not None:
        asked = "" if global_batch * seq_length == tokens else f" (the nearest to the {tokens:,} tokens asked for)"
        return per_step + asked
    base, s0 = preset.training["global_batch"], preset.model.seq_length
    preset_gpus = preset.parallel.get("tp", 1) * preset.parallel.get("pp", 1) * preset.parallel.get("dp", 1)
    scaled = gpus is not None and scaled_global_batch(preset, gpus) != base
    if not scaled and seq_length == s0:
        return None
    how = [f"the preset's {base:,} x {s0:,}"]
    if scaled:
        how.append(f"scaled from its {preset_gpus:,} GPUs to {gpus:,}")
    if seq_length != s0:
        how.append("kept in tokens at the new s")
    return f"{per_step}: {', '.join(how)}; --global-batch or --global-batch-tokens sets it"


def make_config(
    preset: ModelPreset,
    parallel: Optional[dict[str, Any]] = None,
    training: Optional[dict[str, Any]] = None,
    model: Optional[dict[str, Any]] = None,
    gpus: Optional[int] = None,
    whole_model_per_rank: bool = False,
    global_batch_tokens: Optional[int] = None,
) -> Config:
    """Merge a preset's plan with overrides (None values are ignored) and check it all.

    Overriding t or p resets what the preset chose only for the old shape: SP stays on only if
    t > 1, and interleaving falls back to m = 1 when p changes and m was not given. A GPU count
    sets d = GPUs / (t p) and scales the preset's global batch with it. The global batch is kept
    in tokens when s changes, or set in tokens (`global_batch_tokens`), rounded to whole sequences
    that b x d divides.
    """
    over_p = {k: v for k, v in (parallel or {}).items() if v is not None}
    over_t = {k: v for k, v in (training or {}).items() if v is not None}
    over_m = {k: v for k, v in (model or {}).items() if v is not None}
    par = {**preset.parallel, **over_p}
    if whole_model_per_rank:
        # An implementation without tensor / pipeline parallelism (transformers): the preset's GPUs
        # become data-parallel ranks unless the user set the plan.
        preset_gpus = par.get("tp", 1) * par.get("pp", 1) * par.get("dp", 1)
        par.update({k: 1 for k in ("tp", "pp", "vpp") if k not in over_p})
        par.update({k: 1 for k in ("ep", "etp") if k in par and k not in over_p})  # transformers has no EP
        par.setdefault("dp", 1)
        if "dp" not in over_p:
            par["dp"] = preset_gpus // (par["tp"] * par["pp"]) or 1
        if "sp" not in over_p:
            par["sp"] = False
    if "pp" in over_p and "vpp" not in over_p:
        par["vpp"] = 1
    if ("pp" in over_p or whole_model_per_rank) and not {"first_stage_layers", "last_stage_layers"} & set(over_p):
        par.pop("first_stage_layers", None)  # the preset's uneven split belongs to its own p
        par.pop("last_stage_layers", None)
    if "sp" not in over_p and par.get("tp", 1) == 1:
        par["sp"] = False
    if gpus is not None:
        check_gpus(gpus)
        tp, pp, cp = par.get("tp", 1), par.get("pp", 1), par.get("cp", 1)
        if gpus % (tp * pp * cp):
            what, value = ("t*p*cp", f"{tp}*{pp}*{cp}") if cp > 1 else ("t*p", f"{tp}*{pp}")
            raise MemplanError(f"GPU count {gpus} is not divisible by {what} = {value} = {tp * pp * cp}")
        if "dp" in over_p and over_p["dp"] * tp * pp * cp != gpus:
            what = "t*p*d*cp" if cp > 1 else "t*p*d"
            raise MemplanError(f"{what} = {tp}*{pp}*{over_p['dp']}{f'*{cp}' if cp > 1 else ''} does not equal the GPU "
                               f"count {gpus}")
        par["dp"] = gpus // (tp * pp * cp)
    tr = {**preset.training, **over_t}
    if "recompute" in over_t and "recompute_num_layers" not in over_t:
        tr.pop("recompute_num_layers", None)
    model_spec = preset.model
    if whole_model_per_rank and model_spec.mtp_layers:
        model_spec = model_spec.model_copy(update={"mtp_layers": 0})  # transformers builds no MTP module
    if over_m:
        model_spec = build(ModelSpec, {**preset.model.model_dump(exclude_defaults=True), **over_m})
    multiple = tr.get("micro_batch", 1) * par.get("dp", 1)
    batch = _batch(preset, gpus, model_spec.seq_length, over_t.get("global_batch"), global_batch_tokens, multiple)
    if batch is not None:
        tr["global_batch"] = batch
    return build(Config, {"model": model_spec, "parallel": par, "training": tr})


_PLAN_KEYS = ("micro_batch", "global_batch", "recompute", "recompute_num_layers")


def search_inputs(preset: ModelPreset, gpus: int, global_batch: Optional[int] = None,
                  seq_length: Optional[int] = None, attention: Optional[str] = None,
                  training: Optional[dict[str, Any]] = None,
                  global_batch_tokens: Optional[int] = None) -> tuple[ModelSpec, TrainingSpec, int]:
    """What `search` needs from a preset: the model, the training settings that are not searched
    (byte sizes, optimizer) and the global batch in sequences (given, or from a token count, or the
    preset's scaled to the GPU count with its tokens per step kept at a new s, or one sequence per GPU)."""
    over = {k: v for k, v in dict(seq_length=seq_length, attention=attention).items() if v is not None}
    check_gpus(gpus)
    model = preset.model
    if over:
        model = build(ModelSpec, {**model.model_dump(exclude_defaults=True), **over})
    settings = {**preset.training, **{k: v for k, v in (training or {}).items() if v is not None}}
    unsearched = {k: v for k, v in settings.items() if k not in _PLAN_KEYS}
    if unsearched.get("activation_offloader") == "torchtune":  # only with every layer checkpointed: the search pins it
        unsearched["recompute"] = "full"
    training = build(TrainingSpec, unsearched)
    global_batch = _batch(preset, gpus, model.seq_length, global_batch, global_batch_tokens)
    if global_batch is None:
        global_batch = gpus
    if global_batch <= 0:
        raise MemplanError(f"global batch must be positive (got {global_batch})")
    return model, training, global_batch
