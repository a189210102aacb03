"""What a failed CUDA-graph capture leaves behind in torch's device state, undone: the device's
generator marked as capturing, the caching allocator still routing a stream's allocations to the
graph's pool. Without this one refused capture (a graph that syncs with the CPU) breaks every later
random op, every empty_cache, and the process's exit."""
from __future__ import annotations

import torch


def stop_routing(device: int, pool) -> None:
    """torch's capture_end raises (an invalidated capture) before it tells the caching allocator to
    stop routing the capture stream's allocations to the pool; left so, the allocator's next
    empty_cache, or the pool's destruction at exit, fails its "no capture underway" assertion (the
    latter aborts the process). No-op where the routing already ended."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        try:
            end(device, pool)
        except RuntimeError:  # not routed any more
            pass


def release_generator(device: int) -> None:
    """A capture whose end fails leaves the device's default generator marked as capturing, and every
    later random op raises "Offset increment outside graph capture". Give the generator a clone of
    its state (same seed and offset, not capturing). fxopt never captures random ops, so no graph of
    ours reads the abandoned state."""
    gen = torch.cuda.default_generators[device]
    if hasattr(gen, "graphsafe_set_state") and hasattr(gen, "clone_state"):
        gen.graphsafe_set_state(gen.clone_state())
