"""torchtitan's FSDP2 in memplan's allocation stream (memplan/memory/stream.py `_Run` mixes `FsdpStream` in), as the
recorded real step makes it (validation/titan_alloc.py, tests/test_titan_alloc.py):

* its units (a decoder layer, the final norm + LM head, the input embedding) unsharded by phase (dp_stack.TITAN_HELD,
  dp_stack.titan_regather); of the units in flight at a moment, one is the unit computing, held as each parameter's
  unsharded bf16 storage (FSDP2's ``alloc_storage`` before its copy-out, ``free_storage`` at the reshard: one block a
  parameter tensor), the other the flat all-gather output of the unit gathered with it or ahead (one block: FSDP2 keeps
  it until the next all-gather's wait or copies it out); inside a layer's forward the layer's storages and its flat
  output, in its backward the layer's storages and the prefetched unit's flat output;
* its reduce-scatter input one flat fp32 tensor of the unit (``foreach_reduce``'s chunk_cat): the inventory's parts of
  it (the matrices split by t, the norms not) one allocation, the held previous unit's alike.
"""

from __future__ import annotations

from memplan.inventory.titan_moments import RS_HELD_ID
from memplan.memory.dp_stack import titan_regather
from memplan.memory.stream_params import fit

FLAT_RS = ("reduce_scatter_input", RS_HELD_ID)  # the id prefixes of FSDP2's flat reduce-scatter inputs' parts
UNIT_TABLES = {"layer": ("layer",), "tail": ("last", "head"), "embedding": ("first",)}


class FsdpStream:
    """torchtitan's FSDP2 units and flat reduce-scatter inputs (module docstring), for `_Run`."""

    def _unit_rows(self, unit: str, n: int) -> list:
        """A unit's parameter tensors' unsharded bytes (registration order), fitted to its `n` bytes."""
        wb = self.tr.weight_bytes
        rows = [[name, p * wb] for key in UNIT_TABLES[unit] for _, name, p in self.persistent.tables.get(key, ())]
        return [r for r in fit(rows, n) if r[1] > 0] if rows else [[unit, n]]

    def _hold(self, phase: str, roll: bool = False) -> None:
        """Units out of flight at `phase` freed, then new ones all-gathered (`roll`: a new layer's, every layer unit
        re-made): the last one gathered is held as its parameters' storages when no unit held is, the others as flat
        all-gather outputs."""
        if self.units is None:
            return
        self.phase = phase
        stay, new = titan_regather([u * (not roll or u != "layer") for u, _, _ in self.holding], phase)
        self._free([i for (_, ids, _), kept in zip(self.holding, stay) if not kept for i in ids])
        self.holding = [h for h, kept in zip(self.holding, stay) if kept]
        for k, u in enumerate(new):
            if not (n := int(self.units[u])):
                continue
            split = k == len(new) - 1 and not any(per for _, _, per in self.holding)
            rows = self._unit_rows(u, n) if split else [[f"flat all-gather output ({u})", n]]
            # a flat output's all-gather input: this rank's bf16 shard copied in (foreach_all_gather), freed after it
            shard = -(-n // int(self.plan.shard)) * (not split and int(self.plan.shard) > 1)
            copy_in = [self._alloc(shard, 0, "communication", f"all-gather input ({u})")] if shard else []
            ids = [self._alloc(b, b, "parameter", f"unsharded parameters: {name} ({u})") for name, b in rows]
            self._free(copy_in)
            self.holding.append((u, ids, split))

    def _fsdp_transients(self, ts: list, label: str) -> list:
        """The transients `ts` of a moment, FSDP2's reduce-scatter inputs' parts one flat allocation each."""
        out, flat = [], {}
        for t in ts:
            group = next((g for g in FLAT_RS if t.id.startswith(g)), None)
            if group is None:
                out += self._term(t, "transient", label)
                continue
            req, counted, storages, *_ = self.sizes(t, "transient")
            if group in flat:
                k = flat[group]
                self.events[k] = self.events[k]._replace(size=self.events[k].size + req * storages,
                                                         bytes=self.events[k].bytes + counted * storages)
            else:
                flat[group] = len(self.events)
                out.append(self._alloc(req * storages, counted * storages, "transient",
                                       f"{t.name} (one flat tensor with its parts), {label}"))
        return out
