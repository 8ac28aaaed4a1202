"""The caching allocator's settings: `AllocatorConfig`, read from the `PYTORCH_CUDA_ALLOC_CONF` /
`PYTORCH_ALLOC_CONF` text by `parse_alloc_conf`, and the size-bucket lookup of
`roundup_power2_divisions`. The allocator's rules that use them live in memplan.memory.allocator.

Followed (PyTorch 2.9-2.11): c10/core/AllocatorConfig.cpp `AcceleratorAllocatorConfig::parseArgs`,
`parseMaxSplitSize`, `parseMaxNonSplitRoundingSize`, `parseGarbageCollectionThreshold`,
`parseRoundUpPower2Divisions`, `parseExpandableSegments`, `roundup_power2_divisions(size)`, and
c10/cuda/CUDAAllocatorConfig.cpp `CUDAAllocatorConfig::parseArgs` (the CUDA-only keys, which do not
change where a tensor lands, and the refusal of an unknown key). The text is lexed as PyTorch's
ConfigTokenizer does: the separators `, : [ ]` are tokens, spaces are dropped.

`memory_fraction` is no part of that text: it is `torch.cuda.set_per_process_memory_fraction`, a
field here because the garbage collection (`garbage_collection_threshold`) runs only when it is set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from memplan.core.errors import MemplanError

MIB = 1 << 20
SIZE_MAX = (1 << 64) - 1  # std::numeric_limits<size_t>::max(): max_split_size unset
LARGE_BUFFER_BYTES = 20 * MIB  # kLargeBuffer, also the minimum of max_split_size_mb and max_non_split_rounding_mb
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: size buckets [1 MiB, 2 MiB), ..., [32 GiB, ...)
ROUNDUP_FIRST_LOG2 = 20  # kRoundUpPowerOfTwoStart = 1 MiB

# Keys PyTorch accepts that do not change where a device tensor lands (pinned host memory, locking).
IGNORED_KEYS = ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
                "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
                "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse")
KNOWN_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions", "expandable_segments",
              "garbage_collection_threshold", "backend") + IGNORED_KEYS

_INT = re.compile(r"[0-9]{1,19}")
_FLOAT = re.compile(r"[0-9]{0,19}(\.[0-9]{0,19})?([eE][-+]?[0-9]{1,3})?")


@dataclass(frozen=True)
class AllocatorConfig:
    """What the caching allocator is told. Defaults are PyTorch's (nothing set).

    max_split_size_bytes: blocks at or above it are never split (SIZE_MAX: unset).
    max_non_split_rounding_bytes: a request >= max_split_size takes a cached block only when the block is
        < request + this (kLargeBuffer, 20 MiB, unless max_non_split_rounding_mb is set).
    roundup_power2_divisions: divisions per power-of-two bucket of 1 MiB, 2 MiB, ... 32 GiB and above (16
        entries; 0 or 1: plain 512-byte rounding).
    expandable_segments: one growing segment per (stream, pool), mapped in 2 MiB / 20 MiB pages.
    garbage_collection_threshold: fraction of the allowed memory above which cached unsplit blocks are freed
        before a new segment is asked for (0: off); effective only with memory_fraction.
    memory_fraction: torch.cuda.set_per_process_memory_fraction (None: not set); the allowed memory is this
        fraction of the capacity the replay is given.
    backend: "native" (modelled) or "cudaMallocAsync" (the driver's pool, not modelled).
    """

    max_split_size_bytes: int = SIZE_MAX
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    memory_fraction: Optional[float] = None
    backend: str = "native"

    def __post_init__(self) -> None:
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS:
            raise MemplanError(f"roundup_power2_divisions needs {ROUNDUP_INTERVALS} buckets, "
                               f"got {len(self.roundup_power2_divisions)}")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise MemplanError(f"memory_fraction {self.memory_fraction!r} is not in (0, 1]")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise MemplanError(f"garbage_collection_threshold {self.garbage_collection_threshold!r} is not in "
                               f"(0.0, 1.0)")
        if self.max_split_size_bytes < LARGE_BUFFER_BYTES:
            raise MemplanError(f"max_split_size_bytes {self.max_split_size_bytes} is below 20 MiB (PyTorch's minimum)")
        if self.max_non_split_rounding_bytes < LARGE_BUFFER_BYTES:
            raise MemplanError(f"max_non_split_rounding_bytes {self.max_non_split_rounding_bytes} is below 20 MiB")

    @property
    def max_split_size_set(self) -> bool:
        return self.max_split_size_bytes != SIZE_MAX


def divisions_for(size: int, config: AllocatorConfig) -> int:
    """The roundup_power2_divisions of the bucket `size` falls in (AcceleratorAllocatorConfig::
    roundup_power2_divisions(size)): bucket floor(log2(size)) - 20, clamped to 0..15."""
    index = size.bit_length() - 1 - ROUNDUP_FIRST_LOG2
    return config.roundup_power2_divisions[min(max(index, 0), ROUNDUP_INTERVALS - 1)]


def _tokens(text: str) -> list[str]:
    """ConfigTokenizer: `, : [ ]` are tokens of their own, spaces vanish, the rest is glued into words."""
    out: list[str] = []
    word: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if word:
                out.append("".join(word))
                word = []
            out.append(ch)
        elif ch != " ":
            word.append(ch)
    if word:
        out.append("".join(word))
    return out


class _Reader:
    """Walks the tokens; every complaint names the key and the value."""

    def __init__(self, text: str):
        self.text = text
        self.toks = _tokens(text)
        self.i = 0

    def fail(self, why: str) -> MemplanError:
        return MemplanError(f"PYTORCH_CUDA_ALLOC_CONF {self.text!r}: {why}")

    def peek(self) -> Optional[str]:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, what: str) -> str:
        tok = self.peek()
        if tok is None:
            raise self.fail(f"expected {what}, the text ends")
        self.i += 1
        return tok

    def expect(self, sep: str, key: str) -> None:
        tok = self.take(f"{sep!r} after {key}")
        if tok != sep:
            raise self.fail(f"expected {sep!r} after {key}, got {tok!r}")

    def integer(self, key: str) -> int:
        tok = self.take(f"a value for {key}")
        if not _INT.fullmatch(tok):
            raise self.fail(f"{key} needs a non-negative integer, got {tok!r}")
        return int(tok)

    def boolean(self, key: str) -> bool:
        tok = self.take(f"True or False for {key}")
        if tok not in ("True", "False"):
            raise self.fail(f"{key} needs True or False, got {tok!r}")
        return tok == "True"


def _megabytes_at_least_20(reader: _Reader, key: str) -> int:
    value = reader.integer(key)
    if value < LARGE_BUFFER_BYTES // MIB:
        raise reader.fail(f"{key} {value} is too small, must be >= {LARGE_BUFFER_BYTES // MIB}")
    return min(value * MIB, SIZE_MAX // MIB * MIB)


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _roundup_divisions(reader: _Reader, key: str) -> tuple[int, ...]:
    """parseRoundUpPower2Divisions: a single power of two for every bucket, or `[MB:div, ..., >:div]` where MB
    (a power of two) names the bucket starting at MB MiB; the first entry also fills every bucket below it and
    `>` every bucket above the last one named (PyTorch 2.9+ `AcceleratorAllocatorConfig`: from last + 1; up to 2.8
    c10/cuda/CUDAAllocatorConfig.cpp filled from the last one itself, overwriting it, and refused 0 divisions in
    the list). So "[256:1,512:2,1024:4,>:8]" gives 1 division to sizes below 512 MiB, 2 to [512 MiB, 1 GiB),
    4 to [1, 2) GiB and 8 above: one bucket higher than PyTorch's documentation words it."""
    if reader.peek() != "[":
        value = reader.integer(key)
        if not _power_of_two(value):
            raise reader.fail(f"{key} {value} is not a power of 2")
        return (value,) * ROUNDUP_INTERVALS
    reader.take("[")
    buckets = [0] * ROUNDUP_INTERVALS
    first, last = True, 0
    while True:
        bound = reader.take(f"a size in MB or '>' inside {key}'s [ ]")
        if bound == "]":
            return tuple(buckets)
        reader.expect(":", f"{key} entry {bound!r}")
        value = reader.integer(f"{key} entry {bound!r}")
        if value != 0 and not _power_of_two(value):
            raise reader.fail(f"{key} entry {bound}:{value}: the divisions must be a power of 2 or 0")
        if bound == ">":
            buckets[last + 1:] = [value] * (ROUNDUP_INTERVALS - last - 1)
        else:
            if not _INT.fullmatch(bound) or not _power_of_two(int(bound)):
                raise reader.fail(f"{key} entry {bound!r}: the size (in MB) must be a power of 2 or '>'")
            index = min(int(bound).bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                buckets[:index] = [value] * index
                first = False
            buckets[index] = value
            last = index
        if reader.peek() is None:
            raise reader.fail(f"{key}'s list is not closed with ']'")
        if reader.peek() != "]":
            reader.expect(",", f"{key} entry {bound}:{value}")


def parse_alloc_conf(text: str, memory_fraction: Optional[float] = None) -> AllocatorConfig:
    """An AllocatorConfig from PYTORCH_CUDA_ALLOC_CONF text, e.g. "max_split_size_mb:512,
    roundup_power2_divisions:[256:1,512:2,1024:4,>:8],expandable_segments:True,garbage_collection_threshold:0.8".
    Keys not set keep PyTorch's defaults; a key given twice keeps its last value (as PyTorch). Bad text raises
    MemplanError naming the key and the value."""
    if not isinstance(text, str):
        raise MemplanError(f"PYTORCH_CUDA_ALLOC_CONF must be text, got {type(text).__name__}")
    reader = _Reader(text)
    fields: dict = {}
    while reader.peek() is not None:
        key = reader.take("a key")
        if key in ",:[]":
            raise reader.fail(f"expected a key, got {key!r}")
        if key not in KNOWN_KEYS:
            raise reader.fail(f"unrecognized key {key!r} (known: {', '.join(KNOWN_KEYS)})")
        reader.expect(":", key)
        if key == "max_split_size_mb":
            fields["max_split_size_bytes"] = _megabytes_at_least_20(reader, key)
        elif key == "max_non_split_rounding_mb":
            fields["max_non_split_rounding_bytes"] = _megabytes_at_least_20(reader, key)
        elif key == "roundup_power2_divisions":
            fields["roundup_power2_divisions"] = _roundup_divisions(reader, key)
        elif key == "expandable_segments":
            fields["expandable_segments"] = reader.boolean(key)
        elif key == "garbage_collection_threshold":
            tok = reader.take(f"a value for {key}")
            value = float(tok) if _FLOAT.fullmatch(tok) and any(c.isdigit() for c in tok) else -1.0
            if not 0.0 < value < 1.0:
                raise reader.fail(f"{key} needs a number in (0.0, 1.0), got {tok!r}")
            fields["garbage_collection_threshold"] = value
        elif key == "backend":
            tok = reader.take(f"a value for {key}")
            if tok not in ("native", "cudaMallocAsync"):
                raise reader.fail(f"backend needs native or cudaMallocAsync, got {tok!r}")
            fields["backend"] = tok
        else:  # accepted, no effect on device blocks: skip its value (a word, or a bracketed list)
            tok = reader.take(f"a value for {key}")
            if tok == "[":
                while reader.take(f"']' closing {key}'s list") != "]":
                    pass
            elif tok in ",:]":
                raise reader.fail(f"expected a value for {key}, got {tok!r}")
        if reader.peek() is not None:
            reader.expect(",", f"{key}'s value")
    return AllocatorConfig(memory_fraction=memory_fraction, **fields)
