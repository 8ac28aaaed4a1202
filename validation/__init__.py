"""Real torch layers and measurements for validating memplan (imports torch, never memplan).

Every number this package returns is read off real (or fake) tensors; none comes from a formula.
"""

from .equivalence import check_tensor_parallel_equivalence
from .measure import Case, Measurement, SavedEntry, measure_layer, measure_many, measure_model, probe_dropout
from .tags import LABELS, LAYER_LABELS, MODEL_LABELS, PARAMETER, UNLABELED, tag

__all__ = [
    "Case", "Measurement", "SavedEntry", "measure_layer", "measure_many", "measure_model",
    "probe_dropout", "check_tensor_parallel_equivalence",
    "LABELS", "LAYER_LABELS", "MODEL_LABELS", "PARAMETER", "UNLABELED", "tag",
]
