"""Views in generated wrappers: made with reinterpret_tensor (C) where the base's layout is proven at
codegen (kernel outputs, checked inputs, matmul results, views of these), with the view method
otherwise; either way the compiled function equals eager."""
import re

import torch
import torch.nn.functional as F

import fxopt
from fxopt.codegen.wrapper_layouts import launch_checks


def _wrapper_of(fn, *inputs):
    rep = fxopt.explain(fn, *inputs)
    return "\n".join(g.wrapper_source for g in rep.graphs)


def test_views_of_kernel_outputs_and_matmuls_are_reinterpreted_and_right():
    def f(x, w):
        h = F.gelu(x * 2.0)  # a kernel output
        y = h.view(4, 6, 8).transpose(1, 2)  # views of it
        z = (y.reshape(4, 48) @ w).view(4, 4, 3)  # a matmul result, viewed
        return z.permute(2, 0, 1) + 1.0, y.sum()
    x, w = torch.randn(24, 8, dtype=torch.float64), torch.randn(48, 12, dtype=torch.float64)
    src = _wrapper_of(f, x, w)
    assert "reinterpret_tensor(" in src
    compiled = torch.compile(f, backend="fxopt")
    for got, want in zip(compiled(x, w), f(x, w)):
        torch.testing.assert_close(got, want)


def test_views_under_symbolic_sizes_are_reinterpreted_with_size_expressions():
    """The same proof under symbolic sizes: the view's sizes and strides are written as expressions of the
    size symbols, evaluated per call; one compilation serves every size."""
    from helpers import CountingBackend

    def f(x, w):
        h = torch.relu(x * 2.0)  # [N, 8] kernel output
        y = (h @ w).view(-1, 3, 4).transpose(1, 2)  # a matmul result [N, 12], viewed
        return y, h.view(-1, 2, 4)
    be = CountingBackend()
    compiled = torch.compile(f, backend=be)
    for n in (6, 10, 34):
        x, w = torch.randn(n, 8, dtype=torch.float64), torch.randn(8, 12, dtype=torch.float64)
        torch._dynamo.mark_dynamic(x, 0)  # the rows symbolic (the feature dims stay numbers, as in a model)
        for got, want in zip(compiled(x, w), f(x, w)):
            assert got.shape == want.shape and got.stride() == want.stride()
            torch.testing.assert_close(got, want)
    assert be.calls == 1
    views = [line for line in be.report.wrapper_source.splitlines() if "reinterpret_tensor(" in line]
    assert views and any(any(c.isalpha() for c in line.split("reinterpret_tensor(")[1].split(",", 1)[1])
                         for line in views)  # a size or stride expression with a symbol in it


def test_a_view_of_an_unchecked_input_keeps_the_view_method():
    def f(x, w):
        return x.view(6, 4) @ w  # x only feeds a view and a matmul: its layout is never checked
    x, w = torch.randn(24), torch.randn(4, 5)
    src = _wrapper_of(f, x, w)
    assert ".view([6, 4])" in src and "reinterpret_tensor(" not in src
    torch.testing.assert_close(torch.compile(f, backend="fxopt")(x, w), f(x, w))


def test_launch_checks_name_only_graph_inputs(monkeypatch):
    """Which kernel arguments a launch re-checks: the graph's inputs (a caller may pass any view), not
    kernel outputs, matmul results or views of them, nor the wrapper's literal ints."""
    import fxopt.compile as compile_module
    seen = []

    def recording(gm, kernels, launched):
        checks = launch_checks(gm, kernels, launched)
        seen.append((gm, kernels, checks))
        return checks
    monkeypatch.setattr(compile_module, "launch_checks", recording)

    def f(x, w):
        h = torch.relu(x * 2.0)
        y = (h @ w).t()
        return torch.sigmoid(y) + 1.0, h
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    got = torch.compile(f, backend="fxopt")(x, w)
    for g, want in zip(got, f(x, w)):
        torch.testing.assert_close(g, want)
    (gm, kernels, checks), = seen
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert len(calls) == 2
    for n in calls:
        want = tuple(i for i, a in enumerate(n.args) if a.op == "placeholder")
        assert checks[kernels[n.target].name] == want, (n.name, [a.name for a in n.args])
    assert any(a.op != "placeholder" for n in calls for a in n.args)  # a kernel reads a matmul result


def test_a_split_of_a_matmul_result_is_not_called_its_pieces_are_views_at_their_offsets():
    """GPT-2's `q, k, v = c_attn(x).split(d, dim=2)`: the split of a proven value is elided, each piece
    a reinterpret_tensor view `k * d` elements in; outputs equal eager, strides and offsets too, and a
    piece used after the split's input is gone is still right (the pieces are made at the split)."""
    def f(x, w):
        qkv = (x @ w).view(2, 5, 3 * 4)
        q, k, v = qkv.split(4, dim=2)
        return (q * k).view(2, 5, 2, 2).permute(0, 2, 1, 3) + 1.0, v, torch.sigmoid(v.transpose(1, 2))
    x, w = torch.randn(10, 6, dtype=torch.float64), torch.randn(6, 12, dtype=torch.float64)
    src = _wrapper_of(f, x, w)
    assert "split" not in src.split("def call", 1)[1].replace("split_with_sizes =", "")  # no split call
    assert ", 4)" in src and ", 8)" in src  # the pieces at element offsets 4 and 8
    compiled = torch.compile(f, backend="fxopt")
    for got, want in zip(compiled(x, w), f(x, w)):
        assert got.shape == want.shape and got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset()
        torch.testing.assert_close(got, want)


def test_a_split_of_an_unchecked_input_is_called():
    def f(x):
        a, b = x.split([2, 3], dim=1)
        return a.sum() + b.sum()
    x = torch.randn(4, 5)
    src = _wrapper_of(f, x)
    assert "split" in src.split("def call", 1)[1]
    torch.testing.assert_close(torch.compile(f, backend="fxopt")(x), f(x))


def test_in_place_update_of_a_slice_writes_its_kernel_output_at_offset_zero():
    """`y[1:3].mul_(3)` then backward: the backward's clone of the gradient's slice was traced with the
    slice's storage offset (4), and its kernel stored at `xindex + 4` into a fresh [2, 4] buffer the wrapper
    allocates at offset 0: one element past the end (heap corruption, garbage gradients)."""
    def f(x):
        y = x * 2
        y[1:3].mul_(3)
        return y

    x = torch.randn(3, 4, requires_grad=True)
    rep = fxopt.explain(lambda x: f(x).sum(), x)
    backward = [k for k in rep.kernels if k.graph == "backward"]
    assert backward, "the slice's gradient ran in no kernel"
    for k in backward:
        outputs = re.findall(r"tl\.store\(out_ptr\d+ \+ \(([^)]*)\)", k.source)
        assert outputs and all(o.strip() == "xindex" for o in outputs), (k.name, outputs)
    xc = x.detach().clone().requires_grad_()
    out = torch.compile(f, backend="fxopt")(xc)
    out.sum().backward()
    f(x).sum().backward()
    torch.testing.assert_close(out, f(x.detach()))
    torch.testing.assert_close(xc.grad, x.grad)
