"""Traced inventory files: their format, reading and checking them, and finding the one for a config.

`memplan trace` (validation/trace.py) runs a model's own transformers code once under
FakeTensorMode with the sequence length s and the micro-batch b as symbols, and records every
storage autograd saves: its size is an exact polynomial in s and b. The result is a file (format
`memplan-traced-inventory/2`, YAML; /1 files, without the transients, still load) with its origin (transformers and
torch versions, the hash of the config's architecture fields, the kernels it was traced with). This module holds
the file's schema (`TracedFile`), reads and checks a file with no torch (`read_traced`), finds a config's
directory by that hash, whatever metadata the config.json carries (shipped, else the cache: `inventory_dir`)
and loads or traces a file on first use, saying so on stderr (`load`, `trace_to_yaml`);
memplan/inventory/traced.py turns a file into an `Inventory`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from memplan.core.datafile import read_json, read_yaml
from memplan.core.errors import MemplanError
from memplan.core.harness import harness
from memplan.core.model import MAX_LAYERS
from memplan.core.spec_base import describe_validation_error, echo
from memplan.core.symbolic import Poly
from memplan.inventory.step_order import StepOrder, expand
from memplan.inventory.types import Dtype

FORMAT = "memplan-traced-inventory/2"
FORMATS = ("memplan-traced-inventory/1", FORMAT)  # /1: no moments, no checkpoint (read as before)
SYMBOLS = {"s", "b"}


# torch dtypes as the inventory stores them: the activation dtype of the trace follows the
# precision of the plan; the others keep their own size.
# (Term's storage kinds go by element size: 4-byte and 8-byte integers share fp32's and int64's.)
_DTYPES: dict[str, Dtype] = {"float32": "fp32", "int32": "fp32", "uint32": "fp32", "bool": "mask", "uint8": "mask",
                             "int8": "mask", "int64": "int64", "uint64": "int64", "float64": "int64",
                             "complex64": "int64"}  # DeepSeek-V2's rotary embedding: fp32 pairs, 8 bytes
_ACT_DTYPES = ("bfloat16", "float16")


def term_dtype(name: str) -> Dtype:
    """A traced dtype as the inventory stores it: the activation dtype (act) or its own size's kind."""
    return "act" if name in _ACT_DTYPES else _DTYPES[name]


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TracedTerm(_Row):
    id: str
    module: str
    op: str
    dtype: str
    elements: str
    bytes: str
    shared: bool = False


class LayerGroup(_Row):
    layers: list[int]
    terms: list[TracedTerm]


class Origin(_Row):
    transformers: str
    torch: str
    config_sha256: str
    architecture: str
    model_type: str
    impl: Literal["hf-sdpa", "hf-eager"]
    kernels: Literal["cpu", "cuda"]
    dtype: str


class Sized(_Row):
    dtype: str
    elements: str
    bytes: str


class Kept(Sized):
    """A tensor every checkpointed layer is given (gradient checkpointing keeps it through the backward):
    `saved_as` names the shared save that already counts it without checkpointing."""
    arg: str
    layer: int
    saved_as: Optional[str] = None


class Checkpoint(_Row):
    layer_input: Optional[Sized] = None
    kept: list[Kept] = []


class Transient(Sized):
    what: str


class TracedMoment(_Row):
    """One candidate peak of the step, traced (validation/transients.py): after the op `at` of a layer's
    backward (group, recompute none / full) or of the loss / head (scope last), the saves of that layer
    (head) still alive, the saves outside the layers still alive, its own gradients and the transients."""
    scope: Literal["layer", "last"]
    group: Optional[int] = None
    layers: list[int] = []  # a layer moment: the layers (from 0) it happens in
    recompute: Optional[Literal["none", "full"]] = None
    phase: Optional[Literal["loss", "backward"]] = None
    at: str
    alive: list[str]
    outside: list[str]
    grads: list[str] = []
    kept: list[int] = []  # recomputed layers: the checkpoint's kept tensors (indices) still alive
    grad_elements: int
    transients: list[Transient]


class LayerOrder(_Row):
    """One layer of a group's allocations and frees in the real code's order (validation/layer_order.py), traced
    without (`recompute` none) or with gradient checkpointing (full): its `forward`, its `rerun` in the backward and
    its `backward`, each entry an allocation (its bytes, a polynomial in s and b), the free of one of the layer's
    allocations (its index, counted over the pieces in order) or the free of a tensor made outside the layer ("-" and
    its bytes). validation/layer_match.py measures it; memplan's stream reads the whole step's (`StepOrder`)."""
    group: int
    layer: int
    recompute: Literal["none", "full"]
    forward: list[Union[int, str]] = []
    rerun: list[Union[int, str]] = []
    backward: list[Union[int, str]] = []


