"""Model and GPU presets: YAML files in configs/, read as data.

A model file holds `model:` (the architecture, a ModelSpec) and optionally the plan it was
trained with (`parallel:`, `training:`) and the GPU it ran on (`gpu:`). A user's own file has the
same shape. Unknown or mistyped keys are refused with the key and the file named.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.spec_base import build, echo
from memplan.core.specs import Config, GpuSpec, ParallelSpec, check_gpus
from memplan.core.training import TrainingSpec
from memplan.inventory.traced_file import inventory_dir


def configs_dir() -> Path:
    """The presets: $MEMPLAN_CONFIGS, else configs/ of the checkout (editable installs, tests), else
    the copy a wheel installs beside the package (memplan/_configs, see pyproject.toml)."""
    env = os.environ.get("MEMPLAN_CONFIGS")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    checkout = here.parent / "configs"
    return checkout if (checkout / "models").is_dir() else here / "_configs"


@dataclass(frozen=True)
class ModelPreset:
    """A model and the plan it comes with (dicts, merged with overrides before building)."""

    model: ModelSpec
    parallel: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    gpu: Optional[str] = None
    source: str = ""
    notes: tuple[str, ...] = ()  # what the reader chose for the user (e.g. where s came from)


_PRESET_KEYS = {"model", "parallel", "training", "gpu"}


MAX_FILE_BYTES = 1 << 20  # a model, GPU or config.json file is a few KB; /dev/zero is not one


def read_text(path: Path, what: str) -> str:
    """A small UTF-8 text file, or a one-line error (missing, a directory, too large, not UTF-8)."""
    if path.is_dir():
        raise MemplanError(f"{path} is a directory, not a {what}")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise MemplanError(f"cannot read {path}: {err.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise MemplanError(f"{path}: larger than {MAX_FILE_BYTES // 1024} KiB: not a {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise MemplanError(f"{path}: not UTF-8 text (byte {err.start})") from None


# libyaml's safe loader where PyYAML was built with it (the same plain data, about 10x faster to parse)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_yaml(path: Path) -> dict:
    text = read_text(path, "YAML file")
    try:
        # plain data only: anchors and aliases (a "billion laughs" file expands exponentially) and
        # language tags (!!python/...) are refused before anything is built
        for event in yaml.parse(text, Loader=SAFE_LOADER):
            if isinstance(event, yaml.AliasEvent):
                raise MemplanError(f"{path}: line {event.start_mark.line + 1}: YAML aliases (*name) are not "
                                   "supported; write the values out")
        data = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.constructor.ConstructorError as err:
        mark = err.problem_mark
        raise MemplanError(f"{path}: line {mark.line + 1 if mark else '?'}: {err.problem} (plain YAML data only)"
                           ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise MemplanError(f"{path}:{where} is not valid YAML") from None
    if not isinstance(data, dict):
        raise MemplanError(f"{path}: expected a mapping at the top level")
    return data


def read_model_file(path: Path) -> ModelPreset:
    data = _read_yaml(path)
    unknown = sorted(set(data) - _PRESET_KEYS)
    if unknown:
        raise MemplanError(f"{path}: unknown field '{unknown[0]}' (expected {', '.join(sorted(_PRESET_KEYS))})")
    if "model" not in data:
        raise MemplanError(f"{path}: missing the 'model:' section")
    model = build(ModelSpec, data["model"], where=f"{path}: model")
    return ModelPreset(model, *_plan_sections(data, path), str(path))


def _plan_sections(data: dict, path: Path) -> tuple[dict, dict, Optional[str]]:
    """A model file's plan (`parallel:`, `training:`, `gpu:`), its keys checked now, so a typo names this file
    rather than surfacing later."""
    parallel = data.get("parallel") or {}
    training = data.get("training") or {}
    for name, section in (("parallel", parallel), ("training", training)):
        if not isinstance(section, dict):
            raise MemplanError(f"{path}: '{name}' must be a mapping of settings")
    build(ParallelSpec, parallel, where=f"{path}: parallel")
    build(TrainingSpec, training, where=f"{path}: training")
    gpu = data.get("gpu")
    if gpu is not None and not isinstance(gpu, str):
        raise MemplanError(f"{path}: gpu: expected a GPU preset name or a YAML file (got {echo(gpu)}); "
                           f"known: {', '.join(gpu_names())}")
    return dict(parallel), dict(training), gpu


def _with_plan(preset: ModelPreset, path: Path) -> ModelPreset:
    """A traced preset (configs/traced/<name>/config.json) with the plan it was published with, when its
    directory has one (plan.yaml: `parallel:`, `training:`, `gpu:` as a model file's, and `model:` overrides of
    what the config.json does not say, such as the training sequence length)."""
    data = _read_yaml(path)
    unknown = sorted(set(data) - _PRESET_KEYS)
    if unknown:
        raise MemplanError(f"{path}: unknown field '{unknown[0]}' (expected {', '.join(sorted(_PRESET_KEYS))})")
    model = preset.model
    if data.get("model"):
        if not isinstance(data["model"], dict):
            raise MemplanError(f"{path}: 'model' must be a mapping of settings")
        model = build(ModelSpec, {**model.model_dump(exclude_defaults=True), **data["model"]},
                      where=f"{path}: model")
    notes = tuple(n for n in preset.notes if not n.startswith("s = ")) if "seq_length" in (data.get("model") or {}) \
        else preset.notes
    return ModelPreset(model, *_plan_sections(data, path), f"{preset.source} + {path}", notes)


def model_names() -> list[str]:
    """The presets: configs/models/*.yaml, and the transformers configs shipped with traced inventories
    (configs/traced/<name>/config.json)."""
    return sorted([p.stem for p in (configs_dir() / "models").glob("*.yaml")] +
                  [p.parent.name for p in (configs_dir() / "traced").glob("*/config.json")])


