"""`cat` fused into pointwise kernels (codegen/cat_pieces.py): each input read at its offset along the
dim, the consumers in the same kernel; against float64 eager, on the CPU (interpreter) and CUDA."""
import pytest
import torch

import fxopt
from helpers import assert_close_to_reference, compile_fxopt, to64


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotary(q, cos, sin):  # as Hugging Face's Llama writes apply_rotary_pos_emb
    return q * cos + rotate_half(q) * sin


def check(fn, *inputs, dtype):
    out = compile_fxopt(fn)(*inputs)
    assert_close_to_reference(out, fn(*(to64(x) for x in inputs)), dtype)
    eager = fn(*inputs)
    assert out.shape == eager.shape and out.dtype == eager.dtype and out.stride() == eager.stride()


def ops_and_wrapper(fn, *inputs):
    rep = fxopt.explain(fn, *inputs)
    return [op for k in rep.kernels for op in k.ops], rep.wrapper_source, rep


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rotary_embedding_cat_fuses_with_its_multiply_add(device, dtype):
    q = torch.randn(2, 12, 4, 32, device=device).to(dtype).transpose(1, 2)  # [B, H, T, D] view of [B, T, H, D]
    cos, sin = (torch.randn(12, 32, device=device).to(dtype) for _ in range(2))
    ops, wrapper, _ = ops_and_wrapper(rotary, q, cos, sin)
    assert "aten.cat.default" in ops and "torch.cat" not in wrapper and "aten.cat" not in wrapper.split("def call")[1]
    check(rotary, q, cos, sin, dtype=dtype)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_three_uneven_pieces_along_any_dim_with_strided_inputs(device, dim):
    shape = [6, 5, 7]
    parts = []
    for k, size in enumerate((1, 3, 4)):
        s = list(shape)
        s[dim] = size
        t = torch.randn(*reversed(s), device=device).permute(2, 1, 0) if k == 1 else torch.randn(*s, device=device)
        parts.append(t)
    w = torch.randn(8 if dim == 2 else shape[2], device=device)

    def f(a, b, c, w):
        return torch.sigmoid(torch.cat([a, b, c], dim) * 2.0) + w

    ops, wrapper, _ = ops_and_wrapper(f, *parts, w)
    assert "aten.cat.default" in ops and "torch.cat" not in wrapper
    check(f, *parts, w, dtype=torch.float32)


def test_a_cat_with_nothing_to_fuse_stays_atens_copy(device):
    """A cat read only by ATen calls saves no pass over memory as a kernel: it stays ATen, with the reason."""
    a, b, w = (torch.randn(4, 3, device=device), torch.randn(4, 9, device=device),
               torch.randn(12, 5, device=device))
    f = lambda a, b, w: torch.cat([a, b], -1) @ w  # noqa: E731
    ops, wrapper, rep = ops_and_wrapper(f, a, b, w)
    assert "aten.cat.default" not in ops and "torch.cat(" in wrapper
    assert any("no element-wise consumer" in why for _, why in rep.fallbacks)
    check(f, a, b, w, dtype=torch.float32)


def test_cat_promoting_dtypes_stays_aten_with_its_reason():
    a, b = torch.randn(4, 3, dtype=torch.float16), torch.randn(4, 5)
    f = lambda a, b: torch.cat([a, b], -1) * 2.0  # noqa: E731
    ops, wrapper, rep = ops_and_wrapper(f, a, b)
    assert "aten.cat.default" not in ops
    assert any("promoting dtypes" in why for _, why in rep.fallbacks)
    torch.testing.assert_close(compile_fxopt(f)(a, b), f(a, b))


def test_gradients_through_a_fused_cat_equal_eager():
    q = torch.randn(2, 6, 2, 16, dtype=torch.float64).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(6, 16, dtype=torch.float64), torch.randn(6, 16, dtype=torch.float64)
    g = torch.randn(2, 2, 6, 16, dtype=torch.float64)
    got = torch.autograd.grad(compile_fxopt(rotary)(q, cos, sin), q, g)[0]
    want = torch.autograd.grad(rotary(q, cos, sin), q, g)[0]
    torch.testing.assert_close(got, want)


