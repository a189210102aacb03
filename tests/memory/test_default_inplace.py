"""In-place reuse without an applied plan: a pointwise kernel whose input dies at it writes into that
input's buffer (liveness.inplace_pairs), including a matmul result reshaped on its way in (the MLP's
GELU after the up-projection: the peak of a small block). Interpreter on CPU; results against float64."""
import torch
import torch.nn.functional as F

import fxopt
from helpers import assert_close_to_reference, compile_fxopt


def wrapper_of(fn, *args) -> str:
    rep = fxopt.explain(fn, *args)
    return rep.graphs[0].wrapper_source


def mlp_up(x, w, b):
    """[B, T, C] through a Linear as model code writes it: the matmul on [B*T, C], GELU on [B, T, 4C]."""
    h = torch.addmm(b, x.view(-1, x.shape[-1]), w).view(*x.shape[:-1], -1)
    return F.gelu(h) * 0.5


def inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 16, 32, generator=g, dtype=dtype), torch.randn(32, 128, generator=g, dtype=dtype),
            torch.randn(128, generator=g, dtype=dtype))


def test_gelu_writes_into_the_reshaped_matmul_result():
    args = inputs()
    source = wrapper_of(mlp_up, *args)
    call = source.split("def call")[-1].split("def random_inputs")[0]
    assert "in place: addmm dies at this kernel" in call and "empty_strided" not in call  # no buffer of its own
    out = compile_fxopt(mlp_up)(*args)
    assert out.shape == (1, 16, 128)
    assert_close_to_reference(out, mlp_up(*(a.double() for a in args)), torch.float32)


def test_a_matmul_result_read_again_later_is_not_overwritten():
    def both(x, w, b):
        h = torch.addmm(b, x.view(-1, x.shape[-1]), w)
        return F.gelu(h), h  # h is returned too: the GELU needs its own buffer

    args = inputs()
    assert "in place" not in wrapper_of(both, *args)
    out = compile_fxopt(both)(*args)
    assert_close_to_reference(out, both(*(a.double() for a in args)), torch.float32)


def test_a_graph_input_is_never_written():
    def scaled(x):
        return torch.sigmoid(x) * x

    x = torch.randn(4, 8)
    keep = x.clone()
    assert "in place" not in wrapper_of(scaled, x)
    out = compile_fxopt(scaled)(x)
    assert torch.equal(x, keep)
    assert_close_to_reference(out, scaled(x.double()), torch.float32)


def _row_zero_broadcast(x0, x1):
    y = x0 * x1
    return y * y[0]


def _matmul_first_row(a, w):
    m = a @ w.t()
    return m * m[:1]


def test_a_kernel_reading_a_row_of_the_dying_buffer_for_every_row_writes_elsewhere(device):
    """`y * y[0]`: the kernel reads row 0 of y for every output row. It was paired with y (a row-major
    `select` taken for a reshape) and wrote over it, so every block after the first read an overwritten
    row 0 (the fuzzer of 2026-12-06: 2,176 of 2,400 elements wrong, blocks run in order here; a race on
    a GPU). Shapes of more than one 1024-element block."""
    g = torch.Generator().manual_seed(0)
    x0, x1 = torch.randn(15, 5, 16, generator=g), torch.randn(5, 16, generator=g)
    a, w = torch.randn(75, 16, generator=g), torch.randn(64, 16, generator=g)
    for fn, args in ((_row_zero_broadcast, (x0, x1)), (_matmul_first_row, (a, w))):
        args = tuple(t.to(device) for t in args)
        assert "in place" not in wrapper_of(fn, *args)
        out = compile_fxopt(fn)(*args)
        assert_close_to_reference(out, fn(*(t.double() for t in args)), torch.float32)


def test_memory_plan_false_writes_nothing_in_place():
    """The README's `memory_plan=False: off` includes the default in-place reuse."""
    args = inputs()
    assert "in place" in wrapper_of(mlp_up, *args)
    source = fxopt.explain(mlp_up, *args, memory_plan=False).graphs[0].wrapper_source
    assert "in place" not in source
    out = compile_fxopt(mlp_up, memory_plan=False)(*args)
    assert_close_to_reference(out, mlp_up(*(a.double() for a in args)), torch.float32)
