"""CUDA graphs on the GPU: the real torch.cuda.CUDAGraph path of fxopt/cudagraphs.py (marked `gpu`,
names contain "cuda": `pytest -m gpu -k cuda tests/test_cudagraphs_gpu.py`): inference equal to eager
and to fxopt without graphs, earlier outputs unchanged, training steps with in-place optimizers, a
bounded cache of shapes, refusals. The CPU side of the same logic is in test_cudagraphs.py; the memory
the graphs hold in test_cudagraphs_gpu_memory.py.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt import cudagraphs
from fxopt.options import Options
from test_cudagraphs import boxed, graphed
from tests.helpers import retained_graph_step

gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _random_ops_still_work():
    """After any test (a failed capture included), the device's generator is usable outside capture
    and no allocation routing to a graph pool is left behind (empty_cache asserts there is none; at
    exit a pool's destruction would abort the process)."""
    yield
    if torch.cuda.is_available():
        torch.randn(1, device="cuda")
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(cudagraphs, "_warned", set())  # "warn once" is per process; each test starts clean


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
    # every output kept in `outs`: the one lent by the first replay is alive at the next call, so
    # the graph is captured again, copying its outputs (test_cudagraphs_lending.py)
    assert notes and all(n.startswith("cudagraphs: captured 2 graph(s)") and "since call 4: a caller kept one" in n
                         for n in notes), notes
    assert "note: cudagraphs: captured" in str(graphed_fn.report)


@gpu
def test_cuda_graphs_retired_when_cublas_workspaces_are_cleared():
    """Inductor's CUDA-graph trees free cuBLAS's workspaces at each recording; the clear goes through
    fxopt's watch, and the next call warms up and captures again instead of replaying over freed memory."""
    torch.manual_seed(0)
    model = MLP().cuda().eval()
    with torch.no_grad():
        fn = fxopt.optimize(model, torch.randn(2, 16, 64, device="cuda"), cudagraphs=True)
        for step in range(8):
            if step == 4:
                torch._C._cuda_clearCublasWorkspaces()  # what Inductor calls
            x = torch.randn(2, 16, 64, device="cuda")
            torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)
    notes = _notes(fn.report)
    assert notes and all("captured 2 graph(s)" in n and "all retired 1 time(s)" in n for n in notes), notes


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
    for _ in range(8):  # zero_grad after the forward: the backward switches to copies at call 4, then
        loss = compiled(torch.randn(4, 32, device="cuda")).square().mean()  # warms up and captures again
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
def test_cuda_graphs_forward_and_backward_share_one_pool_and_interleave(monkeypatch):
    """The forward and backward graphs of one compiled model capture into one pool; two forwards
    before their two backwards (gradient accumulation, backwards in reverse order) still equal eager,
    since every pool byte is scratch between replays."""
    made = []

    class Recording(cudagraphs.CudaGraphs):
        def __init__(self):
            super().__init__()
            made.append(self)

        def capture(self, fn, args, device):
            graph, outs = super().capture(fn, args, device)
            self.captured = getattr(self, "captured", []) + [graph.pool()]
            return graph, outs

    monkeypatch.setattr(cudagraphs, "CudaGraphs", Recording)
    torch.manual_seed(0)
    model = MLP(32).cuda()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxopt.backend(cudagraphs=True))
    for step in range(6):
        xs = [torch.randn(4, 8, 32, device="cuda") for _ in range(2)]
        losses = [compiled(x).square().mean() for x in xs]
        ref_losses = [ref(x).square().mean() for x in xs]
        for loss, ref_loss in zip(reversed(losses), reversed(ref_losses)):
            torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
            loss.backward()
            ref_loss.backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    (backend_obj,) = made
    assert len(backend_obj.captured) >= 2, "forward and backward were both captured"
    assert set(backend_obj.captured) == {backend_obj.pools[torch.cuda.current_device()][0].id}


@gpu
def test_cuda_graphs_recapture_and_eviction_in_a_shared_pool():
    """A re-capture drops the old graph before capturing the new one, and an evicted graph may have
    been the pool's last: capturing into the shared pool must still work after both."""
    g, record = graphed(boxed(lambda x, w: x * w + 1), backend=cudagraphs.CudaGraphs(), max_graphs=1)
    x = torch.randn(32, device="cuda")
    w = torch.randn(32, device="cuda")
    for _ in range(4):
        torch.testing.assert_close(g([x, w])[0], x * w + 1)
    w2 = torch.randn(32, device="cuda")  # the weight read in place moved: re-captured with it copied
    for _ in range(3):
        torch.testing.assert_close(g([x, w2])[0], x * w2 + 1)
    y = torch.randn(64, device="cuda")  # a new shape evicts the only graph
    for _ in range(4):
        torch.testing.assert_close(g([y, y])[0], y * y + 1)
    assert g.refused is None, record.notes
    assert g.recaptures == 1 and g.cache.evicted == 1 and g.captures == 3, record.notes


@gpu
def test_cuda_graphs_private_pools_still_work():
    g, _ = graphed(boxed(lambda x: torch.sigmoid(x) * 2), backend=cudagraphs.CudaGraphs(share_pool=False))
    x = torch.randn(64, device="cuda")
    for _ in range(4):
        torch.testing.assert_close(g([x])[0], torch.sigmoid(x) * 2)
    assert g.captures == 1


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


# ---------------------------------------------------------------- saved tensors lent to the backward

def _accumulating_steps(compiled, model, ref, steps=4, retain=False):
    """Gradient accumulation (two forwards, then both backwards) or a retained graph read again after
    another forward: gradients equal eager's at every step."""
    for _ in range(steps):
        xs = [torch.randn(4, 8, 32, device="cuda") for _ in range(2)]
        for m, net in ((model, compiled), (ref, ref)):
            m.zero_grad()
            if retain:
                retained_graph_step(net, *xs)
            else:
                losses = [net(x).square().mean() for x in xs]
                for loss in losses:
                    loss.backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)


@gpu
@pytest.mark.parametrize("retain", [False, True], ids=["accumulation", "retained-graph"])
def test_cuda_graphs_lent_saved_tensors_never_overwritten_while_pending(retain):
    torch.manual_seed(0)
    model = MLP(32).cuda()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxopt.backend(cudagraphs=True))
    _accumulating_steps(compiled, model, ref, retain=retain)


@gpu
def test_cuda_graphs_lent_forward_evicted_while_its_backward_is_pending(monkeypatch):
    """A forward graph evicted (cache of one shape) while the tensors it lent are alive keeps its
    memory until they die: the pending backward still reads the right values."""
    monkeypatch.setattr(cudagraphs, "MAX_GRAPHS", 1)
    torch.manual_seed(0)
    model = MLP(32).cuda()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxopt.backend(cudagraphs=True), dynamic=True)  # one graph, two shapes
    for step in range(5):
        xs = [torch.randn(4, n, 32, device="cuda") for n in (8, 12)]
        for m, net in ((model, compiled), (ref, ref)):
            m.zero_grad()
            losses = [net(x).square().mean() for x in xs]  # the second shape evicts the first's graph
            for loss in losses:
                loss.backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)