def test_a_cat_kernel_never_writes_over_an_input_it_reads_shifted():
    """With the memory plan applied, an element-wise kernel may write its output over an input that dies
    there; a kernel with a cat reads that input at other lanes' indices, so it must not (while a plain
    element-wise kernel of the same shapes does)."""
    def f(x, w):
        q = x * 2.0  # a kernel output that dies in the next kernel, with that kernel's output layout
        return (rotate_half(q) + 1.0) @ w  # the cat kernel's output is an intermediate: planned

    def g(x, w):  # the same kernels, but the last one reads q element by element
        q = x * 2.0
        b = -q[:, :1]  # its own kernel ([24, 1]), which the last kernel depends on, as the cat's does
        return (q * 1.5 + b) @ w
    x, w = torch.randn(24, 32), torch.randn(32, 8)
    pairs = lambda fn: [p for gr in fxopt.explain(fn, x, w, memory_plan="apply").graphs  # noqa: E731
                        for p in (gr.memory_plan.inplace if gr.memory_plan else [])]
    assert pairs(g), "the element-wise twin should be written in place (else this test checks nothing)"
    assert pairs(f) == []
    out = compile_fxopt(f, memory_plan="apply")(x, w)
    assert_close_to_reference(out, f(to64(x), to64(w)), torch.float32)


EDGE_CASES = {
    "the same tensor twice": (lambda x: torch.cat([x, x], dim=-2) * 3, [(3, 4, 5)]),
    "an expanded piece": (lambda a, b: torch.cat([a.expand(4, 3), b], 1) * 2, [(1, 3), (4, 6)]),
    "transposed pieces": (lambda a, b: torch.cat([a.t(), b.t()], 0) + 0.5, [(40, 8), (40, 24)]),
    "a strided piece": (lambda a, b: torch.cat([a[:, ::2], b], 1) * 2, [(6, 8), (6, 3)]),
    # pieces of one element (stride 0 everywhere): a scalar load, not a pointer block (a Triton error)
    "expanded 0-d pieces": (lambda a, b, y: torch.cat([a.expand(4, 3), b.expand(4, 4)], 1) * y, [(), (), (4, 7)]),
}


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_cat_edge_cases_fuse_and_match_float64(device, case):
    fn, shapes = EDGE_CASES[case]
    inputs = [torch.randn(s, device=device) for s in shapes]
    ops, _, _ = ops_and_wrapper(fn, *inputs)
    assert "aten.cat.default" in ops
    check(fn, *inputs, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=str)
def test_integer_and_bool_cats_are_exact(device, dtype):
    a, b = (torch.randint(0, 5, s, device=device).to(dtype) for s in ((2, 5), (3, 5)))
    fn = (lambda a, b: torch.cat([a, b], 0) + 1) if dtype != torch.bool else \
        (lambda a, b: torch.logical_not(torch.cat([a, b], 0)))
    ops, _, _ = ops_and_wrapper(fn, a, b)
    assert "aten.cat.default" in ops
    assert torch.equal(compile_fxopt(fn)(a, b), fn(a, b))


def test_rotary_cat_fuses_under_symbolic_batch_and_sequence(device):
    """Only the sizes along the cat dim must be numbers (the pieces' bounds): a rotary cat over the head
    dim fuses with symbolic batch and sequence, and one compilation serves every size."""
    from helpers import CountingBackend
    be = CountingBackend()
    compiled = torch.compile(rotary, backend=be)
    for B, T in ((2, 12), (3, 7), (5, 20)):
        q = torch.randn(B, T, 4, 32, device=device).transpose(1, 2)
        cos, sin = (torch.randn(T, 32, device=device) for _ in range(2))
        for t, dims in ((q, (0, 2)), (cos, (0,)), (sin, (0,))):  # the head dim stays a number, as in a model
            torch._dynamo.mark_dynamic(t, dims)
        out = compiled(q, cos, sin)
        assert_close_to_reference(out, rotary(to64(q), to64(cos), to64(sin)), torch.float32)
    assert be.calls == 1
    ops = [op for k in be.report.kernels for op in k.ops]
    assert "aten.cat.default" in ops and "torch.cat" not in be.report.wrapper_source


def test_a_cat_along_a_symbolic_dim_stays_aten_with_its_reason():
    from helpers import CountingBackend
    be = CountingBackend()
    f = lambda a, b: torch.cat([a, b], 0) * 2.0  # noqa: E731
    compiled = torch.compile(f, backend=be, dynamic=True)
    for n in (3, 5):
        a, b = torch.randn(n, 4), torch.randn(n + 1, 4)
        torch.testing.assert_close(compiled(a, b), f(a, b))
    assert any("cat along a symbolic size" in why for _, why in be.report.fallbacks)


def test_the_backward_of_summing_split_pieces(device):
    """Its backward cats expanded 0-d gradients (one per piece): the case the sweep found crashing."""
    fn = lambda t: sum(p.sum() for p in t.split(3, 1)) + t  # noqa: E731
    x = torch.randn(4, 7, device=device, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    compile_fxopt(fn)(x).square().sum().backward()
    fn(x64).square().sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
