"""Consecutive all-reduces of one process group become one coalesced all-reduce per bucket, so a
backward graph issues a few collectives instead of one per gradient.

DDP's python reducer (`optimize_ddp="python_reducer"` under compiled autograd) puts one
`all_reduce(grad / world)` per parameter into the backward graph: 50 for four GPT-2 blocks, each
costing ~140 us of host time (record_param_comms, a work object, an NCCL launch) and a kernel that
waits for the other rank on its own: 34 ms a step on two H200s against 0.7 ms for the same bytes
in one call (benchmarks/results/2026-12-04-h200-c.md). DDP's C++ reducer buckets gradients for the
same reason; so does Inductor on these graphs (its `_fuse_ddp_communication`).

The rewrite: all-reduces that follow each other in the graph's order of collectives, with the same
reduce op, group, dtype and device, on a backend known to take a list (NCCL on CUDA, gloo on the
CPU), gather into buckets of about `Options.all_reduce_bucket_mb`;
each bucket becomes `all_reduce_coalesced([inputs], op, group)` issued where its last member was,
and each member's result is an item of it (its waits unchanged: waiting on one item waits for the
bucket). No copy: the coalesced call takes the gradients as they are, and each result is a tensor of
its own, as before. Collectives keep their order (a bucket never reaches past another collective),
and a member joins a bucket only when nothing before the bucket's issue point waits on an earlier
member or writes in place (the input would be read later than the graph said).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.op_classes import is_collective, is_wait
from ..pass_manager import PassContext, PassResult
from .collective_waits import writes_in_place

_ALL_REDUCE = getattr(getattr(torch.ops, "_c10d_functional", None), "all_reduce", None)
_COALESCED = getattr(getattr(torch.ops, "_c10d_functional", None), "all_reduce_coalesced", None)


def _key(node: fx.Node):
    """What members of one bucket share (reduce op, group, dtype, device), or None where the node is
    not an all-reduce this pass can bucket: a dense tensor with a static size whose only users wait."""
    if _ALL_REDUCE is None or node.op != "call_function" or node.target is not _ALL_REDUCE.default:
        return None
    inp, op, group = node.args
    val = inp.meta.get("val") if isinstance(inp, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided or not isinstance(val.numel(), int):
        return None
    if not node.users or not all(is_wait(u) for u in node.users) or not _coalesces(group, val.device):
        return None
    return (op, group, val.dtype, val.device)


# process-group backends known to all-reduce a list of tensors on a device type: gloo refuses CUDA
# tensors ("ProcessGroupGloo::allreduce_coalesced: unsupported device type cuda", on the H200)
_COALESCING = {"cuda": ("ProcessGroupNCCL", "FakeProcessGroup"), "cpu": ("ProcessGroupGloo", "FakeProcessGroup")}


def _coalesces(group, device: torch.device) -> bool:
    """Whether the group's backend for `device` takes all_reduce_coalesced; False where the group cannot
    be found in this process (a graph compiled away from its job keeps its all-reduces as they are)."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        backend = _resolve_process_group(group)._get_backend(device)
    except Exception:  # no such group here, or a torch without these: leave the all-reduces alone
        return False
    return type(backend).__name__ in _COALESCING.get(device.type, ())


def _nbytes(node: fx.Node) -> int:
    val = node.args[0].meta["val"]
    return val.numel() * val.element_size()


def buckets(gm: fx.GraphModule, cap_bytes: float) -> list[list[fx.Node]]:
    """The buckets (of two or more all-reduces, in graph order) this pass coalesces."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    found, current, key, size, first_wait = [], [], None, 0, None

    def close():
        if len(current) > 1:
            found.append(list(current))
        current.clear()

    for n in gm.graph.nodes:
        k = _key(n)
        if k is None:
            if is_collective(n) and not is_wait(n) or writes_in_place(n):
                close()  # never issue a bucket past another collective, nor read an input after a write
            continue
        if current and (k != key or size >= cap_bytes or first_wait < position[n]):
            close()
        if not current:
            key, size, first_wait = k, 0, len(position)
        current.append(n)
        size += _nbytes(n)
        first_wait = min(first_wait, *(position[u] for u in n.users))
    close()
    return found


def _coalesce(gm: fx.GraphModule, members: list[fx.Node]) -> None:
    last = members[-1]
    _, op, group = last.args
    with gm.graph.inserting_before(last):
        co = gm.graph.call_function(_COALESCED.default, ([m.args[0] for m in members], op, group))
    co.meta["val"] = [m.meta.get("val") for m in members]
    cursor = co
    for i, m in enumerate(members):
        with gm.graph.inserting_after(cursor):
            cursor = item = gm.graph.call_function(operator.getitem, (co, i))
        item.meta.update(m.meta)
        m.replace_all_uses_with(item)
        gm.graph.erase_node(m)


@dataclass(frozen=True)
class BucketAllReduces:
    name: str = "bucket_all_reduces"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        cap = ctx.options.all_reduce_bucket_mb * 2**20
        found = buckets(gm, cap) if cap > 0 and _COALESCED is not None else []
        for members in found:
            _coalesce(gm, members)
        if found:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, bool(found), {"buckets": len(found),
                                            "all_reduces_bucketed": sum(map(len, found))})
