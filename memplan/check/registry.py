"""The transformers registry walk (issue 22): every causal-LM architecture of the installed transformers, as a tiny
config.json of its config class's defaults (validation/registry.py), read by memplan (``read_hf_config``) and
compared with transformers' count of the model on the meta device; traced by validation/trace.py, and the trace as
memplan reads it compared with a real CPU run's saved bytes.

``EXCLUDED`` is the one list of the architectures the walk does not pass, each with the reason (docs/reference.md
prints it, ``render_table``); tests/test_registry.py checks every entry against the walk.  ``python -m
memplan.check.registry`` runs the whole walk, tracing the architectures memplan reads (``--all``: every one
that builds; ``--params-only``: none), and prints its summary.  torch is imported
only when a walk runs (``harness()``)."""

from __future__ import annotations

import importlib
import json
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memplan.core.errors import MemplanError
from memplan.check.validate import measured_buckets
from memplan.core.harness import harness
from memplan.inventory.traced_file import NOT_TRACED, TracedFile, bucket_bytes
from memplan.memory.states import total_params
from memplan.presets.hf_config import read_hf_config
from memplan.presets.hf_encoders import NOT_READ

# What each kind of exclusion means: "build" transformers' own config defaults, shrunk, make no config or no model
# (the walk cannot check it); "estimate" memplan refuses the config.json (its parameters, activations); "trace"
# validation/trace.py cannot trace its code with symbolic s and b.
KINDS = ("build", "estimate", "trace")

# why memplan refuses a family (the refusal itself names the architecture and says to write a model YAML)
# the hybrids memplan does not read (memplan/presets/hf_hybrids.py reads the Mamba-2 ones: layer_pattern), by mixer
# Mamba-1 mixers (memplan/presets/hf_mamba1.py): parameters exact; traced with CUDA's mamba-ssm kernels stood in
# (validation/trace_mamba1.py, derived), which no CPU run can check; the walk's CPU trace is refused
_MAMBA1 = ("transformers' torch path of a Mamba-1 mixer loops over s, which a symbolic trace cannot follow: estimated "
           "with mamba-ssm's CUDA kernels' saves stood in (--device cuda; derived, no CPU run to compare)")
# the multimodal models whose text model memplan does not read (memplan/presets/hf_multimodal.py reads the others)
_CODEBOOKS = ("{name}'s decoder over audio codes: num_codebooks token embeddings (vocab_size + 1 rows each) and as "
              "many output heads, input ids (b num_codebooks) x s, a loss per codebook: memplan models one embedding "
              "and one head; and transformers' defaults do not build {cls} from {config} ('{config}' object has no "
              "attribute 'dropout': the class takes the decoder's config)")

