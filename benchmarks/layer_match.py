"""How much of a decoder layer's recorded allocations memplan's derived allocation stream and the trace of the real
code reproduce (issue 20 item 5), for each CUDA recording given (validation/layer_match.py aligns them; this script
adds memplan's side: validation/ never imports memplan). memplan's stream here is the one derived from the step
timeline (memplan/memory/stream.py), the one a plan without a traced order gets.

    PYTHONPATH=. python benchmarks/layer_match.py tests/data/alloc/cuda/*.json.gz
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from memplan.check.allocator import ALLOCATOR_CASES, MAX_SEQ_CASES
from memplan.check.peak import card_preset, peak_config
from memplan.check.stream_match import memplan_pieces
from memplan.memory.reserved import allocation_stream
from validation import layer_match
from validation.alloc_trace import load


def main(argv: list[str] | None = None) -> int:
    """Print, for each recording given, the middle decoder layer's pieces: recorded requests, the trace's and
    memplan's stream's reproduced ones, the requests the trace misses."""
    p = argparse.ArgumentParser(prog="python benchmarks/layer_match.py", description=__doc__.split("\n")[0])
    p.add_argument("recordings", nargs="+", help="CUDA recordings (tests/data/alloc/cuda/*.json.gz)")
    a = p.parse_args(argv)
    workspace = card_preset("NVIDIA H100 80GB HBM3").workspace_bytes
    traces: dict = {}
    for path in a.recordings:
        rec = load(path)
        c = rec.case
        key = tuple(sorted((k, v) for k, v in c.items() if k in ("h", "f", "a", "g", "L", "v", "head_dim")))
        if key not in traces:
            traces[key] = layer_match.traced_steps(c)
        cases = [x for x in ALLOCATOR_CASES + MAX_SEQ_CASES if x.h == c["h"] and x.L == c["L"]
                 and x.optimizer == c["optimizer"] and x.recompute == c["recompute"]]
        case = dataclasses.replace(cases[0], s=c["s"])
        stream = allocation_stream(peak_config(case), case.impl, "cuda", workspace_bytes=workspace)
        layer = c["L"] // 2
        step = layer_match.match_step(rec.events, traces[key][c["recompute"]], c)
        top = ", ".join(f"{n} x {x:,} B" for x, n in sorted(step.unmatched.items(), key=lambda kv: -kv[1])[:8])
        print(f"{Path(path).name}: the last step (its optimizer step included): {step.recorded} recorded requests, "
              f"the trace reproduces {step.matched} of its {step.traced}; of their allocations and frees "
              f"{step.events_in_order} of {step.events_traced} in the recorded order; not traced (most): {top}")
        print(f"  layer {layer} (from 0)")
        pieces = memplan_pieces(stream, layer)
        for m in layer_match.match_layer(rec.events, traces[key][c["recompute"]], c, layer, pieces):
            print(f"  {m.piece}: {len(m.recorded)} recorded requests; the trace reproduces {m.traced} (of its "
                  f"{m.traced_total}), memplan's stream {m.memplan} (of its {m.memplan_total}); not traced: "
                  f"{', '.join(f'{x:,} B' for x in m.unmatched) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


if __name__ == "__main__":
    raise SystemExit(main())
