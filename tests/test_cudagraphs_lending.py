"""CUDA graphs lending a forward's saved tensors to the backward (fxopt/cudagraph_io.py), on the CPU
against FakeGraphs (test_cudagraphs.py): gradient accumulation, a retained graph, eviction while a
backward is pending and the plain training loop, each against eager. The same cases on real CUDA
graphs are in test_cudagraphs_gpu.py."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

from fxopt import cudagraphs
from test_cudagraphs import FakeGraphs, boxed, graphed
from tests.helpers import CountingBackend, retained_graph_step


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(cudagraphs, "_warned", set())


def _fake_training(monkeypatch):
    """(compiled model, eager copy, report) with FakeGraphs standing in for CUDA."""
    monkeypatch.setattr(cudagraphs, "CudaGraphs", FakeGraphs)
    monkeypatch.setattr(cudagraphs, "refusal_reason", lambda gm, target, profile=False: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    backend = CountingBackend(cudagraphs=True)
    return torch.compile(model, backend=backend), model, ref, backend


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _accumulate_like_eager(compiled, model, ref, batches) -> None:
    """Per step, every batch's forward, then every backward (gradient accumulation); the gradients
    must equal eager's after each step."""
    for xs in batches:
        for m, net in ((model, compiled), (ref, ref)):
            m.zero_grad()
            losses = [net(x).square().mean() for x in xs]
            for loss in losses:
                loss.backward()
        for g, r in zip(_grads(model), _grads(ref)):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def _forward_note(backend) -> str:
    return next(n for g in backend.report.graphs if g.name == "forward" for n in g.notes if "cudagraphs" in n)


@pytest.mark.parametrize("lend", [True, False], ids=["lent", "copied"])
def test_gradient_accumulation_two_forwards_before_their_backwards(monkeypatch, lend):
    """Two forwards, then both backwards (gradient accumulation): the second forward may not replay
    over what the first lent its pending backward, so it runs uncaptured ("held back"); gradients
    equal eager's at every step, lent or copied."""
    monkeypatch.setattr(cudagraphs, "LEND_SAVED", lend)
    compiled, model, ref, backend = _fake_training(monkeypatch)
    _accumulate_like_eager(compiled, model, ref, [[torch.randn(6, 8) for _ in range(2)] for _ in range(5)])
    note = _forward_note(backend)
    assert ("lent, not copied" in note) == lend, note
    if lend:
        assert "held back from a replay 0 time" not in note, note


def test_retained_graph_read_again_after_another_forward(monkeypatch):
    """backward(retain_graph=True) keeps the lent tensors alive: a forward in between runs uncaptured
    instead of replaying over them, and the second backward of the first graph reads them unchanged."""
    compiled, model, ref, _ = _fake_training(monkeypatch)
    for step in range(5):
        x1, x2 = torch.randn(6, 8), torch.randn(6, 8)
        for m, net in ((model, compiled), (ref, ref)):
            m.zero_grad()
            retained_graph_step(net, x1, x2)
        for g, r in zip(_grads(model), _grads(ref)):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_forward_evicted_while_its_backward_is_pending(monkeypatch):
    """Room for one captured signature: shape A is captured and lends, then a forward of shape B
    evicts A's graph while A's backward is pending. A's memory is kept until what it lent dies, so
    the pending backward reads the right values; gradients equal eager's."""
    monkeypatch.setattr(cudagraphs, "MAX_GRAPHS", 1)
    compiled, model, ref, backend = _fake_training(monkeypatch)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    batches = [[torch.randn(6, 8)] + ([torch.randn(10, 8)] if step >= 3 else []) for step in range(5)]
    _accumulate_like_eager(compiled, model, ref, batches)
    notes = [n for g in backend.report.graphs if g.name == "forward" for n in g.notes if "cudagraphs" in n]
    assert any("evicted" in n and "0 evicted" not in n for n in notes), notes


