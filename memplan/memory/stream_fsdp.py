"""torchtitan's FSDP2 in memplan's allocation stream (memplan/memory/stream.py `_Run` mixes `FsdpStream` in), as the
recorded real step makes it (validation/titan_alloc.py, tests/test_titan_alloc.py):

* its units (a decoder layer, the final norm + LM head, the input embedding) unsharded by phase (dp_stack.TITAN_HELD,
  dp_stack.titan_regather); of the units in flight at a moment, one is the unit computing, held as each parameter's
  unsharded bf16 storage (FSDP2's ``alloc_storage`` before its copy-out, ``free_storage`` at the reshard: one block a
  parameter tensor), the other the flat all-gather output of the unit gathered with it or ahead (one block: FSDP2 keeps
  it until the next all-gather's wait or copies it out); inside a layer's forward the layer's storages and its flat
  output, in its backward the layer's storages and the prefetched unit's flat output; a phase's computing unit held
  flat (the embedding prefetched for its backward, `COMPUTING`) copied out into its storages (32 ``alloc_storage`` in
  the recorded step, memplan's in the same order and sizes);
* a dense layer's bf16 weight gradients (the inventory's moments list what is alive at each as lumps: w1, w2, w3 at
  ffn_norm's backward, with wo at the attention's, ...) one tensor per parameter, made at the first moment that lists
  it and kept to the reduce-scatter (autograd's, until FSDP2's chunk_cat copies them into its flat input);
* its reduce-scatter input one flat fp32 tensor of the unit (``foreach_reduce``'s chunk_cat): the inventory's parts of
  it (the matrices split by t, the norms not) one allocation, made at the unit's reduce-scatter once the previous
  unit's is freed and held through the next unit's backward (torch 2.13's post_backward keeps it: the inventory's
  held terms stand for it there, at the last layer the tail's), freed before the embedding's backward.

The embedding's unit is gathered for its forward (stream.py `_forward`); a dense Llama 3 layer's parameter tensors
are in its registration order with w1 and w3 apart (stream_params.titan_layer_rows).
"""

from __future__ import annotations

from memplan.inventory.titan_moments import RS_HELD_ID
from memplan.memory.dp_stack import titan_regather

FLAT_RS = ("reduce_scatter_input", RS_HELD_ID)  # the id prefixes of FSDP2's flat reduce-scatter inputs' parts
# a dense torchtitan layer's weight-gradient terms (memplan/inventory/titan_moments.py) and the parameters each covers
WGRADS = {"grad_w2_weight": ("w2",), "grad_ffn_weights": ("w1", "w2", "w3"), "grad_ffn_norm_weight": ("ffn_norm",),
          "grad_ffn_wo_weights": ("w1", "w2", "w3", "wo"), "grad_layer": ("wqkv", "wo", "w1", "w2", "w3"),
          "grad_layer_norms": ("attention_norm", "ffn_norm")}
COMPUTING = {"embedding": "embedding", "loss": "tail", "head": "tail"}  # a phase's unit computing alone or first
UNIT_TABLES = {"layer": ("layer",), "tail": ("last", "head"), "embedding": ("first",)}


