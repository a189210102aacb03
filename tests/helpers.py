"""Shared test helpers: compile through the real entry points and compare with float64 eager."""
from __future__ import annotations

import torch

import fxopt

# Tolerances for comparing against a float64 reference, by the dtype the model computes in.
TOL = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-9, 1e-12),
       torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def to64(x):
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        return x.detach().double()
    return x


def assert_close_to_reference(out, ref64, dtype):
    """`out` (computed in dtype) against the same function evaluated in float64."""
    rtol, atol = TOL.get(dtype, (1e-4, 1e-5))
    if isinstance(out, (tuple, list)):
        for o, r in zip(out, ref64):
            assert_close_to_reference(o, r, dtype)
        return
    if not out.dtype.is_floating_point:
        assert torch.equal(out.cpu(), ref64.to(out.dtype).cpu()), (out, ref64)
        return
    torch.testing.assert_close(out.double().cpu(), ref64.double().cpu(), rtol=rtol, atol=atol, equal_nan=True)


class CountingBackend:
    """A torch.compile backend that compiles through fxopt into one Report and counts dynamo's calls
    (how tests prove that one compilation served several sizes)."""

    def __init__(self, **options):
        self.options, self.report, self.calls = fxopt.Options(**options), fxopt.Report(), 0

    def __call__(self, gm, example_inputs):
        from fxopt.backend import compile_dynamo_graph
        self.calls += 1
        return compile_dynamo_graph(gm, example_inputs, self.options, self.report)


def compile_fxopt(fn, **options):
    """torch.compile through the configured backend (fresh dynamo state is the fixture's job)."""
    return torch.compile(fn, backend=fxopt.backend(**options) if options else "fxopt", dynamic=False)


def kernel_count(fn, *inputs, graph="forward", **options) -> int:
    rep = fxopt.explain(fn, *inputs, **options)
    return sum(1 for k in rep.kernels if k.graph in (graph, "inference"))


def retained_graph_step(net, x1, x2) -> None:
    """backward(retain_graph=True) of one loss, another forward, then the first loss's backward again
    and the second's: what CUDA-graph lending must survive (tests/test_cudagraphs*.py)."""
    first = net(x1).square().mean()
    first.backward(retain_graph=True)
    second = net(x2).square().mean()
    first.backward()
    second.backward()


def jit_kernels(source: str) -> int:
    """Kernels in generated source: @triton.jit functions other than the combine helpers (_fx_*) they call."""
    import re
    return len(re.findall(r"@triton\.jit\ndef (?!_fx_)", source))