EXCLUDED: dict[str, tuple[str, str]] = {
    "blt": ("estimate", "the Byte Latent Transformer: local encoder / decoder, a patcher and hash embeddings around "
                        "the global model"),
    "dbrx": ("trace", "DbrxExperts loops over the experts that received tokens: the forward depends on tensor values "
                      "(TraceRefused)"),
    "deepseek_v4": ("estimate", "DeepSeek-V4: attention sinks, a KV compressor, low-rank output projections and "
                                "hyper-connections (attn_hc, ffn_hc)"),
    "dots3_note": ("estimate", "its text model (dots3_note_text): latent attention with DeepSeek-V3.2's sparse-attention "
                               "indexer (indexer.wq_b, wk, k_norm, weights_proj) on its indexed_attention layers, "
                               "attention set per layer (per_layer_config): not read; its defaults, shrunk, do not build "
                               "either (its vision config's per_layer_config names layers past the second)"),
    "dots3_note_text": ("estimate", "Dots 3 Note: latent attention with DeepSeek-V3.2's sparse-attention indexer "
                                    "(indexer.wq_b, wk, k_norm with bias, weights_proj) on its indexed_attention layers, "
                                    "a gate per head on the attention output (g_proj), a norm on the rotary key "
                                    "(k_rope_only_layernorm) and the sliding layers' own heads and latent rank "
                                    "(per_layer_config): not read"),
    "falcon_mamba": ("trace", _MAMBA1),
    "gemma3n": ("estimate", "its text model is gemma3n_text's (per-layer embeddings, AltUp, LAuReL, KV sharing: not "
                            "read); its vision tower (TimmWrapperModel) needs the timm library to build"),
    "gemma3n_text": ("estimate", "Gemma 3n: per-layer embeddings, AltUp and LAuReL blocks, KV-sharing layers; its "
                                 "defaults, shrunk, do not build"),
    "gemma4_assistant": ("estimate", "a speculative-decoding drafter: every layer reuses its target model's keys and "
                                     "values (memplan estimates the target); transformers itself builds none from its "
                                     "config (kv_sharing_modes: no layer of its own stores the K / V every layer "
                                     "reuses)"),
    "gemma4_unified_assistant": ("estimate", "a speculative-decoding drafter: every layer reuses its target model's "
                                             "keys and values (memplan estimates the target)"),
    "git": ("estimate", NOT_READ["GitForCausalLM"] + ": not read"),
    "hrm_text": ("trace", NOT_TRACED["hrm_text"]),
    "hy_v4": ("estimate", "Hunyuan 4: attention sinks, latent attention with an indexer, hyper-connections (attn_hc, "
                          "ffn_hc)"),
    "inkling2_text": ("estimate", "Inkling 2: short convolutions on K / V and after each sub-layer, relative logits, "
                                  "an embedding norm"),
    "inkling_text": ("estimate", "Inkling: short convolutions on K / V and after each sub-layer, relative logits, an "
                                 "embedding norm"),
    "jamba": ("trace", _MAMBA1),
    "jetmoe": ("trace", "TraceRefused: the size of a saved tensor depends on data (JetMoeTopKGating's "
                        "expert_size.tolist() splits the tokens by the routing; the mixture of attention experts' "
                        "index_add saves by those counts); its parameters are read exactly"),
    "longcat_flash": ("estimate", "LongCat-Flash: two latent-attention blocks per layer and zero-computation experts "
                                  "in the router"),
    "mamba": ("trace", _MAMBA1),
    "minimax_m3_vl_text": ("estimate", "MiniMax-M3's text model: a block-sparse lightning indexer of its own "
                                       "(indexer.q_proj h x H_i D_i, k_proj h x D_i, q / k norms; no query latent) in "
                                       "the layers layer_types marks minimax_m3_sparse (none in the config class's "
                                       "defaults: the walk's tiny model has none to check), experts "
                                       "intermediate_size wide beside dense_intermediate_size and "
                                       "shared_intermediate_size MLPs: not read"),
    "musicgen": ("estimate", _CODEBOOKS.format(name="MusicGen", cls="MusicgenForCausalLM", config="MusicgenConfig")),
    "musicgen_melody": ("estimate", _CODEBOOKS.format(name="MusicGen Melody", cls="MusicgenMelodyForCausalLM",
                                                      config="MusicgenMelodyConfig")),
    "qwen4_exp": ("estimate", "its text model (qwen4_exp_text): hyper-connections, gated DeltaNet layers beside "
                              "attention with a QSA token indexer: not read"),
    "qwen4_exp_text": ("estimate", "Qwen4-Exp: hyper-connections (hc_count residual streams mixed around each "
                                   "sub-layer: attn_ / mlp_hyper_connection, hyper_connection_mixer), gated DeltaNet "
                                   "layers beside output-gated attention with a QSA token indexer (index_qk_proj, q / k "
                                   "layernorms), n-gram per-layer embeddings where ple_layer_ids names layers: not "
                                   "read"),
    "reformer": ("estimate", "Reformer: LSH / local attention and reversible layers; its defaults do not build as a "
                             "decoder (is_decoder false)"),
    "xlnet": ("estimate", "XLNet: two-stream relative attention (r, r_r_bias, r_s_bias, r_w_bias, seg_embed per "
                          "layer) and a mask embedding"),
    "xlstm": ("trace", NOT_TRACED["xlstm"]),
    "zamba": ("trace", _MAMBA1),
    "zaya": ("estimate", "ZAYA: compressed convolutional attention (convolutions over q / k, current and delayed V "
                         "projections, a learned q / k temperature), an MLP router (gate.router_mlp) and learned "
                         "residual scales and biases: not read"),
}


