"""fxopt's partition fusion gives the graph torch.fx's `fuse_by_partitions` gives (same nodes, same
order), without rebuilding the graph; its in-place sort gives torch's stable topological order."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.tools_common import stable_topological_sort

from fxopt.passes.fuse_partitions import fuse_partitions, sort_in_place


class _Pointwise(OperatorSupportBase):
    def is_node_supported(self, submodules, node):
        return node.op == "call_function" and node.target in (torch.sin, torch.cos, operator.mul, operator.add)


def _model(x, y):
    a = x.sin() * 2
    b = a.cos() + y
    m = torch.matmul(b, y)  # splits the pointwise chains into several groups
    c = m.sin() + a
    d = torch.matmul(c, x).cos() * b
    return d, a


def _order(gm):
    return [(n.op, str(n.target), tuple(str(a) for a in n.args)) for n in gm.graph.nodes]


def test_same_graph_as_torch_fuse_by_partitions():
    ours, theirs = fx.symbolic_trace(_model), fx.symbolic_trace(_model)
    for gm, fuse in ((ours, lambda p, gm: fuse_partitions(gm, p, prefix="fused_")),
                     (theirs, lambda p, gm: CapabilityBasedPartitioner(gm, _Pointwise()).fuse_partitions(p))):
        partitioner = CapabilityBasedPartitioner(gm, _Pointwise(), allows_single_node_partition=True)
        partitions = partitioner.propose_partitions()
        assert len(partitions) >= 2
        fuse(partitions, gm)
    assert _order(ours) == _order(theirs)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    ours.recompile()
    for got, want in zip(ours(x, y), _model(x, y)):
        torch.testing.assert_close(got, want)


def test_sort_in_place_matches_torch_stable_sort_on_a_shuffled_graph():
    def build():
        gm = fx.symbolic_trace(_model)
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        nodes[-1].prepend(nodes[1])  # out of order: a user may now come before its input
        nodes[0].prepend(nodes[-2])
        return gm
    ours, theirs = build(), build()
    sort_in_place(ours.graph)
    stable_topological_sort(theirs)
    assert _order(ours) == _order(theirs)
    ours.graph.lint()


def test_sort_in_place_leaves_an_ordered_graph_alone():
    gm = fx.symbolic_trace(_model)
    before = list(gm.graph.nodes)
    sort_in_place(gm.graph)
    assert list(gm.graph.nodes) == before


def test_groups_that_would_need_each_others_results_are_not_both_fused():
    """Two groups, each fusible alone, each reading the other's result once both are fused, one of the
    paths through a node of neither (the partitioner proposed such a pair for a backward graph, whose
    groups each had two unconnected chains: fusing raised "found dependency cycles")."""
    from torch.fx.passes.infra.partitioner import Partition
    from fxopt.passes.fuse_partitions import acyclic_subset

    def f(x):
        w = x.cos()  # group B
        y = w.sin()  # group A: reads B
        z = x.exp()  # group A
        c = torch.matmul(z, x)  # in neither
        e = c.tanh()  # group B: reads A through c
        return y, e

    gm = fx.symbolic_trace(f)
    n = {node.name: node for node in gm.graph.nodes}
    group_a, group_b = Partition(nodes=[n["sin"], n["exp"]]), Partition(nodes=[n["cos"], n["tanh"]])
    assert acyclic_subset(gm.graph, [group_a]) == ([group_a], [])
    assert acyclic_subset(gm.graph, [group_b]) == ([group_b], [])
    assert acyclic_subset(gm.graph, [group_a, group_b]) == ([group_a], [group_b])
    fused = fuse_partitions(gm, [group_a], prefix="fused_")
    x = torch.randn(3, 3)
    for got, want in zip(fused(x), f(x)):
        torch.testing.assert_close(got, want)


def test_a_backward_graph_with_such_groups_compiles_and_matches_eager():
    from tests.helpers import compile_fxopt

    def f(i1, i2):
        v3 = i2 / (i1.flip(-1).abs() + 1)
        return torch.maximum(i2, i1), v3

    torch._dynamo.reset()
    x1, x2 = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    y1, y2 = x1.detach().clone().requires_grad_(), x2.detach().clone().requires_grad_()
    compile_fxopt(f)(x1, x2)[0].pow(2).sum().backward()
    f(y1, y2)[0].pow(2).sum().backward()
    torch.testing.assert_close(x1.grad, y1.grad)
    torch.testing.assert_close(x2.grad, y2.grad)
    torch._dynamo.reset()


def test_a_view_of_an_input_read_by_two_kernels_is_not_a_kernel_output():
    """silu(silu(x) * p0[h] + p1[c]) on a channels-last x: the bias view p1.view(1, C, 1, 1) joined the
    first reduction group (dp1) and the second (dp0) read it as that kernel's output, which the looped
    schedule never stored: dp0 was off by 3. Each reader now makes the view itself."""
    import torch.nn.functional as F
    from tests.helpers import compile_fxopt

    def f(x, p0, p1):
        return F.silu(F.silu(x) * p0.view(1, 1, 8, 1) + p1.view(1, 2, 1, 1))

    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 2, 8, 8, generator=g, dtype=torch.float64)
    params = [torch.randn(8, generator=g, dtype=torch.float64), torch.randn(2, generator=g, dtype=torch.float64)]
    gy = torch.randn(2, 2, 8, 8, generator=g, dtype=torch.float64)

    def grads(fn, x, dtype):
        xx = x.detach().to(dtype, copy=True).requires_grad_()
        pp = [p.to(dtype).requires_grad_() for p in params]
        return torch.autograd.grad(fn(xx, *pp), [xx, *pp], gy.to(dtype))

    for x in (base, base.to(memory_format=torch.channels_last)):
        torch._dynamo.reset()
        for got, want in zip(grads(compile_fxopt(f), x, torch.float32), grads(f, x, torch.float64)):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


class _WithConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.register_buffer("scale", torch.full((4,), 3.0))

    def forward(self, x, y):
        a = (x.sin() * self.inner.scale).cos()  # the group reads a nested buffer through get_attr
        b = torch.matmul(a, y)
        return b.sin() + a, a * 2


def test_each_group_is_the_module_torch_fuse_as_graphmodule_builds_but_lazy():
    """Same placeholders, outputs and code as torch's eager builder; the code is made only when asked."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from torch.fx.passes.utils.fuser_utils import fuse_as_graphmodule, topo_sort
    from fxopt.passes.fuse_partitions import lift_group

    class _WithAttr(_Pointwise):
        def is_node_supported(self, submodules, node):
            return node.op == "get_attr" or super().is_node_supported(submodules, node)

    for model in (_model, _WithConstant()):
        gm = fx.symbolic_trace(model)
        partitions = CapabilityBasedPartitioner(gm, _WithAttr(), allows_single_node_partition=True).propose_partitions()
        assert len(partitions) >= 2
        for i, p in enumerate(partitions):
            nodes = topo_sort(list(p.nodes))
            ours, our_in, our_out = lift_group(gm, nodes, f"g{i}")
            theirs, their_in, their_out = fuse_as_graphmodule(gm, nodes, f"g{i}", p.nodes)
            assert isinstance(ours, _LazyGraphModule) and ours._needs_recompile()
            assert (our_in, our_out) == (their_in, their_out)
            assert ours.code == theirs.code
            assert type(ours).__name__ == f"g{i}"
            args = [torch.randn(4, 4) for _ in our_in]
            torch.testing.assert_close(ours(*args), theirs(*args))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    fused = fuse_partitions(gm, partitions, prefix="fused_")
    fused.recompile()
    for got, want in zip(fused(x, y), _WithConstant()(x, y)):
        torch.testing.assert_close(got, want)
