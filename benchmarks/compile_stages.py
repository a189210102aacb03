"""Triton's own per-stage times of every kernel compile in this process (`knobs.compilation.listener`),
for `first_call_profile --timeline`: whether a cold first call's compile seconds go to the Python front
end (`ir_initialization`: the kernel's AST turned into TTIR, holding the GIL), the MLIR lowerings
(ttir, ttgir, llir, ptx) or ptxas (cubin, a subprocess). Which of them a thread pool can overlap, and
which only worker processes could, depends on that split."""
from __future__ import annotations

import threading

FRONT_END = "front end"


def install(records: list) -> bool:
    """Append (kernel, cache hit, thread, {stage: ms}) to `records` for each compile from now on; False if
    this Triton has no compilation listener. Chains any listener already installed."""
    try:
        from triton import knobs
    except ImportError:
        return False
    if not hasattr(getattr(knobs, "compilation", None), "listener"):
        return False
    previous = knobs.compilation.listener

    def listen(*, src, metadata, metadata_group, times, cache_hit):
        stages = {FRONT_END: times.ir_initialization / 1000}
        stages.update((name, us / 1000) for name, us in times.lowering_stages)
        stages["store"] = times.store_results / 1000
        records.append((getattr(src, "name", "?"), cache_hit, threading.current_thread().name, stages))
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.compilation.listener = listen
    return True


def table(records: list) -> str:
    """One row per compile (milliseconds per stage) and a total row; '' when nothing compiled."""
    if not records:
        return ""
    stages: list[str] = []
    for _, _, _, times in records:
        stages += [s for s in times if s not in stages]
    width = max(len("total ms"), *(len(r[0]) for r in records)) + 2
    lines = [f"{'kernel':<{width}}{'hit':>4}  " + "".join(f"{s:>10}" for s in stages) + "  thread"]
    for name, hit, thread, times in records:
        cells = "".join(f"{times.get(s, 0.0):10.1f}" for s in stages)
        lines.append(f"{name:<{width}}{'yes' if hit else 'no':>4}  {cells}  {thread}")
    totals = "".join(f"{sum(r[3].get(s, 0.0) for r in records):10.1f}" for s in stages)
    lines.append(f"{'total ms':<{width}}{'':>4}  {totals}")
    return "\n".join(lines)
