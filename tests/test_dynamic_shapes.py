"""Dynamic shapes: one compilation with symbolic sizes serves many sizes, with eager's results.

Every test compiles with dynamic=True through a counting backend, calls several sizes (odd ones, rows
longer than one 4096-element block), compares with eager (float64 where the interpreter allows), and
checks the backend ran once. Sizes stay >= 2: dynamo specialises 0 and 1 (tested separately).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import CountingBackend
from fxopt.memory.validate import validate_plan

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from tiny_gpt import GPTConfig, lm_loss, make  # noqa: E402


def _compiled(fn, **options):
    backend = CountingBackend(**options)
    return torch.compile(fn, backend=backend, dynamic=True), backend


def _symbolic_graphs(rep):
    return [g for g in rep.graphs if g.symbols]


def _assert_no_narrowing(rep):
    """fxopt compiled the symbolic graphs as such: kernels, and no size guard added by its passes."""
    graphs = _symbolic_graphs(rep)
    assert graphs and all(g.kernels for g in graphs), [(g.name, g.notes) for g in rep.graphs]
    assert not [n for g in graphs for n in g.notes if "added size guards" in n or "runs as ATen" in n]


# -- pointwise --------------------------------------------------------------------------------------

def test_pointwise_with_broadcast_and_transposed_inputs_serves_every_size():
    def f(x, b, y):
        return torch.sigmoid(x) * b + y.t() * 2

    g, backend = _compiled(f)
    for n, m in [(3, 5), (7, 9), (2, 1031), (13, 3)]:
        x, b, y = (torch.randn(n, m, dtype=torch.float64), torch.randn(m, dtype=torch.float64),
                   torch.randn(m, n, dtype=torch.float64))
        torch.testing.assert_close(g(x, b, y), f(x, b, y))
    assert backend.calls == 1
    _assert_no_narrowing(backend.report)
    src = backend.report.kernels[0].source
    assert "xnumel, s" in src and "XBLOCK: tl.constexpr" in src  # sizes are runtime arguments
    assert "cdiv(" in backend.report.wrapper_source  # the grid is computed per call


def test_a_size_used_as_a_number_is_computed_in_the_kernel():
    def f(x):
        return x * x.shape[0] + x.shape[1]

    g, backend = _compiled(f)
    for n, m in [(3, 5), (6, 2)]:
        x = torch.randn(n, m, dtype=torch.float64)
        torch.testing.assert_close(g(x), f(x))
    assert backend.calls == 1


# -- reductions -------------------------------------------------------------------------------------

def softmax(x):
    return torch.softmax(x, -1)


def layernorm(x):
    return F.layer_norm(x, (x.shape[-1],), eps=1e-5)


def rmsnorm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def sum_inner(x):
    return x.sum(-1)


def sum_outer(x):
    return (x * 2).sum(0)


# rows that fit in registers (the persistent alternative: 5, 9, 4100) and one that does not (9000: the
# looped kernel, over more than one 4096-element block); odd counts; a column sum over more rows than
# its 64-row step
SIZES = [(3, 5), (7, 9), (2, 4100), (70, 3), (2, 9000)]


@pytest.mark.parametrize("fn", [softmax, layernorm, rmsnorm, sum_inner, sum_outer])
def test_reductions_with_symbolic_rows_and_lengths(fn):
    g, backend = _compiled(fn)
    for n, m in SIZES:
        x = torch.randn(n, m, dtype=torch.float64)
        torch.testing.assert_close(g(x), fn(x), rtol=1e-9, atol=1e-10)
    assert backend.calls == 1
    _assert_no_narrowing(backend.report)
    assert all(k.kind == "reduction" and "looped" in k.schedule for k in backend.report.kernels
               if k.kind == "reduction"), [k.schedule for k in backend.report.kernels]
    rows = [k for k in backend.report.kernels if "persistent when the row fits" in (k.schedule or "")]
    if fn is not sum_outer:  # a row reduction: both kernels, chosen per call in the wrapper
        assert rows and all(f"def {k.name}_persistent(" in k.source for k in rows)
        wrapper = "".join(g.wrapper_source for g in backend.report.graphs)
        assert "if next_power_of_2(" in wrapper


def test_static_row_length_stays_persistent_under_symbolic_rows():
    w = torch.randn(32, dtype=torch.float64)

    def f(x):
        return F.layer_norm(x, (32,), w)

    g, backend = _compiled(f)
    for b, t in [(2, 3), (5, 7)]:
        x = torch.randn(b, t, 32, dtype=torch.float64)
        torch.testing.assert_close(g(x), f(x))
    assert backend.calls == 1
    assert [k.schedule for k in backend.report.kernels if k.kind == "reduction"] == ["persistent"]


def test_gradients_through_a_dynamic_graph_equal_eager():
    w = torch.randn(24, dtype=torch.float64, requires_grad=True)

    def f(x):
        h = F.layer_norm(x, (x.shape[-1],), w) * torch.tanh(x)
        return torch.softmax(h, -1).pow(2).sum()

    g, backend = _compiled(f)
    for n in (3, 7, 10):
        x = torch.randn(n, 24, dtype=torch.float64, requires_grad=True)
        gx, gw = torch.autograd.grad(g(x), (x, w))
        rx, rw = torch.autograd.grad(f(x), (x, w))
        torch.testing.assert_close(gx, rx)
        torch.testing.assert_close(gw, rw)
    assert backend.calls == 1
    assert {g.name for g in _symbolic_graphs(backend.report)} == {"forward", "backward"}
    _assert_no_narrowing(backend.report)


def test_size_oblivious_graphs_serve_size_1_and_fxopt_adds_no_guard():
    """Under backed_size_oblivious a symbol's range includes 1, so a question like `is_contiguous()` on
    a symbolic value asks the ShapeEnv, which adds `Ne(s, 1)`: the kernel headers' value descriptions
    did that (a recompilation at size 1). fxopt decides layouts structurally; one compilation serves
    rows of 1, and the forward and backward equal eager."""
    w = torch.randn(24, dtype=torch.float64, requires_grad=True)

    def f(x):
        return torch.softmax(F.layer_norm(x, (x.shape[-1],), w) * torch.tanh(x), -1).pow(2).sum()

    g, backend = _compiled(f)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        for n in (3, 1, 7):
            x = torch.randn(n, 24, dtype=torch.float64, requires_grad=True)
            for got, want in zip(torch.autograd.grad(g(x), (x, w)), torch.autograd.grad(f(x), (x, w))):
                torch.testing.assert_close(got, want)
    assert backend.calls == 1
    _assert_no_narrowing(backend.report)


# -- a GPT block, memory plans, report --------------------------------------------------------------

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
PAIRS = [(2, 8), (3, 5), (2, 11)]


def _step(fn, model, idx):
    model.zero_grad(set_to_none=True)
    logits = fn(idx)
    lm_loss(logits, idx).backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_gpt_block_one_compilation_serves_batch_and_sequence_pairs():
    model, _ = make(CONFIG, batch=2, seq=8)
    g, backend = _compiled(model, memory_plan="apply")
    compiled_after_first = None
    for b, t in PAIRS:
        idx = torch.randint(0, CONFIG.vocab_size, (b, t), generator=torch.Generator().manual_seed(b * 100 + t))
        ref_logits, ref_grads = _step(model, model, idx)
        logits, grads = _step(g, model, idx)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")
        compiled_after_first = compiled_after_first or backend.calls
        assert backend.calls == compiled_after_first  # no recompilation for a new (batch, seq)
    rep = backend.report
    _assert_no_narrowing(rep)
    graphs = _symbolic_graphs(rep)
    assert {g.name for g in graphs} == {"forward", "backward"}
    for gr in graphs:
        assert len(gr.symbols) == 2 and all(name.startswith("s") for name in gr.symbols)
        assert any("<=" in guard for guard in gr.guards)  # the sizes' ranges (seq <= block_size)
        assert any("symbolic sizes" in note for note in gr.notes)
        plans = gr.size_plans.plans
        assert len(plans) == len(PAIRS), list(plans)  # one concrete plan per size tried
        for values, plan in plans.items():
            assert list(plan.sizes.values()) == list(values)
            assert validate_plan(plan) == [], (gr.name, values)
        assert gr.memory_plan.sizes == gr.symbols  # the reported plan says which sizes it is for
    # every attention site is reported, fused or with the reason (this tiny model's head dim 8 is below
    # the kernels' range; symbolic attention is tests/attention/test_dynamic_attention.py)
    assert rep.attention and all(s.fused or s.reason for s in rep.attention)
    assert "symbolic sizes" in str(rep)


def test_memory_plan_apply_places_intermediates_per_size():
    def f(x, w):
        h = torch.relu(x * 2) + 1
        return torch.tanh(h @ w) * 3

    w = torch.randn(40, 40, dtype=torch.float64)
    g, backend = _compiled(f, memory_plan="apply")
    for n in (3, 8, 5, 8):
        x = torch.randn(n, 40, dtype=torch.float64)
        torch.testing.assert_close(g(x, w), f(x, w))
    gr = _symbolic_graphs(backend.report)[0]
    assert "PLANS.offsets(" in gr.wrapper_source  # the arena's layout is looked up per call
    plans = gr.size_plans.plans
    assert len(plans) == 3 and all(p.buffers for p in plans.values())
    assert len({p.planned_bytes for p in plans.values()}) == 3  # each sized for its own call
    for plan in plans.values():
        assert validate_plan(plan) == []


# -- guards -----------------------------------------------------------------------------------------

def test_size_one_is_specialised_by_dynamo_and_recompiles():
    g, backend = _compiled(layernorm)
    for n in (4, 6):
        x = torch.randn(n, 5, dtype=torch.float64)
        torch.testing.assert_close(g(x), layernorm(x))
    assert backend.calls == 1
    x = torch.randn(1, 5, dtype=torch.float64)
    torch.testing.assert_close(g(x), layernorm(x))
    assert backend.calls == 2  # size 1 is a constant to dynamo: a new graph, never the symbolic one


def test_a_size_fxopt_cannot_express_runs_as_aten_with_the_reason():
    def f(x):
        return torch.sigmoid(x.reshape(x.shape[0] // 2, -1)) + 1

    g, backend = _compiled(f)
    for n in (4, 6, 10):
        x = torch.randn(n, 3, dtype=torch.float64)
        torch.testing.assert_close(g(x), f(x))
    (gr,) = backend.report.graphs
    assert backend.calls == 1 and not gr.kernels  # one graph, run as ATen for every size
    assert any("runs as ATen" in n and "s" in n and "//2" in n for n in gr.notes), gr.notes
    assert gr.fallbacks



@pytest.mark.parametrize("fn", [lambda x: x.var(-1), lambda x: x.std(0),
                                lambda x: F.batch_norm(x, None, None, training=True)], ids=["var", "std", "batch_norm"])
def test_a_float_computed_from_sizes_stays_outside_kernels_with_the_reason(fn):
    """A variance's backward scales by 2/(n-1), a SymFloat under dynamic shapes: it was taken into a
    kernel as if it were a tensor (AttributeError deep in codegen); now the op that reads it runs as ATen,
    with the reason in the report, and the gradients equal float64 eager for every size."""
    g, backend = _compiled(fn)
    for n in (5, 8, 11):
        x = torch.randn(n, 6, requires_grad=True)
        x64 = x.detach().double().requires_grad_()
        g(x).square().sum().backward()
        fn(x64).square().sum().backward()
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    assert backend.calls == 1
    reasons = [r for gr in backend.report.graphs for _, r in gr.fallbacks]
    assert any("SymFloat" in r for r in reasons), reasons


def test_an_input_view_a_looped_reduction_group_returns_is_written():
    """A group that reduces an expanded input and also returns the expand (for a later kernel): under
    symbolic sizes the looped kernel never stored it (a later kernel read uninitialised memory: gradients
    of 1e33). Forward and gradient equal float64 eager for every size."""
    def f(x):
        return (x[:, None] + x[None, :]).sum(0)

    g, backend = _compiled(f)
    for n in (3, 6, 4):
        x = torch.randn(n, 5, requires_grad=True)
        x64 = x.detach().double().requires_grad_()
        out = g(x)
        out.square().sum().backward()
        f(x64).square().sum().backward()
        torch.testing.assert_close(out.double(), f(x64), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)
    assert backend.calls == 1

# -- GPU (run with TRITON_INTERPRET=0 on a CUDA machine) ----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fn", [softmax, layernorm, rmsnorm, sum_inner, sum_outer])
def test_gpu_reductions_serve_many_sizes(fn):
    g, backend = _compiled(fn)
    for n, m in [(3, 5), (64, 4096), (5, 10000), (1000, 17), (4100, 3)]:
        x = torch.randn(n, m, device="cuda")
        torch.testing.assert_close(g(x), fn(x), rtol=1e-4, atol=1e-4)
    assert backend.calls == 1


@pytest.mark.gpu
def test_gpu_gpt_block_many_sizes():
    model, _ = make(GPTConfig(vocab_size=512, block_size=256, n_layer=2, n_head=4, n_embd=64), device="cuda")
    g, backend = _compiled(model, memory_plan="apply")
    first = None
    for b, t in [(2, 16), (8, 100), (3, 255), (64, 32)]:
        idx = torch.randint(0, 512, (b, t), device="cuda")
        ref_logits, ref_grads = _step(model, model, idx)
        logits, grads = _step(g, model, idx)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-3, atol=1e-3)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-3, atol=1e-3)
        first = first or backend.calls
        assert backend.calls == first
    _assert_no_narrowing(backend.report)


def test_a_symbolic_row_kernel_file_runs_on_its_own(tmp_path):
    """The kernel files explain and dumps write run on their own for symbolic sizes too: a norm
    backward's row kernel with column sums over a symbolic row length picks its block per call
    (`whole_row_block`, which the file must import)."""
    import subprocess

    def f(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b)

    g, backend = _compiled(f, keep_graphs=True)  # as explain: the kernel files are written
    for n, m in [(37, 48), (5, 40)]:  # a symbolic row length too
        args = [torch.randn(*shape, requires_grad=True) for shape in [(n, m), (m,), (m,)]]
        dy = torch.randn(n, m)
        for got, want in zip(torch.autograd.grad(g(*args), args, dy), torch.autograd.grad(f(*args), args, dy)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    files = [k.standalone for k in backend.report.kernels if "whole_row_block(" in k.standalone]
    assert files, [(k.name, k.schedule) for k in backend.report.kernels]
    path = tmp_path / "kernel.py"
    path.write_text(files[0])
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), ".."),
                                           os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "output 0" in run.stdout


def test_size_arithmetic_left_after_a_symbol_is_specialised():
    """Square inputs share one size symbol; a split of the matmul with a last piece of 1 specialises it,
    and the wrapper still computed `operator.sub(20, s0)` without importing operator (a NameError)."""
    def f(x, w):
        y = x @ w
        return (y * 2, *y.split(5, 0))
    for n in (16, 18):
        torch._dynamo.reset()
        x, w = torch.randn(n, n), torch.randn(n, n)
        out = torch.compile(f, backend="fxopt", dynamic=True)(x, w)
        for a, b in zip(out, f(x, w)):
            torch.testing.assert_close(a, b)
