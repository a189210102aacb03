"""The pointwise-fusion property under symbolic sizes: the random elementwise programs of
test_fuse_property.py compiled once with dynamic=True, then called at several sizes (the programs'
4 and 6 become other sizes together, broadcasting dims of 1 stay 1), each result against the same
program in float64, without a recompilation."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from helpers import CountingBackend, assert_close_to_reference, to64
from test_fuse_property import _build, programs

SIZE_SETS = [{4: 4, 6: 6}, {4: 3, 6: 9}, {4: 7, 6: 5}, {4: 2, 6: 33}]


def _resize(shape, sizes):
    return tuple(sizes.get(d, d) for d in shape)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=programs(), seed=st.integers(0, 2**16), order=st.permutations(range(len(SIZE_SETS))))
def test_random_pointwise_programs_serve_every_size_from_one_compilation(prog, seed, order):
    source, shapes, dtype = prog
    note(source)
    note(f"shapes={shapes} dtype={dtype}")
    fn = _build(source)
    g = torch.Generator().manual_seed(seed)
    torch._dynamo.reset()
    backend = CountingBackend()
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    calls_after_first = None
    for i in order:
        sizes = SIZE_SETS[i]
        inputs = [(torch.rand(_resize(s, sizes), generator=g, dtype=torch.float64) * 2 - 1).to(dtype) for s in shapes]
        out = compiled(*inputs)
        eager = fn(*inputs)
        for o, e in zip(out, eager):
            assert (o.dtype, o.shape) == (e.dtype, e.shape)
        assert_close_to_reference(out, fn(*[to64(t) for t in inputs]), dtype)
        if calls_after_first is None:
            calls_after_first = backend.calls
            sized = any(d > 1 for e in eager for d in e.shape)  # a result with a size that varies
    assert backend.calls == calls_after_first, "recompiled for a new size"
    graphs = backend.report.graphs
    if sized:
        assert graphs and all(gr.symbols for gr in graphs), [gr.notes for gr in graphs]  # really symbolic
        assert backend.report.kernels, [gr.notes for gr in graphs]  # and fused
