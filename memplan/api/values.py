"""Option values as the API and the CLI read them: memory sizes, token counts, --mst, and the checks of --emit
that need no model. Light (core.units and core.errors only): the CLI's option callbacks use it."""

from __future__ import annotations

import math
from typing import Optional, Union

from memplan.core.errors import MemplanError
from memplan.core.model import MAX_LAYERS
from memplan.core.units import check_bytes, parse_size, parse_tokens

Size = Union[int, str, None]


def budget_bytes(value: Size, what: str) -> Optional[int]:
    """A memory budget: an int in bytes or a size such as "80GB" (10^9 bytes) / "80GiB" (2^30 bytes); positive."""
    if value is None:
        return None
    size = value if isinstance(value, int) and not isinstance(value, bool) else parse_size(value)
    if size <= 0:
        raise MemplanError(f"{what}: a memory budget must be positive (got {str(value)[:40]!r})")
    return check_bytes(size, value)


# The largest counts memplan plans for: the divisor enumeration of the plan space walks up to sqrt(n), and a
# cluster of 2^24 GPUs or a batch of 2^32 sequences is far beyond any run.
MOST = {"gpus": 2**24, "global_batch": 2**32, "dp": 2**24, "tp": 2**16, "pp": 2**16, "cp": 2**16, "ep": 2**16,
        "etp": 2**16, "vpp": 2**16, "micro_batch": 2**32, "seq_len": 2**40, "zero_shard": 2**24,
        "recompute_num_layers": 2**16, "loss_chunks": 2**20, "first_stage_layers": 2**16, "last_stage_layers": 2**16,
        "pipeline_layers_per_stage": 2**16, "dp_replicate": 2**24, "mtp": MAX_LAYERS,
        "fp8_amax_history_len": 2**20}
POSITIVE = frozenset(MOST) - {"gpus", "recompute_num_layers", "mtp"}  # --gpus 0: the plan's own message


def bounded_count(value: Optional[int], what: str) -> Optional[int]:
    """A count option (--gpus, --global-batch, --tp, ...): None, or an int no larger than MOST[what] (and at least 1
    where POSITIVE: a size or count of 0 or less is no plan)."""
    if value is None or what not in MOST:
        return value
    if what in POSITIVE and isinstance(value, int) and value < 1:
        raise MemplanError(f"--{what.replace('_', '-')} {value}: at least 1")
    if isinstance(value, int) and not isinstance(value, bool) and value > MOST[what]:
        shown = f"{value:,}" if value < 10**30 else f"of {len(str(value))} digits"
        raise MemplanError(f"--{what.replace('_', '-')} {shown}: at most {MOST[what]:,}")
    return value


def finite(value: Optional[float], what: str) -> Optional[float]:
    """A float option (--frag-margin, --offload-fraction, ...): None or a finite number (NaN and infinity pass
    every range check, so they are refused first)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise MemplanError(f"--{what.replace('_', '-')} {value}: expected a finite number")
    return value


def token_count(value: Union[int, str, None]) -> Optional[int]:
    """A token count: an int, or text such as "4M" (4 x 10^6) or "4Mi" (4 x 2^20)."""
    if value is None:
        return None
    return parse_tokens(str(value))


def mst_pieces(value: Union[int, str, None]) -> Union[int, str, None]:
    """--mst: a number of mini-sequences >= 1, or "auto"."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text != "auto" and not (text.isascii() and text.isdigit() and len(text) <= 9 and int(text) >= 1):
        raise MemplanError(f"--mst takes a number of mini-sequences from 1 to 999,999,999 or 'auto', not "
                           f"{str(value)[:40]!r}")
    return text if text == "auto" else int(text)


def expert_loads(value: Union[str, tuple, None]) -> Optional[tuple[float, ...]]:
    """--moe-expert-loads: comma-separated numbers (each expert's load relative to the average expert)."""
    if value is None or isinstance(value, tuple):
        return value
    try:
        loads = tuple(float(x) for x in str(value).split(","))
    except ValueError:
        loads = ()
    if not loads or not all(math.isfinite(x) for x in loads) or not str(value).isascii():
        raise MemplanError(f"--moe-expert-loads takes comma-separated numbers (each expert's load relative to the "
                           f"average), not {str(value)[:40]!r}")
    return loads


def check_emit(emit: Optional[str], mst: Union[int, str, None], impl: str) -> None:
    """Refuse an --emit that cannot give a launch block for this plan, before any work."""
    if emit not in (None, "megatron", "bridge", "accelerate", "deepspeed", "torchtitan"):
        raise MemplanError(f"--emit takes megatron, bridge, accelerate, deepspeed or torchtitan, not {str(emit)[:40]!r}")
    if (emit == "torchtitan") != (impl == "torchtitan") and emit is not None:  # memplan/launch/titan.py
        raise MemplanError("--emit torchtitan writes torchtitan's config: plan it with --impl torchtitan"
                           if emit == "torchtitan" else f"--impl torchtitan is launched with --emit torchtitan, not "
                           f"--emit {emit}")
    if emit == "torchtitan":
        return
    if emit in ("accelerate", "deepspeed"):  # the HF Trainer's stacks (memplan/launch/trainer.py)
        if not impl.startswith("hf-"):
            raise MemplanError(f"--emit {emit} configures the HF Trainer: plan it with --impl hf-sdpa or hf-eager and "
                               f"--fsdp2 or --deepspeed-zero N (got --impl {impl})")
        return
    if emit and mst not in (None, 1):
        raise MemplanError(f"--emit {emit} cannot express --mst: Megatron-LM has no mini-sequence MLP / LM head "
                           "(MsT is modelled for transformers models, --impl hf-*)")
    if emit and impl not in ("megatron", "megatron-local"):  # megatron-local: --transformer-impl local
        raise MemplanError(f"--emit {emit} launches Megatron-LM: plan it with --impl megatron or megatron-local "
                           f"(got --impl {impl}, whose memory differs)")


def mtp_layers(mtp: Optional[int], impl: str) -> int:
    """--mtp N, torchtitan's num_mtp_layers (0 without): the one check of its --impl, estimate's and search's."""
    if mtp is not None and impl != "torchtitan":
        raise MemplanError("--mtp N is torchtitan's multi-token prediction (--impl torchtitan, DeepSeek-V3); "
                           "Megatron-LM's MTP layers are the model's own (mtp_layers: --mtp-num-layers)")
    return mtp or 0