def test_plain_training_loop_lends_without_holding_back(monkeypatch):
    """zero_grad, forward, backward, step: the lent tensors die in the backward and the lent
    gradients at the next zero_grad, so every forward replays (two captures in all, no re-capture)
    and the backward reads them where the forward left them."""
    made = []

    class Recording(FakeGraphs):
        def __init__(self):
            super().__init__()
            made.append(self)
    compiled, model, ref, backend = _fake_training(monkeypatch)
    monkeypatch.setattr(cudagraphs, "CudaGraphs", Recording)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        opt.zero_grad()
        loss = compiled(torch.randn(6, 8)).square().mean()
        loss.backward()
        opt.step()
    note = _forward_note(backend)
    assert "lent, not copied (held back from a replay 0 time(s)" in note, note
    assert "0 around memory a later graph lent" in note, note
    # one capture per graph, plus one for each input found at a new address after it was captured (a
    # fresh batch or gradient may reuse the last one's memory or not, as the host allocator decides: a
    # run on the H200 machine counted 4 captures, this machine 2), and every call after the warm-ups replays
    notes = [n for g in backend.report.graphs for n in g.notes if n.startswith("cudagraphs: captured")]
    counts = [re.search(r"captured (\d+) graph.* (\d+) re-captured after a static input moved", n).groups()
              for n in notes]
    assert len(counts) == 2 and all(int(c) - int(r) == 1 for c, r in counts), notes
    assert made[-1].captures == sum(int(c) for c, _ in counts) and made[-1].replays == 8


def test_gradients_alive_at_the_next_forward_make_the_backward_copy_them(monkeypatch):
    """forward, zero_grad, backward, step: the gradients the backward lent (now .grad) are alive
    when the next forward replays, and the backward graph was captured after the forward, so its
    outputs may lie in the forward's scratch (a shared pool): the forward is captured again around
    them, and the backward, whose caller keeps its outputs, copies them from then on. Parameters
    equal eager's at every step."""
    compiled, model, ref, backend = _fake_training(monkeypatch)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for step in range(7):
        x = torch.randn(6, 8)
        for net, opt in ((compiled, opts[0]), (ref, opts[1])):
            loss = net(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)
    backward = next(n for g in backend.report.graphs if g.name == "backward" for n in g.notes if "cudagraphs" in n)
    assert "1 around memory a later graph lent" in _forward_note(backend), _forward_note(backend)
    assert "outputs copied out after each replay (since call 4: a caller kept one)" in backward, backward


# ---------------------------------------------------------------- the outputs a caller sees (LEND_OUTPUTS)

def test_outputs_the_caller_drops_are_lent_in_graph_memory():
    """A loop that lets each result go before its next call gets every replay's output where the
    graph wrote it: the same address each time, no copy, right values."""
    w = torch.randn(8, 8)
    g, record = graphed(boxed(lambda x, w: torch.tanh(x @ w)), FakeGraphs(), warmup=1)
    addresses = set()
    for step in range(6):
        x = torch.randn(4, 8)
        out = g([x, w])[0]
        torch.testing.assert_close(out, torch.tanh(x @ w))
        if step >= 1:
            addresses.add(out.data_ptr())
        del out
    assert len(addresses) == 1 and g.lend_users, addresses
    assert "outputs lent in graph memory" in record.notes[0], record.notes[0]


def test_output_kept_into_the_next_call_never_changes_then_outputs_are_copied():
    """`outs.append(f(x))`: the output lent by the first replay is alive at the next call, which runs
    uncaptured instead of replaying over it; the callable then captures anew, copying its outputs, so
    every result kept equals its own reference at the end."""
    w = torch.randn(8, 8)
    fake = FakeGraphs()
    g, record = graphed(boxed(lambda x, w: torch.tanh(x @ w)), fake)
    xs = [torch.randn(4, 8) for _ in range(9)]
    outs = [g([x, w])[0] for x in xs]
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, torch.tanh(x @ w))
    # warm-up 2, capture + replay (lent); call 4 sees it kept: uncaptured; warm-up 2, capture, 3 replays
    assert (fake.warmups, fake.captures, fake.replays) == (4, 2, 4)
    assert len({o.data_ptr() for o in outs[6:]}) == 3  # copies: one buffer each
    assert not g.lend_users and "since call 4: a caller kept one" in record.notes[0], record.notes[0]


@pytest.mark.parametrize("keep_grads", [False, True], ids=["grads-dropped", "grads-kept"])
def test_training_with_lent_gradients_equals_eager(monkeypatch, keep_grads):
    """The backward's outputs are the gradients autograd puts in .grad. A loop that zeroes them
    (set_to_none) lets them go: they stay lent. A loop that keeps each step's gradients (a log)
    makes the backward copy them. Parameters, losses and every kept gradient equal eager's."""
    compiled, model, ref, backend = _fake_training(monkeypatch)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    logs = ([], [])
    for step in range(6):
        x = torch.randn(6, 8)
        for net, m, opt, log in ((compiled, model, opts[0], logs[0]), (ref, ref, opts[1], logs[1])):
            loss = net(x).square().mean()
            loss.backward()
            if keep_grads:
                log.append([p.grad for p in m.parameters()])
            opt.step()
            opt.zero_grad()
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(*logs):
        for g, r in zip(mine, theirs):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    note = next(n for g in backend.report.graphs if g.name == "backward" for n in g.notes if "cudagraphs" in n)
    assert ("a caller kept one" in note) == keep_grads, note


