"""CUDA graphs (fxopt.backend(cudagraphs=True), fxopt/cudagraphs.py).

CPU tests cover the logic that needs no GPU: option checks, the LRU signature cache, the refusal
analysis, refusals and their report text, and the whole warm-up / capture / replay / re-capture flow
run against FakeGraphs, which gives CUDA-graph semantics on the CPU (capture runs nothing the caller
can see; replay recomputes from the captured inputs and writes into the captured outputs in place,
so a missing input copy or output copy shows up as a wrong or changed value).

GPU tests (marked `gpu`, names contain "cuda": `pytest -m gpu -k cuda tests/test_cudagraphs.py`) run
the real torch.cuda.CUDAGraph path: inference equal to eager and to fxopt without graphs, earlier
outputs unchanged, training steps with in-place optimizers, a bounded cache of shapes, refusals.
"""
from __future__ import annotations

import copy
import os
import sys
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
def _random_ops_still_work():
    """After any test (a failed capture included), the device's generator is usable outside capture."""
    yield
    if torch.cuda.is_available():
        torch.randn(1, device="cuda")


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
        static = list(args)
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
    outs = [g([x, w])[0] for x in xs]
    for x, out in zip(xs, outs):  # also: earlier outputs did not change when later calls replayed
        torch.testing.assert_close(out, torch.tanh(x @ w))
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
            loss = F.mse_loss(m(x), y)
            o.zero_grad()
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


# ---------------------------------------------------------------- GPU (real CUDA graphs)

def _notes(rep):
    return [n for g in rep.graphs for n in g.notes if n.startswith("cudagraphs")]


class MLP(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


@gpu
def test_cuda_graphs_mlp_inference_matches_eager_and_plain_fxopt():
    torch.manual_seed(0)
    model = MLP().cuda().eval()
    xs = [torch.randn(2, 16, 64, device="cuda") for _ in range(6)]
    with torch.no_grad():
        graphed_fn = fxopt.optimize(model, xs[0], cudagraphs=True)
        plain = fxopt.optimize(copy.deepcopy(model), xs[0])  # own module: optimize() sets .report on it
        outs = [graphed_fn(x) for x in xs]
        for x, out in zip(xs, outs):
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out, plain(x), rtol=1e-6, atol=1e-6)
    notes = _notes(graphed_fn.report)
    assert notes and all(n.startswith("cudagraphs: captured 1 graph(s)") for n in notes), notes
    assert "note: cudagraphs: captured" in str(graphed_fn.report)


@gpu
def test_cuda_graphs_previous_output_does_not_change():
    torch.manual_seed(0)
    model = MLP().cuda().eval()
    with torch.no_grad():
        f = fxopt.optimize(model, torch.randn(1, 16, 64, device="cuda"), cudagraphs=True)
        held = []
        for _ in range(6):
            x = torch.randn(1, 16, 64, device="cuda")
            out = f(x)
            held.append((out, out.clone(), x))
        torch.cuda.synchronize()
        for out, snapshot, x in held:
            assert torch.equal(out, snapshot)
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)


@gpu
def test_cuda_graphs_gpt2_block_batch1_16_tokens_matches_eager():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))
    from hf_gpt2 import GPT2Block, GPT2Config

    torch.manual_seed(0)
    block = GPT2Block(GPT2Config(n_embd=64, n_head=4, n_positions=16)).cuda().eval()
    xs = [torch.randn(1, 16, 64, device="cuda") for _ in range(5)]
    with torch.no_grad():
        f = fxopt.optimize(block, xs[0], cudagraphs=True)
        for x in xs:
            torch.testing.assert_close(f(x), block(x), rtol=2e-4, atol=2e-4)
    assert all(n.startswith("cudagraphs: captured") for n in _notes(f.report)), _notes(f.report)


@gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_cuda_graphs_training_steps_match_eager(optimizer):
    torch.manual_seed(0)
    model = MLP(32).cuda()
    ref, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3)}[optimizer]
    runs = [(torch.compile(model, backend=fxopt.backend(cudagraphs=True)), make(model.parameters())),
            (torch.compile(plain_model, backend="fxopt"), make(plain_model.parameters())),
            (ref, make(ref.parameters()))]
    for step in range(7):
        x, y = torch.randn(4, 8, 32, device="cuda"), torch.randn(4, 8, 32, device="cuda")
        losses = []
        for m, opt in runs:
            loss = F.mse_loss(m(x), y)
            opt.zero_grad(set_to_none=step % 2 == 0)  # both ways: fresh grads and grads accumulated into
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)  # graphs replay fxopt's kernels
        torch.testing.assert_close(losses[0], losses[2], rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


@gpu
def test_cuda_graphs_training_reports_forward_and_backward_captured():
    torch.manual_seed(0)
    model = MLP(32).cuda()
    from fxopt.backend import compile_dynamo_graph
    from fxopt.report import Report

    rep = Report()
    opts = Options(cudagraphs=True)
    compiled = torch.compile(model, backend=lambda gm, ex: compile_dynamo_graph(gm, ex, opts, rep))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        loss = compiled(torch.randn(4, 32, device="cuda")).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    names = {g.name: [n for n in g.notes if n.startswith("cudagraphs")] for g in rep.graphs}
    assert set(names) == {"forward", "backward"}, names
    for name, notes in names.items():  # an input seen at one address in both warm-ups may move once
        assert notes and notes[0].startswith("cudagraphs: captured"), (name, notes)
        assert "1 kept of at most 8" in notes[0], (name, notes)


@gpu
def test_cuda_graphs_new_shape_new_graph_cache_bounded():
    g, record = graphed(boxed(lambda x: torch.sigmoid(x) * 2 + 1), backend=cudagraphs.CudaGraphs(), max_graphs=2)
    for n in (64, 128, 256, 64):  # 64 evicted by 256: captured again
        x = torch.randn(n, device="cuda")
        for _ in range(4):
            torch.testing.assert_close(g([x])[0], torch.sigmoid(x) * 2 + 1)
    assert len(g.cache) == 2 and g.cache.evicted == 2 and g.captures == 4, record.notes


@gpu
def test_cuda_graphs_dynamic_shapes_one_graph_per_size_through_compile():
    f = torch.compile(lambda x: torch.relu(x) + 1, backend=fxopt.backend(cudagraphs=True), dynamic=True)
    for n in range(3, 14):  # 11 sizes through one symbolic graph: more than the cache keeps
        x = torch.randn(n, 8, device="cuda")
        for _ in range(3):
            torch.testing.assert_close(f(x), torch.relu(x) + 1)


@gpu
def test_cuda_graphs_output_aliasing_input_is_a_view_of_the_callers_tensor():
    g, _ = graphed(boxed(lambda x: (x[1:], x * 2)), backend=cudagraphs.CudaGraphs())
    for _ in range(5):
        x = torch.randn(4, 4, device="cuda")
        view, doubled = g([x])
        assert view.data_ptr() == x[1:].data_ptr()
        torch.testing.assert_close(doubled, x * 2)


@gpu
def test_cuda_graphs_dropout_in_training_refuses_and_still_trains():
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.Linear(16, 1)).cuda()
    from fxopt.backend import compile_dynamo_graph
    from fxopt.report import Report

    rep, opts = Report(), Options(cudagraphs=True)
    compiled = torch.compile(model, backend=lambda gm, ex: compile_dynamo_graph(gm, ex, opts, rep))
    with pytest.warns(UserWarning, match="random op"):
        for _ in range(4):
            loss = compiled(torch.randn(8, 16, device="cuda")).square().mean()
            loss.backward()
    assert torch.isfinite(loss)
    assert any(n == "cudagraphs" and "random op" in r for n, r in rep.fallbacks)


@gpu
def test_cuda_graphs_item_in_graph_refuses_and_is_correct():
    def f(x):
        n = (x > 0).sum().item()
        return x * n

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        from fxopt.backend import compile_dynamo_graph
        from fxopt.report import Report

        rep, opts = Report(), Options(cudagraphs=True)
        compiled = torch.compile(f, backend=lambda gm, ex: compile_dynamo_graph(gm, ex, opts, rep))
        for _ in range(4):
            x = torch.randn(32, device="cuda")
            torch.testing.assert_close(compiled(x), f(x))
    assert any(n == "cudagraphs" and "sync" in r for n, r in rep.fallbacks), rep.fallbacks


@gpu
def test_cuda_graphs_item_during_capture_refuses_and_is_correct():
    """The safety net: a sync the graph analysis cannot see fails the capture; the callable refuses
    and later CUDA work (a fresh capture elsewhere included) still runs. Kept last: it ends a
    capture with a CUDA error."""
    g, record = graphed(boxed(lambda x: x * x.sum().item()), backend=cudagraphs.CudaGraphs())
    x = torch.randn(16, device="cuda")
    with pytest.warns(UserWarning, match="capture failed"):
        outs = [g([x])[0] for _ in range(4)]
    for out in outs:
        torch.testing.assert_close(out, x * x.sum())
    assert g.refused and "capture failed" in record.notes[0]
    h, _ = graphed(boxed(lambda x: x + 1), backend=cudagraphs.CudaGraphs())
    for _ in range(4):
        torch.testing.assert_close(h([x])[0], x + 1)
    assert h.captures == 1
