"""Where the torch measurement package is: validation/ of a checkout, memplan_validation in a wheel. Finding it
imports nothing; importing it imports torch."""

from __future__ import annotations

import importlib
from typing import Any


def harness() -> Any:
    """The torch measurement package: validation/ of a checkout, memplan_validation in a wheel."""
    try:
        return importlib.import_module("validation")
    except ModuleNotFoundError:
        return importlib.import_module("memplan_validation")
