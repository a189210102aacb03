"""Waits on asynchronous collectives move down to where their result is needed, so the communication
runs while the compute after it does.

Graphs from dynamo and compiled autograd wait right after issuing: DDP's python reducer
(`optimize_ddp="python_reducer"` under compiled autograd) puts `all_reduce(grad / world)`, its
`wait_tensor` and the copy of the result into the gradient side by side in the backward graph, so the
compute stream waits for every all-reduce before the backward of the next layer starts. This pass runs
on the final graph (after fusion):
  1. The tail of each wait, the wait and the pure ops computed from it whose values only reach the
     graph's outputs (the copy into the gradient), moves to just before the output, in its order
     (not in graphs that write in place: a tail would pass the writes).
  2. Every other wait moves down to just before the first node that reads its result, and never past
     an op that writes in place (it might write memory the communication still reads) or the output.
Collectives themselves never move: they are issued in the program's order, the same on every rank,
which is what NCCL needs; only the local waits on them do. A collective's input stays alive until its
wait (analysis/liveness._read_until), so no planned buffer takes its memory while it is being sent;
the price is that memory, held longer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..analysis.op_classes import classify, is_collective, is_wait
from ..pass_manager import PassContext, PassResult


def writes_in_place(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _pure(node: fx.Node) -> bool:
    """A computation that may run later without changing anything: a fused kernel or an ATen op that
    neither communicates, writes in place, nor draws random numbers (their order is the generator's)."""
    return (node.op in ("call_function", "call_module") and not is_collective(node)
            and not writes_in_place(node) and classify(node) != "random")


def output_tails(gm: fx.GraphModule) -> list[fx.Node]:
    """The waits, and the pure nodes computed from them, whose values reach only the graph's outputs
    (directly or through each other), in graph order."""
    nodes = list(gm.graph.nodes)
    from_wait = set()
    for n in nodes:
        if is_wait(n) or (_pure(n) and any(a in from_wait for a in n.all_input_nodes)):
            from_wait.add(n)
    tail: set = set()
    for n in reversed(nodes):
        if n in from_wait and n.users and all(u.op == "output" or u in tail for u in n.users):
            tail.add(n)
    return [n for n in nodes if n in tail]


def _sink(wait: fx.Node) -> bool:
    stop = wait.next
    while not (stop.op == "output" or wait in stop.all_input_nodes or writes_in_place(stop)):
        stop = stop.next
    if stop is wait.next:
        return False
    stop.prepend(wait)
    return True


@dataclass
class SinkCollectiveWaits:
    name: str = "sink_collective_waits"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if not any(is_wait(n) for n in gm.graph.nodes):
            return PassResult(gm, False, {})
        output = next(n for n in gm.graph.nodes if n.op == "output")
        # a tail moved to the end would pass every in-place write after it: then only step 2
        in_place = any(writes_in_place(n) for n in gm.graph.nodes)
        tails = [] if in_place else output_tails(gm)
        for n in tails:
            output.prepend(n)
        moved = sum(_sink(w) for w in [n for n in gm.graph.nodes if is_wait(n) and n not in tails])
        if tails or moved:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, bool(tails or moved), {"tail_nodes_deferred": len(tails), "waits_moved": moved})
