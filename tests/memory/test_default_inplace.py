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
