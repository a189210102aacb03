"""libdevice-only pointwise ops: ATen calls (with the reason) in the Triton interpreter, fused on the GPU."""
import os

import pytest
import torch

import fxopt
from fxopt.analysis.op_classes import CUDA_ONLY_OPS
from fxopt.printing import target_name
from helpers import assert_close_to_reference, compile_fxopt, to64
from test_pointwise_ops import SHAPE, fused_kernels, uniform


def f_cuda_only(x, y):
    a = x * 0.5
    return (torch.tan(a), torch.asin(a), torch.acos(a), torch.atan(a), torch.sinh(a), torch.cosh(a), torch.asinh(a),
            torch.acosh(y), torch.atanh(a), torch.atan2(a, y), torch.erfc(a), y ** a, 2.0 ** a, torch.fmod(a, y),
            torch.fmod(a, 0.75), torch.hypot(a, y))


def test_cuda_only_ops(device):
    x, y = uniform(SHAPE, torch.float32, device, -1.8, 1.8), uniform(SHAPE, torch.float32, device, 1, 3, seed=1)
    rep = fxopt.explain(f_cuda_only, x, y)
    fused = {op for k in fused_kernels(rep) for op in k.ops}
    names = {target_name(op) for op in CUDA_ONLY_OPS}
    if device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":  # e.g. `-k cuda` on a GPU machine: CPU graphs run eagerly
            pytest.skip("the CPU variant checks the Triton interpreter's fallbacks: needs TRITON_INTERPRET=1")
        assert not names & fused
        by_name = {n.name: n.target for n in rep.graph("fuse").graph.nodes}
        assert {by_name[name] for name, _ in rep.fallbacks} == set(CUDA_ONLY_OPS)
        assert all("libdevice" in reason for _, reason in rep.fallbacks)
    else:
        assert names <= fused and not rep.fallbacks
    torch._dynamo.reset()
    assert_close_to_reference(compile_fxopt(f_cuda_only)(x, y), f_cuda_only(to64(x), to64(y)), torch.float32)
