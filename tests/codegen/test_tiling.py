"""2-D tiled pointwise kernels: an operand contiguous along an outer dim (a transposed input next to a
contiguous one) is read in YBLOCK x XBLOCK tiles, so every load coalesces along its contiguous axis.

Results are compared with float64 eager through torch.compile (interpreter on CPU); the structure
(tiled or not, grid, int64 indexing, grid-limit fallback) is checked on the generated source.
"""
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt.codegen.indexing import IterationSpace, Layout, TiledSpace, tile_dim
from fxopt.codegen.pointwise_launch import GRID_MAX, plan_tiles, tile_config
from fxopt.codegen.triton_pointwise import generate_pointwise_kernel

from helpers import assert_close_to_reference, compile_fxopt, to64

DTYPES = [torch.float32, torch.bfloat16]


def pointwise_kernels(fn, *inputs):
    rep = fxopt.explain(fn, *inputs)
    return [k for k in rep.kernels if k.kind == "pointwise"], rep.wrapper_source


def check(fn, *inputs, dtype):
    """fxopt through torch.compile against fn in float64; layouts (strides) must match eager's."""
    out = compile_fxopt(fn)(*inputs)
    ref = fn(*(to64(x) for x in inputs))
    assert_close_to_reference(out, ref, dtype)
    eager = fn(*inputs)
    for o, e in zip(out if isinstance(out, tuple) else (out,), eager if isinstance(eager, tuple) else (eager,)):
        assert o.dtype == e.dtype and o.shape == e.shape and o.stride() == e.stride()
    return out


def transposed_add(x, y):
    return x.t() * 2 + y


@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_plus_contiguous_2d(device, dtype):
    # 67x45: neither dim a multiple of the 64x64 tile, so both masks matter
    x = torch.randn(67, 45, device=device, dtype=dtype)
    y = torch.randn(45, 67, device=device, dtype=dtype)
    check(transposed_add, x, y, dtype=dtype)
    kernels, wrapper = pointwise_kernels(transposed_add, x, y)
    assert len(kernels) == 1
    src = kernels[0].source
    assert "yindex = yoffset + tl.arange(0, YBLOCK)[:, None]" in src
    assert "xindex = xoffset + tl.arange(0, XBLOCK)[None, :]" in src
    assert "ymask & xmask" in src and "tl.program_id(1)" in src
    assert "(67*xindex + yindex)" in src  # y, read along its contiguous axis
    assert "YBLOCK=64, XBLOCK=64, num_warps=4" in wrapper and "[(2, 1)](" in wrapper


@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_021_3d(device, dtype):
    def f(x, y):
        return torch.sigmoid(x.permute(0, 2, 1)) * y - y

    x = torch.randn(3, 37, 70, device=device, dtype=dtype)
    y = torch.randn(3, 70, 37, device=device, dtype=dtype)
    check(f, x, y, dtype=dtype)
    kernels, _ = pointwise_kernels(f, x, y)
    assert len(kernels) == 1 and "yindex" in kernels[0].source


@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_dim_moved_innermost_among_outer_dims(device, dtype):
    # y (strides (1, 5, 30)) is contiguous along the outermost domain dim: the tile's y axis walks
    # (dim 1, dim 0), dim 0 innermost, with coordinates y0, y1 taken from yindex
    def f(x, y):
        return x * 3 + y

    x = torch.randn(5, 6, 7, device=device, dtype=dtype)
    y = torch.randn(7, 6, 5, device=device, dtype=dtype).permute(2, 1, 0)
    check(f, x, y, dtype=dtype)
    kernels, _ = pointwise_kernels(f, x, y)
    assert len(kernels) == 1
    src = kernels[0].source
    assert "y0 = (yindex // 5)" in src and "y1 = yindex % 5" in src
    assert "(30*xindex + yindex)" in src and "(xindex + 7*y0 + 42*y1)" in src  # y laid out like the tile


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_with_broadcast_operands(device, dtype):
    def f(x, y, row, col, s):
        return F.gelu(x.t() + y * row) + col * s

    x = torch.randn(67, 45, device=device, dtype=dtype)
    y = torch.randn(45, 67, device=device, dtype=dtype)
    row, col = torch.randn(67, device=device, dtype=dtype), torch.randn(45, 1, device=device, dtype=dtype)
    s = torch.randn((), device=device, dtype=dtype)
    check(f, x, y, row, col, s, dtype=dtype)
    kernels, _ = pointwise_kernels(f, x, y, row, col, s)
    tiled = [k for k in kernels if "yindex" in k.source]
    assert len(tiled) == 1
    assert "ymask, eviction_policy" in tiled[0].source  # a [YBLOCK, 1] load of a broadcast operand


