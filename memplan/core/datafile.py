"""The one reader of data files (model and GPU YAML, transformers config.json, traced inventories): bounded text
(size cap, no FIFO, UTF-8), plain YAML and strict JSON, each checked by one walk with the same protections.

What every file gets: at most MAX_FILE_BYTES (or the caller's cap) read; a FIFO or a directory refused before it is
opened; YAML aliases and language tags refused; duplicate keys refused (YAML and JSON); keys that are not strings
refused; integers of more than MAX_INT_DIGITS digits refused (Python's int() of thousands of digits is slow or
refused); YAML 1.1 sexagesimal (1:30) and octal (017, 0o17) numbers and yes / no / on / off booleans refused (YAML 1.2 and people read them
differently); JSON's NaN / Infinity refused (``infinity=True``: Infinity read as a float, for a config.json whose
transformers writer puts it in a bound: Mamba-2's time_step_limit); strings that are not valid Unicode (lone surrogates) refused; nesting
deeper than MAX_DEPTH refused; numbers that are not finite (.nan, .inf, 1e999) refused. Every refusal is one MemplanError line naming the file.
"""

from __future__ import annotations

import json
import math
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from memplan.core.errors import MemplanError

MAX_FILE_BYTES = 1 << 20  # a model, GPU or config.json file is a few KB; /dev/zero is not one
MAX_DEPTH = 64  # the deepest real file (a traced inventory) nests 6 levels
MAX_INT_DIGITS = 30  # 10^30: more than any count or size in bytes memplan can use


def read_text(path: Path, what: str, limit: int = MAX_FILE_BYTES) -> str:
    """A small UTF-8 text file, or a one-line error (missing, a directory, a FIFO, too large, not UTF-8)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as err:
        raise MemplanError(f"cannot read {path}: {err.strerror}") from None
    if stat.S_ISDIR(mode):
        raise MemplanError(f"{path} is a directory, not a {what}")
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise MemplanError(f"{path} is a pipe or socket, not a {what} (give a regular file)")
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as err:
        raise MemplanError(f"cannot read {path}: {err.strerror}") from None
    if len(raw) > limit:
        raise MemplanError(f"{path}: larger than {limit // 1024} KiB: not a {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise MemplanError(f"{path}: not UTF-8 text (byte {err.start})") from None


# libyaml's safe loader where PyYAML was built with it (the same plain data, about 10x faster to parse)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_PLAIN_INT = re.compile(r"[-+]?(0|[1-9][0-9_]*)")
_PLAIN_FLOAT = re.compile(r"[-+]?(\.[0-9_]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+][0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")


class _StrictLoader(SAFE_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader with YAML 1.1's surprises refused: sexagesimal and octal / binary / hex numbers, integers
    of more than MAX_INT_DIGITS digits, duplicate keys and keys that are not strings."""


def _line(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1}"


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if not _PLAIN_INT.fullmatch(text):
        raise MemplanError(f"{_line(node)}: {text[:40]!r} is a YAML 1.1 sexagesimal, octal, binary or hex number: "
                           "write a plain decimal (or quote it as text)")
    if len(text.replace("_", "").lstrip("+-")) > MAX_INT_DIGITS:
        raise MemplanError(f"{_line(node)}: an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text.replace("_", ""))


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node)
    if not _PLAIN_FLOAT.fullmatch(text):
        raise MemplanError(f"{_line(node)}: {text[:40]!r} is a YAML 1.1 sexagesimal number: write a plain decimal")
    value = yaml.SafeLoader.construct_yaml_float(loader, node)
    if not math.isfinite(value):
        raise MemplanError(f"{_line(node)}: {text[:40]!r} is not a finite number")
    return value


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    text = loader.construct_scalar(node)
    if text.lower() not in ("true", "false"):
        raise MemplanError(f"{_line(node)}: {text[:40]!r} is a YAML 1.1 boolean: write true or false (or quote it "
                           "as text)")
    return text.lower() == "true"


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise MemplanError(f"{_line(key_node)}: key {str(key)[:40]!r} is not text (quote it)")
        if key in out:
            raise MemplanError(f"{_line(key_node)}: duplicate key {key[:60]!r}")
        out[key] = loader.construct_object(value_node, deep=True)
    return out


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_StrictLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)
_StrictLoader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)


