"""``python -m validation``: print the saved-tensor ledger of a small case (debug aid)."""

from __future__ import annotations

import argparse

from .measure import Case, measure_many


def _table(m) -> str:
    rows = [("label", "shape", "dtype", "bytes", "op", "module")]
    rows += [(e.label, "x".join(map(str, e.shape)), e.dtype, str(e.bytes), e.op, e.module) for e in m.entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines.append("bytes by label (parameters excluded):")
    lines += [f"  {k:<24} {v:>14,}" for k, v in m.saved_bytes_by_label.items()]
    lines.append(f"  {'saved total':<24} {m.saved_bytes_total:>14,}")
    for name in ("retained_after_forward_bytes", "peak_bytes", "loss_bytes", "saved_parameter_bytes"):
        v = getattr(m, name)
        lines.append(f"  {name:<28} {'-' if v is None else f'{v:,}':>10}")
    lines.append(f"  rank {m.rank} of {m.world_size}; ranks agree: {m.ranks_agree}")
    lines += [f"  note: {n}" for n in m.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m validation", description=__doc__)
    p.add_argument("--scope", choices=("layer", "model"), default="layer")
    for name, default in (("s", 64), ("b", 2), ("h", 64), ("a", 4), ("v", 512), ("L", 1), ("t", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--f", type=int, default=None, help="MLP width (default 4h)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (t > 1)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", choices=("ledger", "live", "fake", "cuda"), default="live")
    a = p.parse_args(argv)
    case = Case(s=a.s, b=a.b, h=a.h, a=a.a, f=a.f, v=a.v, L=a.L, t=a.t, sp=a.sp,
                recompute=a.recompute, dtype=a.dtype, backend=a.backend)
    (m,) = measure_many([(case, a.scope)])
    print(f"{a.scope} {case}")
    print(_table(m))


if __name__ == "__main__":
    main()