class TracedFile(_Row):
    format: Literal["memplan-traced-inventory/1", "memplan-traced-inventory/2"]
    origin: Origin
    conditions: list[str] = []  # what the trace assumed about s and b (e.g. "b >= 2"), shown with its origin
    num_layers: int
    layer_groups: list[LayerGroup]
    outside: list[TracedTerm]
    checkpoint: Optional[Checkpoint] = None
    moments: list[TracedMoment] = []
    layer_order: list[LayerOrder] = []  # absent in files traced without --layer-order
    step_order: list[StepOrder] = []  # the whole step's order (memplan/inventory/step_order.py); likewise


# config.json keys that do not change what a training step saves: the file's own metadata, generation and
# tokeniser settings (token ids, use_cache), the checkpoint's storage dtype (the plan sets the precision), the
# init scale and the class list (the tracer builds the *ForCausalLM of model_type). A Hub config.json carries
# them; the traced inventory of the same architecture is found whatever they say (validation/trace.py keeps the
# same list: validation/ never imports memplan; tests/test_traced_key.py checks that the two agree).
METADATA_KEYS = frozenset({
    "transformers_version", "torch_dtype", "dtype", "_name_or_path", "name_or_path", "_commit_hash", "auto_map",
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "cache_implementation", "initializer_range", "tokenizer_class", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "num_labels", "problem_type",
    "task_specific_params", "finetuning_task", "prefix", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "use_return_dict", "torchscript", "generation_config"})


def architecture_fields(data):
    """A config with the metadata keys left out (in nested configs too: text_config, rope_scaling) and
    integral floats written as integers (10000.0 and 10000 are one rope base): what a traced inventory is
    keyed by."""
    if isinstance(data, dict):
        return {k: architecture_fields(v) for k, v in data.items() if k not in METADATA_KEYS}
    if isinstance(data, list):
        return [architecture_fields(v) for v in data]
    if isinstance(data, float) and data.is_integer() and abs(data) < 2 ** 53:
        return int(data)
    return data