def load_yaml_text(text: str, where: str) -> Any:
    """Plain YAML data from text (see the module docstring for what is refused)."""
    try:
        # plain data only: anchors and aliases (a "billion laughs" file expands exponentially) and
        # language tags (!!python/...) are refused before anything is built; so is deep nesting
        depth = 0
        for event in yaml.parse(text, Loader=SAFE_LOADER):
            if isinstance(event, yaml.AliasEvent):
                raise MemplanError(f"{where}: line {event.start_mark.line + 1}: YAML aliases (*name) are not "
                                   "supported; write the values out")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise MemplanError(f"{where}: line {event.start_mark.line + 1}: nested deeper than {MAX_DEPTH} "
                                       "levels: not a memplan file")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        data = yaml.load(text, Loader=_StrictLoader)
    except MemplanError as err:
        message = str(err)
        raise MemplanError(message if message.startswith(where) else f"{where}: {message}") from None
    except yaml.constructor.ConstructorError as err:
        mark = err.problem_mark
        raise MemplanError(f"{where}: line {mark.line + 1 if mark else '?'}: {err.problem} (plain YAML data only)"
                           ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise MemplanError(f"{where}:{line} is not valid YAML") from None
    except RecursionError:
        raise MemplanError(f"{where}: nested too deeply to be a memplan file") from None
    check_data(data, where)
    return data


def read_yaml(path: Path, what: str = "YAML file", limit: int = MAX_FILE_BYTES) -> dict:
    """A YAML file holding a mapping, read by load_yaml_text."""
    data = load_yaml_text(read_text(path, what, limit), str(path))
    if not isinstance(data, dict):
        raise MemplanError(f"{path}: expected a mapping at the top level")
    return data


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise MemplanError(f"duplicate key {key[:60]!r}")
        out[key] = value
    return out


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise MemplanError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise MemplanError(f"{text[:40]} is not a finite number")
    return value


def _json_constant(name: str) -> float:
    raise MemplanError(f"{name} is not JSON (write a number)")


def _json_infinity(name: str) -> float:
    if name == "Infinity":
        return math.inf
    return _json_constant(name)


def load_json_text(text: str, where: str, infinity: bool = False) -> Any:
    """Strict JSON data from text (see the module docstring for what is refused; ``infinity``: Infinity allowed)."""
    try:
        data = json.loads(text, object_pairs_hook=_json_pairs, parse_int=_json_int, parse_float=_json_float,
                          parse_constant=_json_infinity if infinity else _json_constant)
    except MemplanError as err:
        raise MemplanError(f"{where}: {err}") from None
    except json.JSONDecodeError as err:
        raise MemplanError(f"{where}: not valid JSON (line {err.lineno})") from None
    except (RecursionError, MemoryError):
        raise MemplanError(f"{where}: JSON nested too deeply to be a config") from None
    check_data(data, where)
    return data


def read_json(path: Path, what: str = "config.json") -> Any:
    """A JSON file, read by load_json_text; Infinity allowed (its callers read transformers' config.json files)."""
    return load_json_text(read_text(path, what), str(path), infinity=True)


def check_data(data: Any, where: str) -> None:
    """Refuse what a parser let through: nesting deeper than MAX_DEPTH, keys that are not text, text that is not
    valid Unicode (lone surrogates: JSON's \\ud800)."""
    stack = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise MemplanError(f"{where}: text {item[:40]!r} is not valid Unicode (a lone surrogate)") from None
        elif isinstance(item, (dict, list)):
            if depth >= MAX_DEPTH:
                raise MemplanError(f"{where}: nested deeper than {MAX_DEPTH} levels: not a memplan file")
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str):
                        raise MemplanError(f"{where}: key {str(key)[:40]!r} is not text")
                    stack.append((key, depth + 1))
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
