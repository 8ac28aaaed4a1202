"""What the megatron-core comparisons (tests/test_validate_mcore*.py) share: every case exact and fully labelled,
and the removal check (each term of the megatron-local CPU inventory the cases hold, removed, makes a case fail)."""

import dataclasses
from typing import Callable

from memplan.inventory import assemble as inventory
from memplan.check.validate import CaseResult, case_model, predict


def assert_exact(results) -> None:
    """Every case within its tolerance, and every saved tensor labelled with a memplan term."""
    assert [(r.case.name, r.mismatched, r.error) for r in results if not r.passed] == []
    for r in results:
        assert "unlabeled" not in r.measured, r.case.name


def term_ids(results, keep: Callable = lambda term: True) -> set[str]:
    """The ids of the megatron-local (CPU) terms of the cases' models that `keep` selects."""
    return {t.id for r in results for t in inventory.inventory_for(case_model(r.case), "megatron-local", "cpu").terms
            if keep(t)}


def _without(term_id: str) -> Callable:
    original = inventory.inventory_for

    def inventory_for(model, impl="megatron", device="cuda", loss_chunks=1):
        inv = original(model, impl, device, loss_chunks)
        return dataclasses.replace(inv, terms=tuple(t for t in inv.terms if t.id != term_id))

    return inventory_for


def unchecked_terms(monkeypatch, results, ids: set[str]) -> list[str]:
    """The terms among `ids` whose removal from the inventory leaves every case passing."""
    unchecked = []
    for term_id in sorted(ids):
        monkeypatch.setattr(inventory, "inventory_for", _without(term_id))
        failed = [r for r in results
                  if not CaseResult(r.case, predict(r.case, "cpu"), r.measured, 0, None, None, r.tolerance).passed]
        monkeypatch.undo()
        if not failed:
            unchecked.append(term_id)
    return unchecked