@dataclass
class Row:
    """One architecture of the walk."""
    model_type: str
    architecture: str
    meta_params: Optional[int] = None  # transformers' count on the meta device
    memplan_params: Optional[int] = None  # read_hf_config's count
    refused: Optional[str] = None  # memplan's refusal, or the config class's error
    config_made: bool = True  # the config class accepts its defaults, shrunk
    built: Optional[bool] = None  # the model builds on the meta device (None: not tried)
    build_error: Optional[str] = None
    traced: Optional[bool] = None
    trace_error: Optional[str] = None
    measured: Optional[bool] = None  # the trace's saved bytes equal a real CPU run's, bucket by bucket
    trace_cpu_s: Optional[float] = None  # CPU seconds of the trace and the real run

    @property
    def estimated(self) -> bool:
        return self.memplan_params is not None


def _walker() -> Any:
    return importlib.import_module(harness().__name__ + ".registry")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:160]


def memplan_params(config: dict) -> int:
    """memplan's parameter count of a config.json (read_hf_config on the file); MemplanError when it refuses."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(config))
        return total_params(read_hf_config(str(path)).model)


def params_row(model_type: str, architecture: str, build_all: bool = True) -> tuple[Row, Optional[dict]]:
    """The parameter half of the walk for one architecture, and its tiny config (None when it does not build).
    ``build_all`` False: the model is built (on the meta device) only when memplan reads the config."""
    walker = _walker()
    row = Row(model_type, architecture)
    try:
        config = walker.tiny_config(model_type)
    except Exception as err:  # transformers' own config class refuses its defaults, shrunk: recorded, not raised
        row.config_made, row.built, row.refused = False, False, _first_line(err)
        return row, None
    try:
        row.memplan_params = memplan_params(config)
    except MemplanError as err:
        row.refused = str(err).split(": ", 1)[-1].split("; describe it")[0][:160]
    if not (row.estimated or build_all):
        return row, None
    try:
        row.meta_params = walker.meta_params(config)
    except Exception as err:  # transformers' own defaults, shrunk, do not build: recorded, not raised
        row.built, row.build_error = False, _first_line(err)
        return row, None
    row.built = True
    return row, config


class _OverTime(Exception):
    pass


def _over_time(signum: int, frame: Any) -> None:
    raise _OverTime


def trace_row(row: Row, config: dict, s: int = 32, b: int = 2, cpu_limit_s: float = 0) -> Row:
    """The trace half: traced (saved tensors only), then memplan's reading of the trace against a real CPU run;
    ``cpu_limit_s`` > 0: a trace that takes more CPU seconds is stopped and recorded as not traced."""
    walker = _walker()
    if cpu_limit_s:
        signal.signal(signal.SIGPROF, _over_time)
        signal.setitimer(signal.ITIMER_PROF, cpu_limit_s)
    try:
        data = walker.trace(config)
    except _OverTime:
        row.traced, row.trace_error = False, f"the trace took over {cpu_limit_s:g} s of CPU (stopped)"
        return row
    except Exception as err:  # the tracer's refusals and transformers' own errors alike: recorded
        row.traced, row.trace_error = False, _first_line(err)
        return row
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    row.traced = True
    traced = TracedFile.model_validate(data)
    s = measured_s(traced, s)
    predicted = bucket_bytes(traced, s, b)
    row.measured = predicted == measured_buckets(walker.measure(config, s, b))
    return row


def measured_s(traced: TracedFile, s: int) -> int:
    """The s a trace is checked at: ``s``, or the least s its conditions allow when they need a multiple of a chunk
    ("s % m == 0", "s >= n": a gated DeltaNet's fitted trace, 2 chunks of 64)."""
    multiple = max([int(c.split("%")[1].split("==")[0]) for c in traced.conditions
                    if re.fullmatch(r"s % \d+ == 0", c)] or [1])
    least = max([int(c.split(">=")[1]) for c in traced.conditions if re.fullmatch(r"s >= \d+", c)] or [s])
    return s if s % multiple == 0 and s >= least else max(least, multiple * -(-s // multiple))


def walk(trace: str = "none", only: Optional[list[str]] = None, progress: Any = None,
         cpu_limit_s: float = 0, build_all: bool = True) -> list[Row]:
    """Every architecture of transformers' causal-LM mapping (``only``: those model types); ``trace``: "none",
    "estimated" (those memplan reads: what --impl hf-* traces) or "all" (every one that builds); ``progress`` is
    told each row's line as it is walked."""
    rows = []
    for model_type, architecture in _walker().architectures().items():
        if only is not None and model_type not in only:
            continue
        row, config = params_row(model_type, architecture, build_all)
        if config is not None and (trace == "all" or trace == "estimated" and row.estimated):
            started = time.process_time()
            trace_row(row, config, cpu_limit_s=cpu_limit_s)
            row.trace_cpu_s = time.process_time() - started
        rows.append(row)
        if progress is not None:
            progress(row_line(row))
    return rows


def excluded_as_walked(row: Row) -> Optional[str]:
    """The kind of exclusion a walked row shows (None: it passes), for checking EXCLUDED."""
    if not row.config_made:
        return "build"
    if not row.estimated:
        return "estimate"
    if row.built is False:
        return "build"
    if row.traced is False:
        return "trace"
    return None


def render_table() -> str:
    """EXCLUDED as the Markdown table docs/reference.md prints."""
    lines = ["| model_type | class | not | why |", "|---|---|---|---|"]
    for model_type, (kind, why) in sorted(EXCLUDED.items()):
        why = f"`{why}`" if kind != "estimate" else why  # an error's own text, as code
        lines.append(f"| `{model_type}` | {_walker().architectures().get(model_type, '?')} | {kind} | {why} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> list[str]:
    """The walk's printed summary: counts, then one line per architecture."""
    estimated = [r for r in rows if r.estimated]
    exact = [r for r in estimated if r.memplan_params == r.meta_params]
    traced = [r for r in rows if r.traced]
    measured = [r for r in rows if r.measured]
    out = [f"{len(rows)} causal-LM architectures; {sum(r.built is True for r in rows)} built from their config "
           f"defaults, shrunk; {len(estimated)} estimated by memplan, {len(exact)} with transformers' exact parameter count; "
           f"{len(traced)} traced; {len(measured)} traces equal to a real CPU run's saved bytes (s = 32, b = 2; a fitted "
           f"trace's at s = 128: measured_s)"]
    return out + [row_line(r) for r in rows]


def row_line(r: Row) -> str:
    """One architecture's line of the summary."""
    params = (f"params {r.memplan_params:,} (meta {r.meta_params:,})" if r.estimated else
              f"not estimated: {r.refused}" if r.config_made else f"no config: {r.refused}")
    params += f"; not built: {r.build_error}" if r.built is False and r.config_made else ""
    traced = ("" if r.traced is None else "; traced, saved bytes " + ("equal" if r.measured else "DIFFER")
              if r.traced else f"; not traced: {r.trace_error}")
    traced += f" ({r.trace_cpu_s:.1f} s of CPU)" if r.trace_cpu_s is not None else ""
    return f"{r.model_type:26s} {params}{traced}"


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    trace = "none" if "--params-only" in args else "all" if "--all" in args else "estimated"
    rows = walk(trace=trace, only=[a for a in args if not a.startswith("--")] or None,
                progress=lambda line: print(line, file=sys.stderr, flush=True), cpu_limit_s=60)
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
