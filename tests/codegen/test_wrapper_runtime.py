"""codegen/wrapper_runtime.py and the wrapper lines that use it: allocations through torch's C
allocator, layout checks in C with fxopt's message, CUDA wrappers under a device guard, per-call grid
arithmetic in plain Python that gives Triton's answers."""
import pytest
import torch
import triton

import fxopt
from fxopt.codegen.wrapper_runtime import cdiv, check_layout, empty_strided_cpu, next_power_of_2


def test_the_c_allocator_gives_the_asked_layout():
    t = empty_strided_cpu((2, 3, 4), (12, 1, 3), torch.float16)
    assert (t.shape, t.stride(), t.dtype, t.device.type) == ((2, 3, 4), (12, 1, 3), torch.float16, "cpu")


def test_check_layout_refuses_other_strides_with_the_fix_named():
    x = torch.empty(4, 6)
    check_layout(x, (4, 6), (6, 1), "x")
    check_layout(torch.empty(4, 1, 6), (4, 1, 6), (6, 99, 1), "y")  # a size-1 dim's stride is never read
    with pytest.raises(RuntimeError, match=r"input 'x' has shape \(6, 4\) stride \(1, 6\).*recompile"):
        check_layout(x.t(), (6, 4), (4, 1), "x")
    with pytest.raises(RuntimeError, match="compiled for shape"):
        check_layout(x, (4, 7), (7, 1), "x")


def _source(fn, *inputs):
    return "\n".join(g.wrapper_source for g in fxopt.explain(fn, *inputs).graphs)


def test_cpu_wrappers_allocate_through_the_c_allocator():
    src = _source(lambda x: (x * 2).softmax(-1), torch.randn(8, 32))
    assert "empty_strided_cpu((8, 32), (32, 1), torch.float32)" in src
    assert "device_guard" not in src.split("def call")[1]  # CPU graphs need no device guard


@pytest.mark.gpu
def test_cuda_wrappers_run_on_their_device():
    x = torch.randn(8, 32, device="cuda")
    src = _source(lambda x: (x * 2).softmax(-1), x)
    assert "with device_guard(0):" in src and "empty_strided_cuda((8, 32), (32, 1), torch.float32)" in src
    out = torch.compile(lambda x: (x * 2).softmax(-1), backend="fxopt")(x)
    torch.testing.assert_close(out.double(), (x.double() * 2).softmax(-1))


def test_cdiv_and_next_power_of_2_agree_with_triton():
    for n in [0, 1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 4095, 4096, 4097, 131072, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 2, 3, 16, 128, 1000, 1024):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