def config_sha256(data: dict) -> str:
    """The key a traced inventory records of the config.json it was traced from: sha256 of the config's
    architecture fields (`architecture_fields`) as canonical JSON (keys sorted, no spaces)."""
    canonical = json.dumps(architecture_fields(data), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


MAX_TRACED_BYTES = 16 << 20  # a traced inventory is ~200 KB (DeepSeek-V3); one per layer kind, not per layer


def cache_dir() -> Path:
    """Where inventories traced on first use are kept: $MEMPLAN_CACHE, else ~/.cache/memplan; with HOME empty,
    unset, relative or / (a service account), a directory of this user's in the temporary directory, never
    /.cache or a .cache of the working directory."""
    if os.environ.get("MEMPLAN_CACHE"):
        return Path(os.environ["MEMPLAN_CACHE"]) / "traced"
    home = os.environ.get("HOME", "")
    if home and os.path.isabs(home) and Path(home).resolve() != Path("/"):
        return Path(home) / ".cache" / "memplan" / "traced"
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"memplan-cache-{uid}" / "traced"


# the config.json text of each cache directory inventory_dir named in this process: written there only when an
# inventory is traced into it (load), so reading a config.json (for --impl megatron, say) writes nothing
_PENDING_CONFIGS: dict[str, str] = {}


def inventory_dir(data: dict, text: str, shipped: Path) -> tuple[str, str]:
    """The directory of a config's traced inventories, and a note saying which: a shipped one
    (configs/traced/<name>/, whose config.json has the same architecture fields: `config_sha256`), else one in the cache, where
    `load` traces on first use (the config.json is kept there for it)."""
    sha = config_sha256(data)
    for candidate in sorted(shipped.glob("*/config.json")) if shipped.is_dir() else []:
        try:
            if config_sha256(read_json(candidate)) == sha:
                return str(candidate.parent), f"--impl hf-* uses the traced inventory shipped in {candidate.parent.name}"
        except MemplanError:
            continue
    directory = cache_dir() / sha[:16]
    _PENDING_CONFIGS[str(directory)] = text
    return str(directory), ("no traced inventory ships for this config: --impl hf-* traces transformers' code on "
                            f"first use (needs torch and transformers) into {directory}")


def file_name(impl: str, kernels: str) -> str:
    """The file of one implementation and kernel set in a traced inventory's directory."""
    return f"{impl}-{kernels}.yaml"


def read_traced(path: Path) -> TracedFile:
    """A traced inventory file, checked: unknown or mistyped fields name the field and the file (read with the
    protections of every memplan file: memplan/core/datafile.py)."""
    data = read_yaml(path, "traced inventory", MAX_TRACED_BYTES)
    if data.get("format") not in FORMATS:
        raise MemplanError(f"{path}: not a traced inventory (expected format: {' or '.join(FORMATS)})")
    if isinstance(data.get("num_layers"), int) and not 0 < data["num_layers"] <= MAX_LAYERS:
        raise MemplanError(f"{path}: num_layers must be between 1 and {MAX_LAYERS:,}")
    try:
        traced = TracedFile.model_validate(data)
    except ValidationError as err:
        raise MemplanError(describe_validation_error(err, str(path), tuple(TracedFile.model_fields))) from None
    covered = sorted(i for g in traced.layer_groups for i in g.layers)
    if covered != list(range(traced.num_layers)):
        raise MemplanError(f"{path}: layer_groups must cover layers 0..{traced.num_layers - 1} once each")
    for term in [t for g in traced.layer_groups for t in g.terms] + traced.outside:
        _size(term, path)
    sized = [t for m in traced.moments for t in m.transients] + (traced.checkpoint.kept if traced.checkpoint else [])
    if traced.checkpoint and traced.checkpoint.layer_input:
        sized.append(traced.checkpoint.layer_input)
    for i, row in enumerate(sized):
        _size(TracedTerm(id=f"transient {i}", module="", op="", dtype=row.dtype, elements=row.elements,
                         bytes=row.bytes), path)
    groups = len(traced.layer_groups)
    for m in traced.moments:
        if m.scope == "layer" and (m.group is None or not 0 <= m.group < groups or m.recompute is None):
            raise MemplanError(f"{path}: a layer moment needs its group (0..{groups - 1}) and recompute")
        rows = ({t.id for t in traced.layer_groups[m.group].terms} | {"layer_input"} if m.scope == "layer"
                else {t.id for t in traced.outside})
        unknown = sorted((set(m.alive) - rows) | (set(m.outside) - {t.id for t in traced.outside}))
        if unknown:
            raise MemplanError(f"{path}: moment at {m.at} names saves the file does not have: {', '.join(unknown)}")
    for row in traced.layer_order:
        _check_order(row, groups, path)
    for row in traced.step_order:
        expand(row, traced.num_layers, f"{path}: step_order ({row.recompute})")
    return traced


def _check_order(row: LayerOrder, groups: int, path: Path) -> None:
    """A layer_order row's group exists, its sizes are polynomials in s and b, each free names an allocation made
    before it and not yet freed."""
    if not 0 <= row.group < groups:
        raise MemplanError(f"{path}: layer_order names group {row.group} (the file has 0..{groups - 1})")
    made, freed = 0, set()
    for entry in row.forward + row.rerun + row.backward:
        if isinstance(entry, str):
            _polynomial(TracedTerm(id=f"layer_order of layer {row.layer}", module="", op="", dtype="float32",
                                   elements="0", bytes=entry.removeprefix("-")), "bytes", path)
            made += not entry.startswith("-")
        elif not 0 <= entry < made or entry in freed:
            raise MemplanError(f"{path}: layer_order of layer {row.layer} frees {entry}, not a live allocation")
        else:
            freed.add(entry)


def _size(term: TracedTerm, path: Path) -> Poly:
    """A term's elements as a polynomial in s and b, checked (its bytes too: both are read when it is sized)."""
    poly = _polynomial(term, "elements", path)
    _polynomial(term, "bytes", path)
    if term.dtype not in _DTYPES and term.dtype not in _ACT_DTYPES:
        raise MemplanError(f"{path}: term {term.id[:60]}: dtype {term.dtype[:60]!r} is not one memplan sizes "
                           f"(known: {', '.join(_ACT_DTYPES + tuple(_DTYPES))})")
    return poly


def _polynomial(term: TracedTerm, field: str, path: Path) -> Poly:
    text = getattr(term, field)
    try:
        poly = Poly.parse_sum(text)
    except MemplanError as err:  # a power or coefficient out of bounds (memplan/core/symbolic.py)
        raise MemplanError(f"{path}: term {term.id[:60]}: {field}: {err}") from None
    except (ValueError, ZeroDivisionError, IndexError):
        raise MemplanError(f"{path}: term {term.id[:60]}: {field} {text[:60]!r} is not a polynomial in s "
                           "and b") from None
    extra = {sym for mono, _ in poly.terms for sym, _ in mono} - SYMBOLS
    if extra:
        raise MemplanError(f"{path}: term {term.id[:60]}: {field} use {', '.join(sorted(extra))[:60]} (only s and b)")
    return poly


# model types whose transformers class has no sdpa attention (_supports_sdpa false in transformers 5.x), among the
# architectures memplan reads from a config.json: --impl hf-sdpa is refused before tracing (issue 22)
NO_SDPA = {"gemma2": "Gemma 2 (attention logit soft-capping)", "gpt_oss": "gpt-oss (attention sinks)",
           "vaultgemma": "VaultGemma (attention logit soft-capping)", "granite_swa": "Granite-SWA (attention sinks)",
           "granitemoe_swa": "Granite-MoE-SWA (attention sinks)", "bloom": "BLOOM (ALiBi)", "mpt": "MPT (ALiBi)",
           "gptj": "GPT-J (eager attention only)", "codegen": "CodeGen (eager attention only)",
           "xglm": "XGLM (eager attention only)", "gpt_neo": "GPT-Neo (eager attention only)",
           "openai-gpt": "GPT-1 (eager attention only)", "mamba2": "Mamba-2 (no attention layers: eager only)",
           "mamba": "Mamba (no attention layers: eager only)",
           "falcon_mamba": "Falcon-Mamba (no attention layers: eager only)",
           "megatron-bert": "Megatron-BERT (eager attention only)", "mvp": "MVP (eager attention only)",
           "trocr": "TrOCR (eager attention only)", "bigbird_pegasus": "BigBird-Pegasus (eager attention only)",
           "rembert": "RemBERT (eager attention only)", "roformer": "RoFormer (eager attention only)",
           "flint": "Flint (attention sinks)", "mimo_v2_flash": "MiMo-V2-Flash (attention sinks)",
           "rwkv": "RWKV (no attention layers: eager only)", "xlstm": "xLSTM (no attention layers: eager only)"}


# model types memplan reads from a config.json whose transformers code cannot run in bf16 (the trace's dtype): no
# --impl hf-* inventory; the walk (memplan/check/registry.py EXCLUDED, kind "trace") says the same
NOT_TRACED = {"xlstm": "xLSTM: transformers' torch mLSTM kernel (mlstm_chunkwise_native_autograd, once s reaches its "
                       "chunk_size) multiplies its fp32 states by the bf16 keys, so a bf16 model fails outside autocast "
                       "(RuntimeError: expected m1 and m2 to have the same dtype) and no bf16 trace is made",
              "hrm_text": "HRM: its two stacks (L_module, H_module) run H_cycles x (L_cycles + 1) times a step, the "
                          "first L runs of a cycle without gradients, and the tracer composes one list of "
                          "num_hidden_layers decoder layers run once (ValueError: no ModuleList of that many layers)"}


def check_impl(data: object, impl: str) -> None:
    """Refuse --impl hf-sdpa for a config whose transformers model has no sdpa path, naming the impl that has one, and
    any --impl hf-* for a model whose code no trace runs (NOT_TRACED)."""
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type in NOT_TRACED:
        raise MemplanError(f"{NOT_TRACED[model_type]}: --impl {impl} cannot estimate its activations")
    if impl == "hf-sdpa" and model_type in NO_SDPA:
        raise MemplanError(f"{NO_SDPA[model_type]} has no sdpa attention in transformers: use --impl hf-eager")


@functools.lru_cache(maxsize=64)
def _load(path: str, mtime: float) -> TracedFile:
    return read_traced(Path(path))


def check_traced_file(path_text: str, impl: str, num_layers: int) -> None:
    """A traced inventory file given for a model (--inventory FILE): readable, traced for `impl`, with the model's
    layers."""
    path = Path(path_text)
    if not path.is_file():
        raise MemplanError(f"--inventory {echo(path_text)}: no such file (write one with memplan trace --out FILE)")
    traced = _load(str(path), path.stat().st_mtime)
    if traced.origin.impl != impl:
        raise MemplanError(f"--inventory {echo(path_text)} was traced for --impl {traced.origin.impl}: plan with it, "
                           f"or trace --impl {impl}")
    if traced.num_layers != num_layers:
        raise MemplanError(f"--inventory {echo(path_text)} has {traced.num_layers:,} layers, the model "
                           f"{num_layers:,}: it was traced from another config.json")


def load(directory: str, impl: str, kernels: str) -> TracedFile:
    """The traced file of `impl` in a traced inventory's directory (or the file itself, when ModelSpec.inventory is
    one: --inventory FILE, checked by check_traced_file; its own kernels); else one traced on first use
    into the cache (never into a shipped directory) from the directory's config.json when torch and
    transformers are installed; else a one-line error naming how to make it."""
    if Path(directory).is_file():
        return _load(directory, Path(directory).stat().st_mtime)
    path = Path(directory) / file_name(impl, kernels)
    config = Path(directory) / "config.json"
    if directory in _PENDING_CONFIGS or config.is_file():
        check_impl(json.loads(_PENDING_CONFIGS[directory]) if directory in _PENDING_CONFIGS else read_json(config),
                   impl)
    if not config.is_file() and directory in _PENDING_CONFIGS and _tracer() is not None:
        try:  # the config read in this process, kept in the cache only now that an inventory is traced from it
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(_PENDING_CONFIGS[directory], encoding="utf-8")
        except OSError:
            pass  # a read-only cache: the error below says how to trace by hand
    if not path.is_file() and config.is_file():
        try:
            cached = cache_dir() / config_sha256(read_json(config))[:16] / path.name
        except MemplanError:
            cached = path
        if not cached.is_file():
            _trace_into(config, cached, impl, kernels)
        path = cached if cached.is_file() else path
    if not path.is_file():
        raise MemplanError(f"no traced inventory for --impl {impl} with {kernels} kernels for {config} and no torch "
                           f"+ transformers to trace it (pip install torch==2.13.0 'memplan[trace]'); or trace it "
                           f"elsewhere: memplan trace --hf-config config.json --impl {impl} --kernels {kernels} "
                           f"--out {path}")
    return _load(str(path), path.stat().st_mtime)


def _tracer():
    """The torch harness's tracer (validation/trace.py); None without torch or transformers."""
    try:
        return importlib.import_module(harness().__name__ + ".trace")
    except ImportError:
        return None


def tell(line: str) -> None:
    """A progress line on stderr while transformers' code is traced (seconds, once per config and
    implementation): what is being traced, so a first `--impl hf-*` run does not sit silent."""
    print(f"memplan: {line}", file=sys.stderr, flush=True)


def trace_to_yaml(config_path: str, impl: str, kernels: str) -> str:
    """Trace a config.json with transformers' own code: the inventory file's text."""
    config = Path(config_path)
    config = config / "config.json" if config.is_dir() else config  # a model's directory: its config.json
    if not config.is_file():
        raise MemplanError(f"no such config.json: {config_path}")
    data = read_json(config)
    check_impl(data, impl)
    layers = data.get("num_hidden_layers", data.get("n_layer")) if isinstance(data, dict) else None
    if isinstance(layers, int) and not 0 < layers <= MAX_LAYERS:
        raise MemplanError(f"{config}: {layers:,} layers: memplan traces models of 1 to {MAX_LAYERS:,} layers")
    tracer = _tracer()
    if tracer is None:
        raise MemplanError("memplan trace needs torch and transformers: pip install torch==2.13.0 && "
                           "pip install 'memplan[trace]'")
    try:
        data = tracer.trace_hf_config(str(config), impl=impl, kernels=kernels, progress=tell)
    except Exception as err:  # the real model code's own refusal, or the tracer's (a shape guard)
        first = (str(err).strip().splitlines() or [""])[0]
        raise MemplanError(f"tracing {config} ({impl}, {kernels} kernels) failed: {type(err).__name__}: "
                           f"{first[:300]}") from None
    return tracer.to_yaml(data)


def _trace_into(config: Path, path: Path, impl: str, kernels: str) -> None:
    """Trace `config` and write the inventory to `path`; nothing when torch or transformers is
    missing or the cache cannot be written (load's error then says how)."""
    if _tracer() is None:
        return
    text = trace_to_yaml(str(config), impl, kernels)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError:
        pass


def bucket_bytes(traced: TracedFile, s: int, b: int) -> dict[str, int]:
    """What the trace says each decoder layer saves at (s, b) (storages it shares with other layers
    included, as a measurement of that layer sees them) and what is saved outside the layers only:
    the figures `memplan validate --hf` compares with a real run."""
    values = {"s": s, "b": b}
    out = {}
    for group in traced.layer_groups:
        per_layer = sum(int(Poly.parse_sum(t.bytes).evaluate(values)) for t in group.terms)
        out.update({f"layer {i}": per_layer for i in group.layers})
    out["outside the layers"] = sum(int(Poly.parse_sum(t.bytes).evaluate(values)) for t in traced.outside
                                    if not t.shared)
    return out
