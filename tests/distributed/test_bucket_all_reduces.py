"""One all-reduce per gradient (DDP's python reducer) becomes one coalesced all-reduce per bucket
(passes/bucket_all_reduces.py). Structure on make_fx graphs with torch's fake process group; values
through fxopt on a one-rank gloo group (an all-reduce over one rank returns its input, so a result
handed to the wrong member shows). The two-rank DDP run is in test_two_ranks.py."""
import operator
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import fxopt
from fxopt.options import Environment, Options
from fxopt.pass_manager import PassContext
from fxopt.passes.bucket_all_reduces import BucketAllReduces
from fxopt.passes.collective_waits import SinkCollectiveWaits

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _reducer_like(*grads):
    """What DDP's python reducer puts in a backward graph: per gradient, all_reduce(g / world), its wait
    right after, the result copied out."""
    outs = []
    for g in grads:
        reduced = funcol.all_reduce(torch.cos(g) / 2, "sum", dist.group.WORLD)
        outs.append(reduced * 1.0)
    return outs


def _bucketed(fn, *inputs, mb: float = 25.0):
    gm = make_fx(fn)(*inputs)
    ctx = PassContext(Options(all_reduce_bucket_mb=mb), Environment.read())
    SinkCollectiveWaits()(gm, ctx)  # as in the pipeline: the waits move first
    result = BucketAllReduces()(gm, ctx)
    ops = [n.target.__name__.split(".")[0] for n in gm.graph.nodes
           if n.op == "call_function" and "_c10d_functional" in str(n.target) and "wait" not in str(n.target)]
    return gm, result, ops


def test_one_coalesced_all_reduce_per_bucket_in_graph_order(fake_group):
    grads = [torch.randn(256) for _ in range(6)]  # 1 KiB each
    gm, result, ops = _bucketed(_reducer_like, *grads)
    assert ops == ["all_reduce_coalesced"] and result.stats == {"buckets": 1, "all_reduces_bucketed": 6}
    co = next(n for n in gm.graph.nodes if "coalesced" in str(n.target))
    # members in their order; each former result is an item of the bucket that its wait still waits on
    items = sorted((u for u in co.users), key=lambda u: u.args[1])
    assert [u.target for u in items] == [operator.getitem] * 6 and [u.args[1] for u in items] == list(range(6))
    assert all(any("wait_tensor" in str(w.target) for w in u.users) for u in items)
    # a bucket closes once it holds the cap: 2 KiB buckets of 1 KiB gradients
    _, result, ops = _bucketed(_reducer_like, *grads, mb=2 / 1024)
    assert ops == ["all_reduce_coalesced"] * 3, ops
    _, result, ops = _bucketed(_reducer_like, *grads, mb=0)  # off
    assert ops == ["all_reduce"] * 6 and not result.changed


def _reduce_gather_reduce(a, b, c):
    r1 = funcol.all_reduce(a * 2, "sum", dist.group.WORLD)
    g = funcol.all_gather_tensor(b + 1, 0, dist.group.WORLD)
    r2 = funcol.all_reduce(c * 3, "sum", dist.group.WORLD)
    return r1 + 1, g * 2, r2 + 1


def test_a_bucket_never_reaches_past_another_collective(fake_group):
    _, result, ops = _bucketed(_reduce_gather_reduce, *(torch.randn(8) for _ in range(3)))
    assert ops == ["all_reduce", "all_gather_into_tensor", "all_reduce"] and not result.changed


def _result_read_between(a, b):
    r1 = funcol.all_reduce(a, "sum", dist.group.WORLD)
    mid = r1.sum() * b  # the first result is needed before the second all-reduce is issued
    r2 = funcol.all_reduce(mid, "sum", dist.group.WORLD)
    return r2


def _two_ops(a, b):
    return funcol.all_reduce(a, "sum", dist.group.WORLD) + 1, funcol.all_reduce(b, "max", dist.group.WORLD) + 1


def test_members_share_op_and_no_wait_comes_before_the_bucket_is_issued(fake_group):
    _, result, ops = _bucketed(_result_read_between, torch.randn(8), torch.randn(8))
    assert ops == ["all_reduce", "all_reduce"] and not result.changed
    _, result, ops = _bucketed(_two_ops, torch.randn(8), torch.randn(8))
    assert ops == ["all_reduce", "all_reduce"] and not result.changed


def test_bucketed_results_reach_their_own_outputs(one_rank):
    grads = [torch.randn(n) for n in (64, 3, 200, 64)]  # two of one shape: a swap would show
    rep = fxopt.explain(_reducer_like, *grads)
    assert "all_reduce_coalesced" in rep.graphs[0].wrapper_source
    got = torch.compile(_reducer_like, backend=fxopt.backend(), dynamic=False)(*grads)
    for g, out in zip(grads, got):
        torch.testing.assert_close(out, torch.cos(g.double()).div(2).float(), rtol=1e-6, atol=1e-6)
    plain = torch.compile(_reducer_like, backend=fxopt.backend(skip_passes=("bucket_all_reduces",)), dynamic=False)
    for a, b in zip(got, plain(*grads)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_bucket_size_option_is_checked():
    with pytest.raises(ValueError, match="all_reduce_bucket_mb"):
        Options(all_reduce_bucket_mb=-1)


def _copied_out(g):
    """The python reducer's last step: the all-reduced gradient copied into a fresh tensor."""
    reduced = funcol.all_reduce(g * 2, "sum", dist.group.WORLD)
    return torch.ops.aten.copy.default(torch.empty_like(g), reduced)


def _copied_and_returned(g):
    reduced = funcol.all_reduce(g * 2, "sum", dist.group.WORLD)
    return torch.ops.aten.copy.default(torch.empty_like(g), reduced), reduced


def test_the_copy_out_of_an_all_reduced_result_only_it_reads_is_dropped(one_rank):
    g = torch.randn(8, 4)
    src = fxopt.explain(_copied_out, g).graphs[0].wrapper_source
    body = src[src.index("def call"):]
    assert "clone" not in body and "aten.copy" not in body  # the collective's buffer is returned
    torch.testing.assert_close(torch.compile(_copied_out, backend="fxopt", dynamic=False)(g), g * 2)
    # read by another output too: the copy stays, or the two outputs would share a buffer
    copied, reduced = torch.compile(_copied_and_returned, backend="fxopt", dynamic=False)(g)
    torch.testing.assert_close(copied, g * 2)
    torch.testing.assert_close(reduced, g * 2)
    assert copied.data_ptr() != reduced.data_ptr()


def test_gloo_all_reduces_of_cuda_tensors_are_left_alone(one_rank):
    """Gloo cannot all-reduce a list of CUDA tensors at once: such graphs keep one all-reduce each."""
    from fxopt.passes import bucket_all_reduces

    group = dist.group.WORLD.group_name
    assert bucket_all_reduces._coalesces(group, torch.device("cpu"))
    assert not bucket_all_reduces._coalesces(group, torch.device("cuda"))
    assert not bucket_all_reduces._coalesces("no such group", torch.device("cpu"))