def gpu_names() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "gpus").glob("*.yaml"))


def load_model(name_or_path: str) -> ModelPreset:
    """A preset by name, or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".json":
        raise MemplanError(f"{name_or_path} is JSON: a transformers config.json goes with --hf-config; "
                           "--model takes a preset name or a YAML file")
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise MemplanError(f"no such model file: {name_or_path}")
        return read_model_file(path)
    preset = configs_dir() / "models" / f"{name_or_path}.yaml"
    hf = configs_dir() / "traced" / name_or_path / "config.json"
    if not preset.is_file() and hf.is_file() and "/" not in name_or_path:
        read = read_hf_config(str(hf))
        read = dataclasses.replace(read, model=read.model.model_copy(update={"name": name_or_path}))
        plan = hf.parent / "plan.yaml"
        return _with_plan(read, plan) if plan.is_file() else read
    if not preset.is_file():
        raise MemplanError(f"unknown model preset '{name_or_path}'; known: {', '.join(model_names())}")
    return read_model_file(preset)


def load_gpu(name_or_path: str) -> GpuSpec:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = configs_dir() / "gpus" / f"{name_or_path}.yaml"
        if not path.is_file():
            raise MemplanError(f"unknown GPU preset '{name_or_path}'; known: {', '.join(gpu_names())}")
    return build(GpuSpec, _read_yaml(path), where=str(path))


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
    training = build(TrainingSpec, {k: v for k, v in settings.items() if k not in _PLAN_KEYS})
    global_batch = _batch(preset, gpus, model.seq_length, global_batch, global_batch_tokens)
    if global_batch is None:
        global_batch = gpus
    if global_batch <= 0:
        raise MemplanError(f"global batch must be positive (got {global_batch})")
    return model, training, global_batch


# transformers architectures whose layer layout memplan models, and how to read their config.json:
# "gpt2" and "llama" have hand-written, measured inventories (terms_hf.py); "traced" families read
# like Llama (RMSNorm, gated MLP, RoPE; Gemma's gate is GeLU-tanh, the same shapes) and their --impl
# hf-* inventories are traced from transformers' code (memplan trace, memplan/traced.py).
HF_ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # the Llama layout (its sliding window does not change what is stored)
    "Qwen2ForCausalLM": "traced",
    "Qwen3ForCausalLM": "traced",
    "GemmaForCausalLM": "traced",
    "Gemma2ForCausalLM": "traced",
    "Gemma3ForCausalLM": "traced",
    "Phi3ForCausalLM": "traced",
    "MixtralForCausalLM": "traced",  # mixture of experts (issue 11): see _read_moe
    "Qwen3MoeForCausalLM": "traced",
    "DeepseekV3ForCausalLM": "traced",  # mixture of experts and multi-head latent attention
}
# Gated activations of the Llama-layout MLP (gate and up projections f wide, the product into down_proj).
_GATED_ACTS = ("silu", "gelu_pytorch_tanh", "gelu")
# The config keys that make a model a mixture of experts; the MoE architectures memplan reads (_read_moe)
# and the key of their routed-expert count. Other MoE architectures are refused.
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_MOE_ARCHITECTURES = {"MixtralForCausalLM": "num_local_experts", "Qwen3MoeForCausalLM": "num_experts",
                      "DeepseekV3ForCausalLM": "n_routed_experts"}
# model types whose attention normalises each head's queries and keys (q_norm, k_norm)
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3")
_QKV_BIAS_TYPES = ("qwen2",)  # Qwen2Attention: q_proj, k_proj, v_proj with bias=True, o_proj without
_SANDWICH_NORM_TYPES = ("gemma2", "gemma3_text", "gemma3")  # post_attention / pre- and post_feedforward norms


# The sequence length a config.json gets when --seq-len is not given: its position limit, capped at
# 8192 (Llama 3's pre-training context; Llama 3.1 allows 131072 positions, reached by a late
# context-extension phase, not the length most runs train with).
HF_DEFAULT_SEQ = 8192


def _probability(data: dict, key: str, default: float, path: Path) -> float:
    """A dropout probability of a config.json: a number in [0, 1]."""
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise MemplanError(f"{path}: {key}: expected a dropout probability between 0 and 1 (got {echo(value)})")
    return float(value)


def _head_dim(data: dict) -> Any:
    """A config's head_dim when it differs from h/a (Mistral-Nemo: 128 with h/a = 160); None when it
    is h/a (many configs state it), so such a model equals its preset."""
    head_dim, h, a = data.get("head_dim"), data.get("hidden_size"), data.get("num_attention_heads")
    if isinstance(h, int) and isinstance(a, int) and a > 0 and not h % a and head_dim == h // a:
        return None
    return head_dim


def _read_moe(data: dict, arch: str, path: Path) -> dict[str, Any]:
    """The ModelSpec fields of a mixture-of-experts config.json (transformers' defaults for missing keys).
    Mixtral: num_local_experts experts of intermediate_size each, top num_experts_per_tok, every layer MoE.
    Qwen3-MoE: num_experts experts of moe_intermediate_size, top num_experts_per_tok; a layer is dense
    (intermediate_size wide) when in mlp_only_layers or when (i + 1) % decoder_sparse_step != 0
    (Qwen3MoeDecoderLayer): memplan models dense layers first only, and refuses other patterns."""
    if arch == "MixtralForCausalLM":
        return dict(num_experts=data.get("num_local_experts", 8), moe_top_k=data.get("num_experts_per_tok", 2))
    if arch == "DeepseekV3ForCausalLM":
        return _read_deepseek_v3(data)
    experts = data.get("num_experts", 128)
    step, dense = data.get("decoder_sparse_step", 1), data.get("mlp_only_layers") or []
    if experts == 0:  # transformers builds every layer dense (Qwen3MoeDecoderLayer: num_experts > 0)
        return {}
    if step != 1:
        raise MemplanError(f"{path}: decoder_sparse_step = {echo(step)}: memplan models an MoE layer in every "
                           "layer after the dense ones (decoder_sparse_step 1, mlp_only_layers [0, ..., k-1])")
    if not isinstance(dense, list) or dense != list(range(len(dense))):
        shown = json.dumps(dense)
        shown = shown if len(shown) <= 60 else shown[:60] + "..."
        raise MemplanError(f"{path}: mlp_only_layers = {shown}: memplan models dense layers first only "
                           "(mlp_only_layers [0, 1, ..., k-1])")
    return dict(num_experts=experts, moe_top_k=data.get("num_experts_per_tok", 8),
                moe_ffn_hidden_size=data.get("moe_intermediate_size", 768), moe_first_dense_layers=len(dense))


def _read_deepseek_v3(data: dict) -> dict[str, Any]:
    """DeepSeek-V3 (DeepseekV3ForCausalLM, transformers' defaults for missing keys): first_k_dense_replace
    dense layers intermediate_size wide, then MoE layers of n_routed_experts experts of moe_intermediate_size,
    top num_experts_per_tok, and n_shared_experts shared ones (one MLP n_shared_experts x moe_intermediate_size
    wide, DeepseekV3MoE); multi-head latent attention. Its multi-token-prediction layer
    (num_nextn_predict_layers, ModelSpec.mtp_layers) is not built by transformers: memplan models it for --impl
    megatron* (memplan/terms_mla.py), not in the parameter total (DeepSeek-V3's 671 B excludes it)."""
    fe, shared = data.get("moe_intermediate_size", 2048), data.get("n_shared_experts", 1)
    both_ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (fe, shared))
    return dict(num_experts=data.get("n_routed_experts", 256), moe_top_k=data.get("num_experts_per_tok", 8),
                moe_ffn_hidden_size=fe, moe_shared_ffn_hidden_size=fe * shared if both_ints else shared,
                moe_first_dense_layers=data.get("first_k_dense_replace", 3),
                kv_lora_rank=data.get("kv_lora_rank", 512), q_lora_rank=data.get("q_lora_rank", 1536),
                qk_nope_head_dim=data.get("qk_nope_head_dim", 128), qk_rope_head_dim=data.get("qk_rope_head_dim", 64),
                v_head_dim=data.get("v_head_dim", 128), mtp_layers=data.get("num_nextn_predict_layers", 0))


def read_hf_config(path_text: str) -> ModelPreset:
    """A transformers config.json read as data (no code runs, nothing is downloaded)."""
    path = Path(path_text)
    text = read_text(path, "config.json")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise MemplanError(f"{path}: not valid JSON (line {err.lineno})") from None
    except RecursionError:
        raise MemplanError(f"{path}: JSON nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise MemplanError(f"{path}: expected a JSON object")
    archs = data.get("architectures") or []
    known = [a for a in archs if a in HF_ARCHITECTURES]
    moe = [k for k in _MOE_KEYS if isinstance(data.get(k), int) and data[k] > 1]
    if moe and not (known and known[0] in _MOE_ARCHITECTURES):
        arch = known[0] if known else ", ".join(archs) or f"model_type {data.get('model_type')!r}"
        raise MemplanError(f"{path}: {arch} with {moe[0]} = {data[moe[0]]}: memplan models the experts of "
                           "Mixtral, Qwen3-MoE and DeepSeek-V3 only (issue 11)")
    if not known:
        name = ", ".join(archs) if archs else f"model_type {data.get('model_type')!r}"
        raise MemplanError(f"{path}: architecture {name} is not one memplan models; known: "
                           f"{', '.join(HF_ARCHITECTURES)}")
    layout = HF_ARCHITECTURES[known[0]]
    name = str(data.get("_name_or_path") or path)
    positions_key = "n_positions" if layout == "gpt2" else "max_position_embeddings"
    positions = data.get(positions_key, 1024 if layout == "gpt2" else 4096)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions <= 0:
        raise MemplanError(f"{path}: {positions_key}: expected a positive integer (got {echo(positions)})")
    seq = min(positions, HF_DEFAULT_SEQ)
    note = (f"s = {seq:,} from the config's {positions_key}" if seq == positions else
            f"s = {seq:,}: the config allows {positions:,} positions ({positions_key}), a context few train "
            f"with from the start; --seq-len sets s")
    try:
        if layout == "gpt2":
            dropout = any(_probability(data, k, 0.1, path) > 0 for k in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
            spec = dict(name=name, num_layers=data["n_layer"], hidden_size=data["n_embd"],
                        num_attention_heads=data["n_head"], seq_length=seq,
                        vocab_size=data["vocab_size"], ffn_hidden_size=data.get("n_inner"), dropout=dropout,
                        tied_embeddings=data.get("tie_word_embeddings", True), attention="eager")
        else:
            act_key = "hidden_activation" if data.get("hidden_activation") else "hidden_act"
            acts = ("silu",) if layout == "llama" else _GATED_ACTS
            if data.get(act_key, "silu") not in acts:
                raise MemplanError(f"{path}: {act_key} {data[act_key]!r}: memplan models the gated MLP with "
                                   f"{' / '.join(acts)}")
            spec = dict(name=name, num_layers=data["num_hidden_layers"], hidden_size=data["hidden_size"],
                        num_attention_heads=data["num_attention_heads"],
                        num_kv_heads=data.get("num_key_value_heads"), ffn_hidden_size=data["intermediate_size"],
                        head_dim=_head_dim(data),
                        seq_length=seq, vocab_size=data["vocab_size"],
                        norm="rmsnorm", mlp="swiglu", position_embedding="rope",
                        tied_embeddings=data.get("tie_word_embeddings", layout == "traced" and
                                                 data.get("model_type", "").startswith("gemma")),
                        dropout=_probability(data, "attention_dropout", 0.0, path) > 0,
                        bias=bool(data.get("attention_bias", False) or data.get("mlp_bias", False)),
                        attention="flash", qk_norm=data.get("model_type") in _QK_NORM_TYPES,
                        qkv_bias=data.get("model_type") in _QKV_BIAS_TYPES,
                        sandwich_norms=data.get("model_type") in _SANDWICH_NORM_TYPES)
            if known[0] in _MOE_ARCHITECTURES:
                spec.update(_read_moe(data, known[0], path))
    except KeyError as err:
        raise MemplanError(f"{path}: missing field {err.args[0]!r} for {known[0]}") from None
    notes = (note,)
    if known[0] == "DeepseekV3ForCausalLM" and data.get("num_nextn_predict_layers"):
        notes += ("the multi-token-prediction layers (num_nextn_predict_layers, Megatron-LM --mtp-num-layers) are "
                  "modelled on the last stage for --impl megatron*, not in the parameter total; transformers' "
                  "DeepseekV3ForCausalLM builds none (--impl hf-*: not counted)",)
    if layout == "traced":
        spec["inventory"], how = inventory_dir(data, text, configs_dir() / "traced")
        notes += (how,)
    model = build(ModelSpec, {k: v for k, v in spec.items() if v is not None}, where=str(path))
    return ModelPreset(model, {}, {}, None, str(path), notes)
