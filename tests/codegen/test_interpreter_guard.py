"""Interpreted kernels must leave triton.language as they found it (a GPU compile later in the same
process uses it): the Triton interpreter leaks patches when tl.sum/tl.max run inside a kernel."""
import inspect

import torch
import triton.language as tl

from fxopt.codegen.interpreter_guard import _patched_namespaces
from tests.helpers import compile_fxopt


def snapshot():
    return {(id(space), name): value for space in _patched_namespaces() for name, value in inspect.getmembers(space)
            if not name.startswith("__")}


def test_reduction_kernels_leave_triton_language_unpatched():
    before = snapshot()
    x = torch.randn(6, 30)
    compile_fxopt(lambda x: torch.softmax(x, -1))(x)
    compile_fxopt(lambda x: x.t() * 2 + x.amax())(torch.randn(20, 20))
    after = snapshot()
    changed = [name for key, name in [(k, k[1]) for k in before] if after.get(key) is not before[key]]
    assert not changed, changed[:10]
    assert tl.core.arange is before[(id(tl.core), "arange")]


def test_numpy_too_new_for_the_interpreter_is_named_with_the_fix():
    """Triton 3.6's interpreter fails inside a kernel whose loop bound is a tensor when numpy is 2.4 or
    newer (checked with triton 3.6 + numpy 2.4.6); the launch says what to install instead."""
    import pytest

    from fxopt.codegen.interpreter_guard import NUMPY_TOO_NEW, GuardedKernel

    class Failing:  # what triton 3.6's interpreter raises there
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise RuntimeError("InterpreterError(\"TypeError('only 0-dimensional arrays can be converted "
                                   "to Python scalars')\")")
            return run

    with pytest.raises(RuntimeError) as raised:
        GuardedKernel(Failing())[(1,)]()
    assert str(raised.value) == NUMPY_TOO_NEW and "numpy<2.4" in NUMPY_TOO_NEW

    class OtherError:
        def __getitem__(self, grid):
            return lambda: 1 / 0

    with pytest.raises(ZeroDivisionError):  # anything else goes through unchanged
        GuardedKernel(OtherError())[(1,)]()