@pytest.mark.parametrize("dtype", DTYPES)
def test_multiple_outputs_with_different_layouts(device, dtype):
    def f(x, y):
        a = x.t() * 2  # column-major, like x.t()
        b = y + a  # row-major, like y
        return a, b, torch.tanh(b) * a

    x = torch.randn(67, 45, device=device, dtype=dtype)
    y = torch.randn(45, 67, device=device, dtype=dtype)
    outs = check(f, x, y, dtype=dtype)
    assert outs[0].stride() == (1, 45) and outs[1].stride() == (67, 1)
    kernels, _ = pointwise_kernels(f, x, y)
    assert len(kernels) == 1 and "yindex" in kernels[0].source
    assert kernels[0].source.count("tl.store(") == 3


def test_plain_contiguous_chain_is_not_tiled(device):
    def f(x, b):
        return torch.tanh(x * 2 + b) * x

    x, b = torch.randn(67, 45, device=device), torch.randn(45, device=device)
    check(f, x, b, dtype=torch.float32)
    kernels, wrapper = pointwise_kernels(f, x, b)
    assert len(kernels) == 1 and "yindex" not in kernels[0].source and "YBLOCK" not in wrapper
    assert f"{kernels[0].name}[(" in wrapper and ",)](" in wrapper  # 1-D launch, as before


def test_transposed_input_alone_is_not_tiled(device):
    # the output follows the input's layout: one flat index is contiguous for both
    def f(x):
        return x.permute(0, 2, 1) * 2 + 1

    x = torch.randn(3, 37, 70, device=device)
    check(f, x, dtype=torch.float32)
    kernels, _ = pointwise_kernels(f, x)
    assert len(kernels) == 1 and "yindex" not in kernels[0].source


# -- iteration space and launch plan, without tensors ----

def test_tile_dim_and_tiled_addresses():
    # domain [45, 67] in the order of a column-major output; y row-major
    space = IterationSpace((45, 67), (1, 45), [Layout((45, 67), (1, 45)), Layout((45, 67), (67, 1))])
    assert space.sizes == [67, 45] and tile_dim(space) == 0
    tiles = TiledSpace(space, 0)
    assert (tiles.ysizes, tiles.xnumel) == ([67], 45)
    assert str(tiles.address(0)) == "xindex + 45*yindex" and str(tiles.address(1)) == "67*xindex + yindex"
    assert tiles.max_address(1) == 45 * 67 - 1
    # broadcast along the innermost dim only (a column): lanes share addresses, no tiling
    col = IterationSpace((45, 67), (67, 1), [Layout((45, 67), (67, 1)), Layout((45, 1), (1, 1))])
    assert tile_dim(col) is None


def test_tile_config_is_64x64_for_large_tensors_and_shrinks_to_fit():
    assert tile_config(8192, 8192) == (64, 64, 4)
    for ynumel in (1, 2, 3, 45, 67, 5000):
        for xnumel in (1, 2, 3, 45, 67, 5000):
            y, x, warps = tile_config(ynumel, xnumel)
            assert y & (y - 1) == 0 and x & (x - 1) == 0 and y * x <= 4096 and 1 <= warps <= 4
            assert y < 2 * ynumel and x < 2 * xnumel  # never a tile twice the tensor
    assert tile_config(8192, 3) == (1024, 4, 4)  # a short innermost dim gives its lanes to y