class FsdpStream:
    """torchtitan's FSDP2 units and flat reduce-scatter inputs (module docstring), for `_Run`."""

    def _unit_rows(self, unit: str, n: int) -> list:
        """A unit's parameter tensors' unsharded bytes (registration order), fitted to its `n` bytes."""
        wb = self.tr.weight_bytes
        rows = [[name, p * wb] for key in UNIT_TABLES[unit] for _, name, p in self.persistent.tables.get(key, ())]
        # gathered otherwise than in the weights' dtype (float8 tensorwise's all-gather): one block
        return [r for r in rows if r[1] > 0] if sum(r[1] for r in rows) == n else [[unit, n]]

    def _hold(self, phase: str, roll: bool = False) -> None:
        """Units out of flight at `phase` freed, then new ones all-gathered (`roll`: a new layer's, every layer unit
        re-made): the last one gathered is held as its parameters' storages when no unit held is, the others as flat
        all-gather outputs."""
        if self.units is None:
            return
        self.phase = phase
        stay, new = titan_regather([u * (not roll or u != "layer") for u, _, _ in self.holding], phase)
        # the units leaving: the resharded one's storages freed first, a flat output after the new gathers (FSDP2
        # keeps the last all-gather's output until the next all-gather's wait: recorded)
        self._free([i for (_, ids, per), kept in zip(self.holding, stay) if not kept and per for i in ids])
        late = [i for (_, ids, per), kept in zip(self.holding, stay) if not kept and not per for i in ids]
        self.holding = [h for h, kept in zip(self.holding, stay) if kept]
        for k, (u, ids, per) in enumerate(self.holding):  # the unit computing held as a flat output: copied out
            if u == COMPUTING.get(phase) and not per:
                rows = self._unit_rows(u, int(self.units[u]))
                self.holding[k] = (u, [self._alloc(b, b, "parameter", f"unsharded parameters: {name} ({u})")
                                       for name, b in rows], True)
                self._free(ids)
        for k, u in enumerate(new):
            if not (n := int(self.units[u])):
                continue
            split = k == len(new) - 1 and not any(per for _, _, per in self.holding)
            # a unit gathered now whose flat output is not kept (its storages alone held): its all-gather's flat
            # output made and freed around the copy-out (FSDP2 drops it at the next wait: derived as at once)
            source = self._gather(u, n, counted=0) if split and new.count(u) == 1 else []
            rows = self._unit_rows(u, n) if split else []
            ids = [self._alloc(b, b, "parameter", f"unsharded parameters: {name} ({u})") for name, b in rows]
            self.holding.append((u, ids or self._gather(u, n, n), split))
            self._free(source)
        self._free(late)

    def _gather(self, unit: str, n: int, counted: int) -> list:
        """A unit's all-gather: this rank's bf16 shard copied in (foreach_all_gather), the flat output, the input
        freed; the output's id."""
        shard = -(-n // int(self.plan.shard)) * (int(self.plan.shard) > 1)
        copy_in = [self._alloc(shard, 0, "communication", f"all-gather input ({unit})")] if shard else []
        out = [self._alloc(n, counted, "parameter", f"unsharded parameters: flat all-gather output ({unit})")]
        self._free(copy_in)
        return out

    def _weight_grads(self, ts: list, label: str) -> list:
        """A dense layer's weight-gradient terms among `ts` as one tensor per parameter (module docstring): those
        alive and not listed freed, those listed and not alive made (a lump's bytes less its parameters' alive, shared
        equally by those it makes); the ids alive kept in `self.wgrads` (parameter -> (id, size, counted))."""
        listed = [t for t in ts if t.id in WGRADS]
        params = {p for t in listed for p in WGRADS[t.id]}
        gone = [p for p in self.wgrads if p not in params]
        self._free([self.wgrads.pop(p)[0] for p in gone])
        for t in listed:
            req, counted, storages, *_ = self.sizes(t, "transient")
            alive = [self.wgrads[p] for p in WGRADS[t.id] if p in self.wgrads]
            new = [p for p in WGRADS[t.id] if p not in self.wgrads]
            left, left_c = req * storages - sum(a[1] for a in alive), counted * storages - sum(a[2] for a in alive)
            for k, p in enumerate(new):
                n, c = left // (len(new) - k), left_c // (len(new) - k)
                left, left_c = left - n, left_c - c
                self.wgrads[p] = (self._alloc(n, c, "gradient", f"{p}'s weight gradient (bf16), {label}"), n, c)
        return [t for t in ts if t.id not in WGRADS]

    def _fsdp_transients(self, ts: list, label: str, last: bool = False, tail_rs: int = 0) -> list:
        """The transients `ts` of a moment: FSDP2's reduce-scatter input one flat allocation of its parts, made at
        the unit's reduce-scatter (`last`) once the previous unit's is freed and held (`self.rs_carry`) through the
        next unit's moments, where the inventory's held terms (`tail_rs`: the tail's bytes) stand for it; a dense
        layer's weight gradients carried from moment to moment to the reduce-scatter."""
        out, flat = [], {}
        if self.carry_grads:
            ts = self._weight_grads(ts, label)
            if last:
                out += [self.wgrads.pop(p)[0] for p in list(self.wgrads)]
        if tail_rs and self.rs_carry is None:
            self.rs_carry = self._alloc(tail_rs, tail_rs, "transient", f"the tail's held reduce-scatter input, {label}")
        held = self.rs_carry is not None
        if last and held:
            self._free([self.rs_carry])
            self.rs_carry = None
        for t in ts:
            group = next((g for g in FLAT_RS if t.id.startswith(g)), None)
            if group is None:
                out += self._term(t, "transient", label)
                continue
            if group == RS_HELD_ID and held:  # the carried tensor stands for it
                continue
            req, counted, storages, *_ = self.sizes(t, "transient")
            if group in flat:
                k = flat[group]
                self.events[k] = self.events[k]._replace(size=self.events[k].size + req * storages,
                                                         bytes=self.events[k].bytes + counted * storages)
            else:
                flat[group] = len(self.events)
                self.rs_carry = self._alloc(req * storages, counted * storages, "transient",
                                            f"{t.name} (one flat tensor with its parts), {label}")
        return out
