"""CUDA graphs (fxopt.backend(cudagraphs=True), fxopt/cudagraphs.py).

CPU tests cover the logic that needs no GPU: option checks, the LRU signature cache, the refusal
analysis, refusals and their report text, and the whole warm-up / capture / replay / re-capture flow
run against FakeGraphs, which gives CUDA-graph semantics on the CPU (capture runs nothing the caller
can see; replay recomputes from the captured inputs and writes into the captured outputs in place,
so a missing input copy or output copy shows up as a wrong or changed value).

The GPU tests of the real torch.cuda.CUDAGraph path are in test_cudagraphs_gpu.py.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt import cudagraphs
from fxopt.cudagraphs import GraphedCallable, SignatureCache, mutated_inputs, refusal_reason, signature
from fxopt.options import Options
from fxopt.report import GraphReport

gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(cudagraphs, "_warned", set())  # "warn once" is per process; each test starts clean


class FakeGraphs:
    """CUDA-graph semantics on the CPU (see the module docstring)."""

    cpu_ok = True

    def __init__(self):
        self.warmups = self.captures = self.replays = 0
        self.capturing = False

    def busy(self):
        return False

    def warmup(self, fn, args, device):
        self.warmups += 1
        return fn(args)

    def capture(self, fn, args, device):
        # a real graph reads its inputs by address and holds none of them: keep aliases that do not
        # own the memory, so the graph does not keep alive what the caller let go (lent tensors)
        static = [_unowned(a) if isinstance(a, torch.Tensor) else a for a in args]
        saved = [a.clone() if isinstance(a, torch.Tensor) else None for a in static]
        self.capturing = True
        try:
            outs = fn(list(static))
        finally:
            self.capturing = False
        for a, s in zip(static, saved):  # a real capture runs nothing: undo in-place writes
            if s is not None:
                a.copy_(s)
        self.captures += 1
        return (fn, static, outs), outs

    def replay(self, graph, device):
        fn, static, outs = graph
        for o, n in zip(outs, fn(list(static))):
            if isinstance(o, torch.Tensor):
                o.copy_(n)
        self.replays += 1


def _unowned(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype).set_(alias, t.storage_offset(), t.shape, t.stride())


def graphed(fn, backend=None, mutated=(), **kw):
    record = GraphReport(name="forward", target="cuda")
    g = GraphedCallable(fn, "forward", record, set(mutated), backend or FakeGraphs(), **kw)
    return g, record


def boxed(fn):
    """A boxed callable like the compiled wrappers: takes a list, clears it, returns a tuple."""
    def call(args):
        a = list(args)
        args.clear()
        out = fn(*a)
        return out if isinstance(out, tuple) else (out,)
    return call


# ---------------------------------------------------------------- options, cache, analysis (CPU)

def test_cudagraphs_option_is_validated():
    assert fxopt.backend(cudagraphs=True).options.cudagraphs is True
    with pytest.raises(TypeError, match="cudagraphs='yes' must be True or False"):
        Options(cudagraphs="yes")
    with pytest.raises(TypeError, match="unknown option"):
        fxopt.backend(cuda_graphs=True)


def test_signature_cache_evicts_least_recently_used():
    cache = SignatureCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recent
    cache.put("c", 3)
    assert "b" not in cache and "a" in cache and "c" in cache and cache.evicted == 1 and len(cache) == 2
    with pytest.raises(ValueError, match="at least one graph"):
        SignatureCache(0)


def test_signature_keys_shape_stride_dtype_and_values():
    x = torch.randn(4, 6)
    key = signature([x, 3], cpu_ok=True)[0]
    assert key == signature([torch.randn(4, 6), 3], cpu_ok=True)[0]
    for other in ([x.t().contiguous().t(), 3], [x.double(), 3], [torch.randn(5, 6), 3], [x, 4]):
        assert signature(other, cpu_ok=True)[0] != key
    with pytest.raises(cudagraphs.Refused, match="input 0 is a CPU tensor"):
        signature([x])
    with pytest.raises(cudagraphs.Refused, match="cannot key"):
        signature([x, [1, 2]], cpu_ok=True)


def test_refusal_reasons_name_the_op():
    x = torch.randn(3, 4)
    drop = make_fx(lambda t: F.dropout(t, 0.5, True))(x)
    assert "random op" in refusal_reason(drop, "cuda") and "model.eval()" in refusal_reason(drop, "cuda")
    item = make_fx(lambda t: t * t.sum().item(), tracing_mode="symbolic")(x)
    assert "_local_scalar_dense" in refusal_reason(item, "cuda") and "sync" in refusal_reason(item, "cuda")
    nz = make_fx(lambda t: t.nonzero(), tracing_mode="symbolic")(x)
    assert "data-dependent output shape" in refusal_reason(nz, "cuda")
    plain = make_fx(lambda t: t * 2)(x)
    assert "CPU tensor" in refusal_reason(plain, "cuda")  # a CPU input in a CUDA graph: its value would freeze
    assert "runs on the CPU (interpret)" in refusal_reason(plain, "interpret")
    assert "profile=True" in refusal_reason(plain, "cuda", profile=True)


def test_mutated_inputs_follow_views():
    def f(x, y):
        x[0].mul_(2)
        return x + y
    assert mutated_inputs(make_fx(f)(torch.randn(3, 4), torch.randn(3, 4))) == {0}
    assert mutated_inputs(make_fx(lambda x, y: x + y)(torch.randn(3), torch.randn(3))) == set()


def test_cudagraphs_on_cpu_refuses_with_note_and_one_warning():
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="runs without CUDA graphs: the graph runs on the CPU"):
        rep = fxopt.explain(lambda x: x * 2, x, cudagraphs=True)
    reasons = [r for n, r in rep.fallbacks if n == "cudagraphs"]
    assert reasons and all("CUDA graphs need CUDA tensors" in r for r in reasons)
    assert "note: cudagraphs: refused: the graph runs on the CPU" in str(rep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: no second warning
        out = torch.compile(lambda x: x * 2, backend=fxopt.backend(cudagraphs=True))(x)
    torch.testing.assert_close(out, x * 2)


def test_runtime_cpu_tensor_refuses_with_the_real_backend():
    g, record = graphed(boxed(lambda x: x + 1), backend=cudagraphs.CudaGraphs())
    x = torch.randn(3)
    with pytest.warns(UserWarning, match="input 0 is a CPU tensor at run time"):
        out = g([x])
    torch.testing.assert_close(out[0], x + 1)
    assert record.notes == ["cudagraphs: refused: input 0 is a CPU tensor at run time: its value would be "
                            "frozen into the graph"]
    assert ("cudagraphs", record.notes[0].removeprefix("cudagraphs: refused: ")) in record.fallbacks


# ---------------------------------------------------------------- the flow, on FakeGraphs (CPU)

def test_warmup_then_capture_then_replay_with_new_values():
    w = torch.randn(8, 8)
    fake = FakeGraphs()
    g, record = graphed(boxed(lambda x, w: torch.tanh(x @ w)), fake)
    xs = [torch.randn(4, 8) for _ in range(6)]  # all alive: distinct addresses, so x is copied in
    for x in xs:  # each output dies before the next call (kept outputs: test_cudagraphs_lending.py)
        torch.testing.assert_close(g([x, w])[0], torch.tanh(x @ w))
    assert (fake.warmups, fake.captures, fake.replays) == (2, 1, 4)
    cap = g.cache.get(next(iter(g.cache._items)))
    cap = cap.captured
    assert [i for i, _, _ in cap.copies] == [0] and [i for i, _ in cap.direct] == [1]  # x copied, w in place
    assert "cudagraphs: captured 1 graph(s)" in record.notes[0]


def test_parameter_updated_in_place_is_read_without_a_copy():
    w = torch.randn(5)
    fake = FakeGraphs()
    g, _ = graphed(boxed(lambda x, w: x * w), fake)
    x = torch.randn(5)
    for step in range(6):
        torch.testing.assert_close(g([x, w])[0], x * w)
        with torch.no_grad():
            w.add_(0.5)  # an optimizer step: same address, new values
    assert fake.captures == 1 and not g.cache.get(next(iter(g.cache._items))).captured.copies


def test_static_input_at_a_new_address_recaptures_never_reads_stale_memory():
    fake = FakeGraphs()
    g, record = graphed(boxed(lambda x, w: x + w), fake)
    x, w = torch.randn(4), torch.randn(4)
    for _ in range(3):
        g([x, w])
    assert fake.captures == 1
    w2 = torch.randn(4)  # same signature, another tensor
    torch.testing.assert_close(g([x, w2])[0], x + w2)
    assert fake.captures == 2 and g.recaptures == 1 and "1 re-captured" in record.notes[0]
    torch.testing.assert_close(g([x, w])[0], x + w)  # w is now copied in: any address works
    assert fake.captures == 2


def test_cleared_cublas_workspaces_retire_every_graph_before_the_next_replay():
    """Someone freeing cuBLAS's workspaces (Inductor's CUDA-graph trees, at each of their recordings)
    frees memory our captured matmuls use: no graph replays after that; each signature warms up and
    captures again."""
    from fxopt import cudagraph_workspaces
    fake = FakeGraphs()
    g, record = graphed(boxed(lambda x, w: torch.tanh(x @ w)), fake)
    other, _ = graphed(boxed(lambda x: x * 2), FakeGraphs())  # another callable: marked too
    w = torch.randn(8, 8)
    for _ in range(4):
        g([torch.randn(4, 8), w])
    assert (fake.warmups, fake.captures, fake.replays) == (2, 1, 2)
    cudagraph_workspaces.cleared()
    assert g.workspaces_cleared and other.workspaces_cleared
    for _ in range(4):
        x = torch.randn(4, 8)
        torch.testing.assert_close(g([x, w])[0], torch.tanh(x @ w))
    assert (fake.warmups, fake.captures, fake.replays) == (4, 2, 4)  # warmed up again, captured anew
    assert g.workspace_retirements == 1 and "all retired 1 time(s)" in record.notes[0]


def test_new_signature_new_graph_cache_bounded_lru():
    fake = FakeGraphs()
    g, record = graphed(boxed(lambda x: x * 3), fake, max_graphs=2, warmup=1)
    for n in (2, 3, 4, 2):  # 2 is evicted by 4: back again, it warms up and is captured again
        x = torch.randn(n)
        for _ in range(3):
            torch.testing.assert_close(g([x])[0], x * 3)
    assert len(g.cache) == 2 and g.cache.evicted == 2 and fake.captures == 4
    assert "captured 4 graph(s) (2 kept of at most 2, 2 evicted" in record.notes[0]


def test_outputs_aliasing_inputs_and_each_other_keep_aliasing():
    def f(x):
        y = x * 2
        return x[1:], y, y[2:].t()
    g, _ = graphed(boxed(f), FakeGraphs(), warmup=1)
    xs = [torch.randn(4, 4) for _ in range(4)]
    for x in xs:
        view, y, yv = g([x])
        assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # the caller's x, not a copy
        torch.testing.assert_close(view, x[1:])
        assert yv.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
        assert yv.storage_offset() - y.storage_offset() == 8 and yv.stride() == (1, 4)
        torch.testing.assert_close(yv, (x * 2)[2:].t())


def test_mutated_static_input_is_written_once_per_call():
    counter = torch.zeros(1)

    def f(x, c):
        c.add_(1)
        return x + c

    g, _ = graphed(boxed(f), FakeGraphs(), mutated={1})
    x = torch.randn(3)
    for step in range(1, 6):
        torch.testing.assert_close(g([x, counter])[0], x + step)
    assert counter.item() == 5


def test_mutated_input_at_moving_address_refuses():
    def f(x):
        x.add_(1)
        return x * 2
    g, record = graphed(boxed(f), FakeGraphs(), mutated={0})
    xs = [torch.zeros(3) for _ in range(4)]
    with pytest.warns(UserWarning, match="written in place by the graph but arrives at a new address"):
        outs = [g([x])[0] for x in xs]
    for x, out in zip(xs, outs):
        assert torch.equal(x, torch.ones(3)) and torch.equal(out, torch.full((3,), 2.0))
    assert g.refused and record.notes[0].startswith("cudagraphs: refused: input 0 is written in place")


def test_capture_failure_refuses_and_runs_without_graphs():
    fake = FakeGraphs()

    def f(x):
        if fake.capturing:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return x * x.sum().item()

    g, record = graphed(boxed(f), fake)
    x = torch.randn(4)
    with pytest.warns(UserWarning, match="capture failed .RuntimeError: CUDA error: operation not permitted"):
        outs = [g([x])[0] for _ in range(5)]
    for out in outs:
        torch.testing.assert_close(out, x * x.sum())
    assert fake.captures == 0 and fake.replays == 0 and "refused: capture failed" in record.notes[0]


def test_fake_graphs_train_through_torch_compile_like_eager(monkeypatch):
    """The aot_autograd wiring (forward, lazily compiled backward, boxed calls, saved tensors) with
    FakeGraphs standing in for CUDA: losses and parameters follow eager over SGD steps."""
    made = []

    class Recording(FakeGraphs):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(cudagraphs, "CudaGraphs", Recording)
    monkeypatch.setattr(cudagraphs, "refusal_reason", lambda gm, target, profile=False: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxopt.backend(cudagraphs=True))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    batches = [(torch.randn(6, 8), torch.randn(6, 4)) for _ in range(6)]
    for x, y in batches:
        for m, o in ((compiled, opt), (ref, ref_opt)):
            o.zero_grad()  # before the forward: no gradient lent by the backward is alive at the next one
            loss = F.mse_loss(m(x), y)
            loss.backward()
            o.step()
            if m is ref:
                ref_loss = loss
            else:
                got = loss
        torch.testing.assert_close(got, ref_loss, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert len(made) == 1 and made[0].captures == 2 and made[0].replays == 2 * (len(batches) - 2)



@pytest.mark.parametrize("in_pool, share_pool", [(True, True), (False, True), (True, False)])
def test_warmups_allocate_from_the_shared_pool_only_until_its_first_capture(monkeypatch, in_pool, share_pool):
    """CudaGraphs.warmup's routing, with torch.cuda's stream and pool context managers recorded: before
    the pool's first capture a warm-up runs on the capture stream inside the pool (so the capture reuses
    what it freed); after it, or with warm-ups out of the pool or private pools, on the caller's stream
    (an uncaptured call in the pool could be handed a graph's scratch)."""
    import contextlib
    entered = []

    class Stream:
        def wait_stream(self, other):
            entered.append("wait")

    def recorded(name):
        @contextlib.contextmanager
        def cm(*_):
            entered.append(name)
            yield
        return cm

    monkeypatch.setattr(cudagraphs, "WARMUP_IN_POOL", in_pool)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", recorded("capture stream"))
    monkeypatch.setattr(torch.cuda, "use_mem_pool", recorded("pool"), raising=False)
    be = cudagraphs.CudaGraphs(share_pool=share_pool)

    def pool(device):
        if be.share_pool:
            be.pools.setdefault(device, ("mempool", None))
            return "pool id"
        return None
    monkeypatch.setattr(be, "pool", pool)
    monkeypatch.setattr(be, "_stream", lambda device: Stream())
    monkeypatch.setattr(be, "_record", lambda fn, args, device, pool: ("graph", fn(args)))
    double = lambda args: (args[0] * 2,)  # noqa: E731
    x = torch.ones(3)

    assert torch.equal(be.warmup(double, [x], 0)[0], x * 2)
    expect_pool = in_pool and share_pool
    assert entered == (["wait", "capture stream", "pool", "wait"] if expect_pool else []), entered
    be.capture(double, [x], 0)
    assert be.captured_into == ({0} if share_pool else set())
    entered.clear()
    be.warmup(double, [x], 0)  # a new shape's warm-up after the capture: the caller's stream
    assert entered == []
    be.warmup(double, [x], 1)  # another device's pool has no capture yet
    assert entered == (["wait", "capture stream", "pool", "wait"] if expect_pool else [])
