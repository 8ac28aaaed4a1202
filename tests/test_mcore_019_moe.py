"""memplan's MoE inventory for megatron-core 0.19 (`--megatron-core-version 0.19`) against megatron-core 0.19.2's
own MoELayer measured on CPU: the figures in tests/data/mcore_0_19_2_moe.json, recorded by tests/record_mcore_019.py
(its docstring holds the command; CI cannot install 0.19.2, see there). The cases are `validate --mcore`'s
one-process MoE cases (memplan/check/cases.py mcore_moe_cases); what 0.19.2 changed: the alltoall dispatcher's
permute keeps an int64 argsort over tokens x experts instead of the routing map and the dense probabilities."""

import dataclasses
import json
from pathlib import Path

from mcore_checks import unchecked_terms
from memplan.check.cases import mcore_moe_cases
from memplan.check.validate import MCORE_TOLERANCE, CaseResult, predict

DATA = json.loads((Path(__file__).parent / "data" / "mcore_0_19_2_moe.json").read_text())
CASES = [dataclasses.replace(c, mcore_version="0.19") for c in mcore_moe_cases()]


def results(cases=CASES) -> list[CaseResult]:
    return [CaseResult(c, predict(c, "cpu"), DATA["cases"][c.name], 0, None, None, MCORE_TOLERANCE) for c in cases]


def test_fixture_is_megatron_core_0_19_2():
    assert DATA["measured_with"] == ["megatron-core 0.19.2"]
    assert set(DATA["cases"]) == {c.name for c in CASES}


def test_moe_layer_matches_megatron_core_0_19_2():
    assert [(r.case.name, r.mismatched, r.error) for r in results() if not r.passed] == []
    assert not any("unlabeled" in r.measured for r in results())


def test_sort_index_by_hand():
    # 64 tokens x E = 4 experts: the argsort over them, int64: 4 x 64 x 8 B = 2,048; no routing map (bool) and no
    # probabilities scattered to E columns
    default = DATA["cases"]["mcore moe alltoall ep1"]
    assert default["moe_sort_index"] == 2_048
    assert "moe_routing_map" not in default and "moe_probs_dense" not in default


def test_0_16_inventory_fails_0_19_2():
    """The version matters: 0.16.1's inventory misses the sort index (and keeps the routing map) on 0.19.2."""
    old = [CaseResult(c, predict(dataclasses.replace(c, mcore_version="0.16"), "cpu"), DATA["cases"][c.name], 0,
                      None, None, MCORE_TOLERANCE) for c in CASES]
    assert not old[0].passed


def test_sort_index_removed_fails_a_case(monkeypatch):
    assert unchecked_terms(monkeypatch, results(), {"moe_sort_index"}) == []
