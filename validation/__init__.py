"""Real torch layers and measurements for validating memplan (imports torch, never memplan).

Every number this package returns is read off real (or fake) tensors; none comes from a formula.
"""

from .equivalence import check_tensor_parallel_equivalence
from .instruments import SavedEntry
from .measure import Case, Measurement, measure_layer, measure_many, measure_model, probe_dropout
from .tags import LABELS, LAYER_LABELS, MODEL_LABELS, PARAMETER, UNLABELED, tag


def measure_hf(*args, **kwargs):
    """``validation.hf.measure_hf`` (imported on first use: it needs HF transformers)."""
    from .hf import measure_hf as _measure_hf

    return _measure_hf(*args, **kwargs)


__all__ = [
    "Case", "Measurement", "SavedEntry", "measure_layer", "measure_many", "measure_model",
    "probe_dropout", "check_tensor_parallel_equivalence", "measure_hf",
    "LABELS", "LAYER_LABELS", "MODEL_LABELS", "PARAMETER", "UNLABELED", "tag",
]