def fake_kernel(fn, *shapes, dtype=torch.float32):
    with FakeTensorMode():
        inputs = [torch.empty(s, dtype=dtype) for s in shapes]
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    return generate_pointwise_kernel(gm, "k", "cuda")


def test_grid_over_cuda_limit_falls_back_to_flat_kernel():
    # y contiguous along the outer dim of size 2: tiles of 2 x 2048 would need > 65535 programs on axis 1
    space = IterationSpace((2, 200_000_000), (200_000_000, 1),
                           [Layout((2, 200_000_000), (200_000_000, 1)), Layout((2, 200_000_000), (1, 2))])
    assert tile_dim(space) == 0 and plan_tiles(space) is None
    k = fake_kernel(lambda x, y: x * 2 + y.permute(1, 0), (2, 200_000_000), (200_000_000, 2))
    assert "yindex" not in k.source and isinstance(k.grid, int)
    k = fake_kernel(lambda x, y: x * 2 + y.permute(1, 0), (2, 1_000_000), (1_000_000, 2))
    assert "yindex" in k.source and k.grid_tuple()[1] <= GRID_MAX[1]


def test_tiled_kernel_indexes_in_int64_past_int32():
    k = fake_kernel(lambda x, y: x.permute(1, 0) * 2 + y, (50000, 50000), (50000, 50000), dtype=torch.bfloat16)
    assert "yoffset = tl.program_id(0).to(tl.int64) * YBLOCK" in k.source
    assert "xoffset = tl.program_id(1).to(tl.int64) * XBLOCK" in k.source
    assert k.grid == (782, 782) and k.int_args == [50000, 50000]
    small = fake_kernel(lambda x, y: x.permute(1, 0) * 2 + y, (300, 200), (200, 300))
    assert "yindex" in small.source and "int64" not in small.source


def load_kernel(k, tmp_path):
    path = tmp_path / f"{k.name}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n" + k.source)
    spec = importlib.util.spec_from_file_location(k.name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, k.name)


def test_value_from_one_axis_only_is_stored_over_the_whole_tile(tmp_path):
    # the second output reads only a row vector (a [YBLOCK, 1] block in registers): its store must
    # still cover every column of the tile
    def f(x, y, row):
        return x.permute(1, 0) + y, row.expand(45, 67) * 2

    with FakeTensorMode():
        fakes = [torch.empty(67, 45), torch.empty(45, 67), torch.empty(67)]
    gm = make_fx(f, tracing_mode="fake")(*fakes)
    k = generate_pointwise_kernel(gm, "k_rows", "interpret")
    assert "yindex" in k.source and "tl.load(in_ptr2 + (yindex), ymask, " in k.source
    x, y, row = torch.randn(67, 45), torch.randn(45, 67), torch.randn(67)
    outs = [torch.empty_strided(o.shape, o.stride()) for o in k.outputs]
    load_kernel(k, tmp_path)[k.grid_tuple()](x, y, row, *outs, *k.int_args, **k.constexprs,
                                             num_warps=k.num_warps)
    for got, want in zip(outs, f(x, y, row)):
        torch.testing.assert_close(got, want)


def test_symbolic_sizes_keep_2d_tiles_on_one_grid_axis(device):
    """dynamic=True: the innermost dim is symbolic, so its tile count could pass grid axis 1's limit of
    65535; the tiles then run on one axis (x tiles fastest). One compilation, every size exact, sizes
    that are not multiples of the 64x64 tile included."""
    from helpers import CountingBackend

    backend = CountingBackend()
    compiled = torch.compile(transposed_add, backend=backend, dynamic=True)
    for rows, cols in [(67, 45), (130, 3), (5, 200)]:
        x = torch.randn(rows, cols, device=device)
        y = torch.randn(cols, rows, device=device)
        torch.testing.assert_close(compiled(x, y), transposed_add(x.double(), y.double()).float())
    assert backend.calls == 1
    kernels = [k for k in backend.report.kernels if k.kind == "pointwise"]
    assert len(kernels) == 1
    src = kernels[0].source
    assert "tile // xtiles" in src and "tl.program_id(1)" not in src
    assert "ymask & xmask" in src