# ---------------------------------------------------------------- one pool: the capture-order rule

class PoolGraphs(FakeGraphs):
    """FakeGraphs whose graphs share one pool the way CUDA graphs do: a graph captured later may have
    taken its outputs from an earlier graph's scratch, so replaying a graph fills the outputs of every
    graph captured after it with NaN (what its scratch writes would do there)."""

    def __init__(self):
        super().__init__()
        self.order = []

    def capture(self, fn, args, device):
        graph, outs = super().capture(fn, args, device)
        self.order.append(graph)
        return graph, outs

    def replay(self, graph, device):
        later = self.order[next(i for i, g in enumerate(self.order) if g is graph) + 1:]
        for _, _, outs in later:
            for o in outs:
                if isinstance(o, torch.Tensor):
                    o.fill_(float("nan") if o.dtype.is_floating_point else -7)
        super().replay(graph, device)


@pytest.mark.parametrize("loop", ["two-forwards-then-backwards", "retained-graph", "zero-grad-after-forward"])
def test_no_replay_overwrites_what_a_later_graph_lent(monkeypatch, loop):
    """The H200 found wrong gradients here once outputs were lent: a forward captured again after its
    backward put the tensors it lends the backward in the backward's scratch. With the rule (no
    replay while a graph captured later has a lent tensor alive; captured again instead), losses and
    gradients equal eager's in every loop, and no NaN from PoolGraphs reaches them."""
    compiled, model, ref, backend = _fake_training(monkeypatch)
    monkeypatch.setattr(cudagraphs, "CudaGraphs", PoolGraphs)
    compiled = torch.compile(model, backend=backend)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for step in range(8):
        xs = [torch.randn(6, 8) for _ in range(2)]
        for net, m, opt in ((compiled, model, opts[0]), (ref, ref, opts[1])):
            if loop == "two-forwards-then-backwards":
                m.zero_grad()
                losses = [net(x).square().mean() for x in xs]
                for loss in reversed(losses):
                    loss.backward()
            elif loop == "retained-graph":
                m.zero_grad()
                retained_graph_step(net, *xs)
            else:
                loss = net(xs[0]).square().mean()
                opt.zero_grad()
                loss.backward()
            opt.step()
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)


def test_a_graph_dropped_while_its_output_lives_is_let_go_when_the_output_dies():
    """A callable switched to copies keeps the graph that lent a still-alive output (its memory
    must not be reused under it), and lets it go at the first call after that output died."""
    g, _ = graphed(boxed(lambda x: x * 2), FakeGraphs(), warmup=1)
    x = torch.randn(4)
    g([x])
    kept = g([x])[0]  # captured and replayed: lent
    g([x])  # kept into this call: the callable switches to copies, the lending graph is retired
    assert len(g.lending.retired) == 1 and not g.lend_users
    torch.testing.assert_close(kept, x * 2)
    del kept
    g([x])
    assert g.lending.retired == []


def test_a_backward_compiled_apart_reads_what_the_forward_lent_in_place():
    """Compiled autograd (DDP's python reducer) compiles the backward as a graph of its own, with a
    Lending of its own: it must still read the forward's saved tensors where the forward's graph lent
    them, not copy them into static buffers on every replay."""
    w = torch.randn(8, 8)
    fwd, _ = graphed(boxed(lambda x, w: (torch.tanh(x @ w), torch.sin(x) + 1)), FakeGraphs(), lend=frozenset({1}))
    bwd, _ = graphed(boxed(lambda saved, g: saved * g), FakeGraphs())
    assert fwd.lending is not bwd.lending
    for step in range(6):
        x, gy = torch.randn(4, 8), torch.randn(4, 8)
        out, saved = fwd([x, w])
        torch.testing.assert_close(bwd([saved, gy])[0], (torch.sin(x) + 1) * gy)
        del out, saved
    entry = next(iter(bwd.cache._items.values()))
    assert 0 in entry.moved  # fresh tensors while the forward warmed up ...
    assert [i for i, _ in entry.captured.direct] == [0] and [i for i, _, _ in entry.captured.copies] == [1]
    assert bwd.captures == 1 and bwd.recaptures == 0  # ... then read in place, at the forward's lent address
