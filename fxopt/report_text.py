"""The report as text: what print(fxopt.explain(...)) shows."""
from __future__ import annotations


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def report_to_text(rep) -> str:
    out = []
    if rep.pre_autograd:
        rows = [[p.name, f"{p.seconds * 1000:.2f} ms", p.nodes_before, p.nodes_after,
                 ", ".join(f"{k}={v}" for k, v in p.stats.items() if v)] for p in rep.pre_autograd]
        out.append("== torch-level graph (before autograd) ==")
        out += _table(rows, ["pass", "time", "nodes in", "nodes out", "stats"])
        out += [f"  left as written: {node}: {reason}" for node, reason in rep.pre_autograd_notes]
        out.append("")
    if rep.attention:
        out.append(f"attention sites ({sum(s.fused for s in rep.attention)} of {len(rep.attention)} fused):")
        out += [f"  {site}" for site in rep.attention]
        out.append("")
    if rep.casts:
        out.append(f"casts ({len(rep.casts)}), inserted by the precision pass:")
        out += [f"  {c.node}: {c.from_dtype} -> {c.to_dtype}  ({c.reason})" for c in rep.casts]
        out.append("")
    for g in rep.graphs:
        triton = f", {g.triton_compile_seconds * 1000:.1f} ms of it in Triton" if g.triton_compile_seconds else ""
        out.append(f"== {g.name} graph (kernels for {g.target}) compiled in {g.compile_seconds * 1000:.1f} ms{triton} ==")
        rows = []
        for p in g.passes:
            stats = ", ".join(f"{k}={v}" for k, v in p.stats.items() if v)
            err = "" if p.max_rel_error is None else f"{p.max_rel_error:.2e}"
            rows.append([p.name, f"{p.seconds * 1000:.2f} ms", p.nodes_before, p.nodes_after, stats, err])
        out += _table(rows, ["pass", "time", "nodes in", "nodes out", "stats", "verify err"])
        out.append("")
        if g.kernels:
            out.append(f"kernels ({len(g.kernels)}):")
            for k in g.kernels:
                kind = f"{k.kind}, {k.schedule}" if k.schedule else k.kind
                out.append(f"  {k.name} [{kind}] {len(k.ops)} ops: {', '.join(k.ops)}")
        if g.memory_plan is not None:
            out.append(plan_line(g.memory_plan))
        if g.roofline:
            total = sum(r.seconds for r in g.roofline)
            out.append(f"roofline (least time at H200 ceilings): {total * 1e6:.1f} us in all; largest:")
            for r in sorted(g.roofline, key=lambda r: -r.seconds)[:5]:
                out.append(f"  {r.name} [{r.kind}] {r.flops / 1e6:.2f} MFLOP {r.bytes / 2**20:.2f} MiB "
                           f"{r.intensity:.1f} FLOP/B -> {r.seconds * 1e6:.2f} us ({r.bound}-bound)")
        out += [f"note: {note}" for note in g.notes]
        if g.fallbacks:
            out.append(f"left to ATen ({len(g.fallbacks)}):")
            for node, reason in g.fallbacks:
                out.append(f"  {node}: {reason}")
        out.append("")
    return "\n".join(out)


def plan_line(mp) -> str:
    mib = 2**20
    return (f"memory plan ({mp.strategy}): {len(mp.buffers)} intermediates, naive {mp.naive_bytes / mib:.2f} MiB, "
            f"lower bound {mp.lower_bound_bytes / mib:.2f} MiB, planned arena {mp.planned_bytes / mib:.2f} MiB "
            f"({mp.ratio:.3f}x the bound); " + _plan_use(mp))


def _plan_use(mp) -> str:
    """What the wrapper does with the plan: memory_plan="apply" plans (they list in-place pairs) are followed."""
    if hasattr(mp, "inplace"):
        return (f"the wrapper allocates these buffers from the arena ({len(mp.inplace)} written in place "
                "over a dying one); ATen calls without an out= form allocate their own results")
    return "the wrapper does not use the arena (memory_plan=\"apply\" does): it frees each buffer at its last use"
