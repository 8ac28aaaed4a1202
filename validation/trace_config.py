"""The configs the tracer (validation/trace.py) reads: a transformers ``config.json`` loaded, its cache key (the
architecture fields, ``config_sha256``), the ``*ForCausalLM`` built from it, where its decoder layers are, and the
small configs of every family the tracer is checked on (``FAMILIES``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from . import hf as _hf  # sets HF_HUB_OFFLINE before transformers is imported

import torch  # noqa: E402
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # noqa: E402

IMPLS = ("hf-sdpa", "hf-eager")
KERNELS = ("cpu", "cuda")




def load_config(config: dict | str | Path) -> dict:
    """A config.json as a dict (a dict is copied; a str or Path is a path to the JSON file)."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    return json.loads(Path(config).read_text())


# config.json keys that do not change what a training step saves (memplan/inventory/traced_file.py's
# METADATA_KEYS, the key of a traced inventory: validation/ does not import memplan; a test checks they agree)
METADATA_KEYS = frozenset({
    "transformers_version", "torch_dtype", "dtype", "_name_or_path", "name_or_path", "_commit_hash", "auto_map",
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "cache_implementation", "initializer_range", "tokenizer_class", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "num_labels", "problem_type",
    "task_specific_params", "finetuning_task", "prefix", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "use_return_dict", "torchscript", "generation_config"})


def architecture_fields(config):
    """The config without its metadata keys (nested configs too), integral floats as integers."""
    if isinstance(config, dict):
        return {k: architecture_fields(v) for k, v in config.items() if k not in METADATA_KEYS}
    if isinstance(config, list):
        return [architecture_fields(v) for v in config]
    if isinstance(config, float) and config.is_integer() and abs(config) < 2 ** 53:
        return int(config)
    return config


def config_sha256(config: dict) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of a config's architecture fields."""
    text = json.dumps(architecture_fields(config), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def hf_config(config: dict):
    """The transformers config object of a config dict (its ``model_type`` picks the class)."""
    tf = _hf._transformers()
    if "model_type" not in config:
        raise ValueError("the config has no model_type")
    cls = tf.CONFIG_MAPPING[config["model_type"]]
    cfg = cls.from_dict(dict(config))
    cfg.loss_type = "ForCausalLM"  # what the Trainer uses for a causal LM; set to silence the guess
    if getattr(cfg, "languages", None) and getattr(cfg, "default_language", "") is None:  # X-MOD refuses to run
        cfg.default_language = cfg.languages[0]  # without a language: XmodModel.set_default_language's, the first
    return cfg


def build_model(config: dict, impl: str = "hf-sdpa", dtype: str = "bfloat16", experts: str | None = None):
    """``AutoModelForCausalLM.from_config`` in training mode (under a fake mode when one is active);
    ``experts``: transformers' ``experts_implementation`` of MoE models (None: its default)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}")
    tf = _hf._transformers()
    kwargs = {"experts_implementation": experts} if experts else {}
    kwargs.update(dtype=getattr(torch, dtype), attn_implementation=impl.removeprefix("hf-"))
    cfg = hf_config(config)
    try:
        model = _from_config(tf, config, cfg, kwargs)
    except GuardOnDataDependentSymNode:
        # a weight initialiser that reads values under a fake mode (Phi-4-multimodal's vision tower: trunc_normal_'s
        # rejection loop): built without initialising, as fake values are never read (shapes, dtypes are the same)
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = _from_config(tf, config, cfg, kwargs)
    return model.train()


def _from_config(tf, config: dict, cfg, kwargs: dict):
    try:
        return tf.AutoModelForCausalLM.from_config(cfg, **kwargs)
    except ValueError:  # a text model's config the mapping does not name (Emu3TextConfig): the class it configures
        cls = getattr(tf, (config.get("architectures") or [""])[0], None)
        if cls is None or getattr(cls, "config_class", None) is not type(cfg):
            raise
        return cls._from_config(cfg, **kwargs)


def decoder_layers_path(model, num_layers: int) -> str:
    """Module path of the decoder layers' ModuleList (``model.layers``, ``transformer.h``)."""
    found = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers and name]
    if not found:
        raise ValueError(f"no ModuleList of {num_layers} decoder layers in {type(model).__name__}")
    return min(found, key=lambda n: n.count("."))


def scan_chunk(config: dict) -> int:
    """The chunk a Mamba-2 mixer's torch path scans s in (``chunk_size`` / ``mamba_chunk_size`` of the configs with a
    ``time_step_limit``: Mamba-2, Bamba, Nemotron-H, Granite 4 hybrids, Falcon-H1; and Zamba 2's); 1 for other
    models.  The path pads s up to a multiple of it (``pad_size = (chunk - s % chunk) % chunk``): the trace takes s a
    multiple of the chunk (trace_run's ``s_multiple``), the condition ``s % chunk == 0`` in the file, and is exact
    there."""
    if "time_step_limit" not in config and config.get("model_type") != "zamba2":  # Zamba 2's: time_step_min
        return 1
    chunk = config.get("mamba_chunk_size", config.get("chunk_size", 256))  # Nemotron-H: the older name wins
    return chunk if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 1 else 1


def num_hidden_layers(model) -> int:
    return int(model.config.num_hidden_layers)



# ---------------------------------------------------------------------------------------------
# small configs of every family the tracer is checked on (tests/test_trace.py, memplan validate --hf)

def tiny(model_type: str, **kw) -> dict:
    """A small config.json of a family (h = 64, a = 4, g = 2, f = 160, v = 512, 2 layers)."""
    cfg = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 4096,
           "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    cfg.update(kw)
    return cfg


FAMILIES = {
    "qwen2": (tiny("qwen2", tie_word_embeddings=False), "hf-sdpa"),
    "qwen2-eager": (tiny("qwen2", tie_word_embeddings=False), "hf-eager"),
    "qwen3": (tiny("qwen3", head_dim=24, tie_word_embeddings=True), "hf-sdpa"),
    "gemma": (tiny("gemma", head_dim=24), "hf-sdpa"),
    "gemma-eager": (tiny("gemma", head_dim=24), "hf-eager"),
    # Gemma 2 has no sdpa in transformers (logit soft-capping): eager, alternating sliding / global layers
    "gemma2": (tiny("gemma2", head_dim=24, num_hidden_layers=3, sliding_window=16), "hf-eager"),
    # Gemma 3: sliding layers (an explicit mask once s >= the window) beside global ones: two layer groups,
    # each with its own rotary tables (local and global rope bases)
    "gemma3": (tiny("gemma3_text", head_dim=24, num_hidden_layers=4, sliding_window=16, sliding_window_pattern=2),
               "hf-sdpa"),
    "phi3": (tiny("phi3", sliding_window=None), "hf-sdpa"),
    "mistral-window": (tiny("mistral", sliding_window=16), "hf-sdpa"),
    # top-2 of 4 experts, transformers' grouped_mm experts: dropless, k s b tokens through the experts
    "mixtral": (tiny("mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None), "hf-sdpa"),
    # DeepSeek-V3: multi-head latent attention (q / k 24 wide, v 16: CPU sdpa falls back to fp32 math),
    # a dense first layer, then routed (top-2 of 8, grouped) + shared experts
    "deepseek-v3": (tiny("deepseek_v3", num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1,
                         moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                         n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=16, v_head_dim=16, rope_scaling=None), "hf-sdpa"),
}
