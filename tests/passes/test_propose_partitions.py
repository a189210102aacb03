"""fxopt's partitioner proposes the groups torch.fx's CapabilityBasedPartitioner (skip_horizontal_fusion)
proposes, wherever torch's groups can all be fused; where torch's would make a cycle, fxopt's never do."""
from __future__ import annotations

import inspect
import operator
import random

import pytest
import torch
import torch.fx as fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from fxopt.passes.fuse_partitions import _contractible, fuse_partitions
from fxopt.passes.propose_partitions import propose_partitions

_HAS_SKIP = "skip_horizontal_fusion" in inspect.signature(CapabilityBasedPartitioner).parameters


class _Named(OperatorSupportBase):
    def __init__(self, names):
        self.names = names

    def is_node_supported(self, submodules, node):
        return node.name in self.names


def _random_graph(rng: random.Random, n_ops: int) -> tuple[fx.GraphModule, set]:
    """A random DAG of binary/unary ops over three inputs; about half the ops supported."""
    g = fx.Graph()
    values = [g.placeholder(f"x{i}") for i in range(3)]
    supported = set()
    for _ in range(n_ops):
        window = values[-8:] if rng.random() < 0.8 else values  # mostly local edges, some long ones
        if rng.random() < 0.3:
            node = g.call_function(torch.neg, (rng.choice(window),))
        else:
            node = g.call_function(rng.choice([operator.add, operator.mul]), (rng.choice(window), rng.choice(window)))
        if rng.random() < 0.55:
            supported.add(node.name)
        values.append(node)
    g.output(tuple(v for v in values[3:] if not v.users) or values[-1])
    return fx.GraphModule(torch.nn.Module(), g), supported


def _names(partitions) -> list:
    return [sorted(n.name for n in p.nodes) for p in partitions]


def _check_cover(gm, supported, partitions) -> None:
    seen = [n.name for p in partitions for n in p.nodes]
    assert sorted(seen) == sorted(supported), "each supported node in exactly one partition, nothing else"
    assert _contractible(gm.graph, partitions), "the partitions can all be fused without a cycle"


@pytest.mark.skipif(not _HAS_SKIP, reason="this torch's partitioner has no skip_horizontal_fusion to compare with")
def test_same_partitions_as_torch_wherever_torch_makes_no_cycle():
    rng = random.Random(0)
    compared = torch_cyclic = 0
    for trial in range(300):
        gm, supported = _random_graph(rng, rng.randint(5, 60))
        ours = propose_partitions(gm, _Named(supported))
        _check_cover(gm, supported, ours)
        theirs = CapabilityBasedPartitioner(gm, _Named(supported), allows_single_node_partition=True,
                                            skip_horizontal_fusion=True).propose_partitions()
        if not _contractible(gm.graph, theirs):
            torch_cyclic += 1
            continue
        assert _names(ours) == _names(theirs), f"trial {trial}"
        compared += 1
    assert compared > 250


def test_never_proposes_groups_that_need_each_other():
    """Two groups each reading the other's result through a node neither takes: torch (whose reachability
    goes stale as groups merge) can propose both; fusing them would make a cycle."""
    rng = random.Random(1)
    torch_cyclic = 0
    for _ in range(300):
        gm, supported = _random_graph(rng, rng.randint(20, 80))
        _check_cover(gm, supported, propose_partitions(gm, _Named(supported)))
        theirs = CapabilityBasedPartitioner(gm, _Named(supported), allows_single_node_partition=True,
                                            **({"skip_horizontal_fusion": True} if _HAS_SKIP else {}))
        torch_cyclic += not _contractible(gm.graph, theirs.propose_partitions())
    assert torch_cyclic > 0, "the random graphs no longer include a case torch gets wrong"


def test_chain_of_thousands_of_nodes_is_one_group_and_fuses():
    g = fx.Graph()
    x = v = g.placeholder("x")
    for i in range(3000):
        v = g.call_function(operator.add if i % 2 else operator.mul, (v, x))
    g.output(v)
    gm = fx.GraphModule(torch.nn.Module(), g)
    supported = {n.name for n in g.nodes if n.op == "call_function"}
    partitions = propose_partitions(gm, _Named(supported))
    assert len(partitions) == 1 and len(partitions[0].nodes) == 3000
    x = torch.randn(3, dtype=torch.float64)
    want = gm(x)
    fuse_partitions(gm, partitions, prefix="fused_")
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "output"]
    assert torch.equal(gm(x), want)
