"""Options(memory_plan="apply"): the wrapper allocates fused kernels' intermediates from one arena per
call. Numerics equal the default path exactly, plans pass the independent validator, nothing returned
(outputs, tensors saved for backward) aliases the arena, and FXOPT_POISON_FREED=1 (dead regions filled
with NaN) changes nothing: no buffer is read after its last use."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxopt
from fxopt.memory.validate import validate_plan

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from tiny_gpt import GPTConfig, lm_loss, make  # noqa: E402


def _common_cases():
    spec = importlib.util.spec_from_file_location("fxopt_common_modules", ROOT / "tests" / "models" /
                                                  "test_common_modules.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CASES


def _mlp(x, w1, w2):
    h = torch.tanh(x @ w1) * torch.sigmoid(x @ w1 + 1)
    return (torch.relu(h @ w2) * 2 - 1).sum(-1)


def _mlp_inputs():
    torch.manual_seed(0)
    return [torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True),
            torch.randn(16, 16, requires_grad=True)]


def _step(fn, args):
    """Outputs and gradients of every float input that requires grad (fresh leaves per call)."""
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out = fn(*leaves)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    diff = [a for a in leaves if a.requires_grad]
    grads = torch.autograd.grad([o.float().sum() for o in outs if o.requires_grad], diff,
                                allow_unused=True) if diff else ()
    return [o.detach() for o in outs], [g for g in grads if g is not None]


def _assert_equal(a, b):
    """Bit-identical, NaN where the reference is NaN (random chains can overflow: exp, x * 2 + 1, ...)."""
    (oa, ga), (ob, gb) = a, b
    for x, y in zip(oa + ga, ob + gb, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_options_accept_apply_and_refuse_other_values():
    assert fxopt.Options(memory_plan="apply").memory_plan == "apply"
    assert fxopt.Options(memory_plan=False).memory_plan is False
    with pytest.raises(ValueError, match="memory_plan"):
        fxopt.Options(memory_plan="yes")


def test_default_wrapper_has_no_arena_and_apply_places_kernel_outputs():
    args = _mlp_inputs()
    on, off = fxopt.explain(_mlp, *args), fxopt.explain(_mlp, *args, memory_plan=False)
    assert not any("arena" in g.wrapper_source for g in on.graphs + off.graphs)
    assert not any("in place" in g.wrapper_source for g in off.graphs)  # False: no reuse either
    applied = fxopt.explain(_mlp, *args, memory_plan="apply")
    placed = 0
    for g in applied.graphs:
        assert validate_plan(g.memory_plan) == [], g.name
        for b in g.memory_plan.buffers:
            assert f"{b.name} = arena[{b.offset}:{b.offset + b.nbytes}].view(" in g.wrapper_source
            placed += 1
        assert "fill_(0xFF)" not in g.wrapper_source
    assert placed >= 2


def test_apply_and_poison_equal_the_default_exactly_on_the_tiny_gpt(monkeypatch):
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32)
    model, (idx,) = make(config, batch=2, seq=8)

    def run(**options):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=fxopt.backend(**options))
        model.zero_grad(set_to_none=True)
        logits = compiled(idx)
        loss = lm_loss(logits, idx)
        loss.backward()
        return [logits.detach(), loss.detach()], [p.grad.clone() for p in model.parameters()]

    ref = run(memory_plan=True)
    _assert_equal(run(memory_plan="apply"), ref)
    monkeypatch.setenv("FXOPT_POISON_FREED", "1")
    _assert_equal(run(memory_plan="apply"), ref)
    rep = fxopt.explain(model, idx, memory_plan="apply")
    assert {g.name for g in rep.graphs} == {"forward", "backward"}
    for g in rep.graphs:
        assert validate_plan(g.memory_plan) == [] and g.memory_plan.buffers, g.name
        assert g.memory_plan.buffers[0].name in g.wrapper_source
        assert "fill_(0xFF)" in g.wrapper_source  # the environment variable reached the wrapper


@pytest.mark.parametrize("case", ["convbn_train", "embedding_inplace", "cat_stack", "group_norm", "slices"])
def test_poisoned_arena_changes_nothing_on_common_modules(case, monkeypatch):
    monkeypatch.setenv("FXOPT_POISON_FREED", "1")
    cases = _common_cases()
    torch.manual_seed(0)
    fn, args = cases[case]()
    ref = _step(fxopt.optimize(fn, *args, memory_plan=True), args)
    torch._dynamo.reset()
    _assert_equal(_step(fxopt.optimize(fn, *args, memory_plan="apply"), args), ref)


def test_outputs_and_saved_tensors_never_alias_the_arena(monkeypatch):
    arenas, real_empty = [], torch.empty

    def recording_empty(*size, **kw):
        t = real_empty(*size, **kw)
        if kw.get("dtype") is torch.uint8:
            arenas.append(t)  # kept alive, so no later allocation can reuse its address
        return t

    def in_arena(t):
        p = t.untyped_storage().data_ptr()
        return any(a.data_ptr() <= p < a.data_ptr() + a.numel() for a in arenas)

    args = _mlp_inputs()
    compiled = fxopt.optimize(_mlp, *args, memory_plan="apply")
    saved = []
    monkeypatch.setattr(torch, "empty", recording_empty)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outs, grads = _step(compiled, args)
    assert arenas, "the applied wrappers allocated no arena"
    assert saved and not any(in_arena(t) for t in saved)
    assert not any(in_arena(t) for t in outs + grads)


def test_applied_wrapper_with_poison_runs_standalone(tmp_path, monkeypatch):
    monkeypatch.setenv("FXOPT_POISON_FREED", "1")
    rep = fxopt.explain(_mlp, *_mlp_inputs(), memory_plan="apply")
    src = rep.graphs[-1].wrapper_source
    assert "arena = torch.empty(" in src and "fill_(0xFF)" in src
    path = tmp_path / "wrapper.py"
    path.write_text(src)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("0 ")


UNARY = [torch.sin, torch.tanh, torch.sigmoid, torch.relu, lambda t: t * 2 + 1, torch.exp]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(range(len(UNARY))), st.booleans(), st.booleans()), min_size=1,
                max_size=5), st.booleans())
def test_random_pointwise_chains_with_matmuls_are_unchanged_under_poison(monkeypatch, program, grad):
    """Each step applies a pointwise op, optionally followed by a matmul (which breaks fusion, so the
    kernel's output is an intermediate the arena holds), optionally reading the previous value again
    (so a kernel's input dies at the next kernel: in-place candidates); residual adds keep x alive."""
    def f(x, w):
        vals = [x]
        for op, mm, again in program:
            y = UNARY[op](vals[-1]) + vals[0] * 0.5
            y = y @ w if mm else y
            vals.append(torch.tanh(y) + vals[-1] if again and y.shape == vals[-1].shape else y)
            if mm and again:
                vals.append(vals[-1] * 2 + y)
        return vals[-1].sum(-1)

    monkeypatch.setenv("FXOPT_POISON_FREED", "1")
    torch.manual_seed(0)
    args = [torch.randn(8, 8, requires_grad=grad), (torch.randn(8, 8) * 0.3).requires_grad_(grad)]
    torch._dynamo.reset()
    ref = _step(fxopt.optimize(f, *args, memory_plan=True), args)
    torch._dynamo.reset()
    compiled = fxopt.optimize(f, *args, memory_plan="apply")
    _assert_equal(_step(compiled, args), ref)
    for g in compiled.report.graphs:
        assert validate_plan(g.memory_plan) == []


def _reuse(x, w):
    a = torch.relu(x) * 2
    c = torch.tanh(a) + a @ w  # a's last use is this kernel: its output may take a's bytes
    return (c @ w).sum()


def _transposed(x, w):
    a = torch.relu(x) * 2
    c = torch.tanh(a) + (a @ w) + a.t()  # a is read re-indexed: never in place (a @ w may be)
    return (c @ w).sum()


@pytest.mark.parametrize("fn, expect_inplace", [(_reuse, True), (_transposed, False)])
def test_in_place_reuse_only_where_elementwise_and_numerics_unchanged(fn, expect_inplace, monkeypatch):
    monkeypatch.setenv("FXOPT_POISON_FREED", "1")
    torch.manual_seed(0)
    args = [torch.randn(16, 16), torch.randn(16, 16)]
    (g,) = fxopt.explain(fn, *args, memory_plan="apply").graphs
    mp = g.memory_plan
    assert validate_plan(mp) == []
    if expect_inplace:
        assert mp.inplace, mp
    else:  # `a`, read through its transpose too, is never written in place; the matmul result may be
        assert all(dying.startswith("mm") for dying, _ in mp.inplace), mp
    for dying, born in mp.inplace:
        assert f"in place of {dying}" in g.wrapper_source
        d, b = (next(x for x in mp.buffers if x.name == n) for n in (dying, born))
        assert d.offset == b.offset and d.last_use == b.first_use
    if expect_inplace:
        assert mp.planned_bytes < mp.naive_bytes
    ref = _step(fxopt.optimize(fn, *args, memory_plan=True), args)
    torch._dynamo.reset()
    _assert_equal(_step(fxopt.optimize(fn, *args, memory_plan="apply"), args), ref)


def test_poison_catches_a_plan_that_frees_too_early(monkeypatch):
    """The debug mode's point: if liveness ended a buffer before its last read, the read sees NaN."""
    import fxopt.memory.plan_report as plan_report

    real = plan_report.buffer_intervals

    def too_short(gm):
        ivs = real(gm)
        for iv in ivs:
            iv.last_use = iv.first_use  # every buffer "dies" where it is born
        return ivs

    monkeypatch.setattr(plan_report, "buffer_intervals", too_short)
    monkeypatch.setenv("FXOPT_POISON_FREED", "1")
    args = [torch.randn(16, 16), torch.randn(16, 16)]
    out = fxopt.optimize(_reuse, *args, memory_plan="apply")(*args)
    assert torch.isnan(out).all()


def test_profiling_wrappers_apply_the_plan_too():
    args = [torch.randn(16, 16), torch.randn(16, 16)]
    (g,) = fxopt.explain(_reuse, *args, memory_plan="apply", profile=True).graphs
    assert "with region(" in g.wrapper_source and "= arena[" in g.wrapper_source
    prof = fxopt.profile(_reuse, *args, warmup=1, repeat=1, memory_plan="apply")
    assert {r.kind for r in prof.rows} >= {"pointwise", "matmul"}


def test_matmul_results_are_written_into_the_arena_through_out(monkeypatch):
    """ATen matmuls the plan places are called through their out= overload on an arena view; the
    results (and, with poison, every read after a region dies) are those of the default path."""
    args = _mlp_inputs()
    applied = fxopt.explain(_mlp, *args, memory_plan="apply")
    wrappers = "".join(g.wrapper_source for g in applied.graphs)
    assert "aten.mm.out(" in wrappers
    for g in applied.graphs:
        assert validate_plan(g.memory_plan) == [], g.name
        for line in g.wrapper_source.splitlines():
            if "aten.mm.out(" in line:
                name = line.split("out=")[1].rstrip(")")
                assert f"{name} = arena[" in g.wrapper_source  # the out= target is an arena view
    monkeypatch.setenv("FXOPT_POISON_FREED", "1")
    torch._dynamo.reset()
    got = _step(torch.compile(_mlp, backend=fxopt.backend(memory_plan="apply"), dynamic=False), args)
    torch._dynamo.reset()
    want = _step(torch.compile(_mlp, backend="fxopt", dynamic=False), args)
    _assert_equal(got, want)


def _scan_gather(x, idx, w):
    """A scan and a gather fxopt leaves to ATen (cumsum, embedding), each feeding a pointwise kernel."""
    c = torch.cumsum(x, 1)
    e = torch.nn.functional.embedding(idx, w)
    return torch.tanh(c) * 2 + torch.sigmoid(e)


def test_any_aten_result_with_an_out_overload_is_written_into_the_arena(monkeypatch):
    """Not only matmuls: an ATen op with an out= overload of the same arguments (found from its schema)
    writes its result into an arena view; the results equal the default path's bit for bit, with
    freed regions poisoned."""
    torch.manual_seed(0)
    args = [torch.randn(6, 10), torch.randint(0, 12, (6,)), torch.randn(12, 10)]
    applied = fxopt.explain(_scan_gather, *args, memory_plan="apply")
    source = applied.graphs[0].wrapper_source
    for op in ("aten.cumsum.out(", "aten.embedding.out("):
        line = next(ln for ln in source.splitlines() if op in ln)
        assert f"{line.split('out=')[1].rstrip(')')} = arena[" in source, line
    assert validate_plan(applied.graphs[0].memory_plan) == []
    monkeypatch.setenv("FXOPT_POISON_FREED", "1")
    torch._dynamo.reset()
    got = torch.compile(_scan_gather, backend=fxopt.backend(memory_plan="apply"), dynamic=False)(*args)
    monkeypatch.delenv("FXOPT_POISON_FREED")
    torch._dynamo.reset()
    want = torch.compile(_scan_gather, backend="fxopt", dynamic=False)(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = _scan_gather(args[0].double(), args[1], args[2].double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def _as_strided_of_an_intermediate(x):
    a = x.cumsum(0)  # ATen results the plan may place in the arena (out= overloads)
    b = (a * 2).cumsum(0)
    return b.as_strided((x.shape[0],), (1,), 0) * 1, a.sum()


def _two_views_mutated(x, a, b):
    a.mul_(2)  # functionalization writes these back through as_strided with symbolic sizes
    b.add_(1)
    return x * 1


@pytest.mark.parametrize("dynamic", [False, True])
def test_as_strided_reads_its_own_storage_not_the_arena(dynamic, monkeypatch):
    """as_strided's storage_offset counts from the storage's start: for a value placed in the arena that
    was another intermediate's memory (a sweep found it under symbolic sizes, with memory_plan="apply");
    such a value keeps its own allocation."""
    monkeypatch.setenv("FXOPT_POISON_FREED", "1")
    torch._dynamo.reset()
    f = torch.compile(_as_strided_of_an_intermediate, backend=fxopt.backend(memory_plan="apply"), dynamic=dynamic)
    g = torch.compile(_two_views_mutated, backend=fxopt.backend(memory_plan="apply"), dynamic=dynamic)
    for n in (6, 7, 10):
        x = torch.arange(n, dtype=torch.float32)
        for got, want in zip(f(x), _as_strided_of_an_intermediate(x)):
            torch.testing.assert_close(got, want)
        x, xe = torch.arange(n, dtype=torch.float32), torch.arange(n, dtype=torch.float32)
        torch.testing.assert_close(g(x, x[0:3], x[5:8]), _two_views_mutated(xe, xe[0:3], xe[5:8]))
        torch.testing.assert_close(x, xe)


def _clamp_a_window(a, b):
    a.add_(1)
    a.as_strided((2, 2), (4, 1), 1).clamp_(-0.5, 0.5)
    b.mul_(b.sum())
    return b + 0


def test_as_strided_scatter_keeps_its_own_allocation():
    """as_strided_scatter (a write through as_strided, functionalised) indexes from the start of its
    storage; placed in the arena at an offset, its window landed 64 floats early and the caller's `a` was
    wrong (the second mutation sweep of 2026-12-06)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    want_a, want_b = a.clone(), b.clone()
    want = _clamp_a_window(want_a, want_b)
    torch._dynamo.reset()
    got = torch.compile(_clamp_a_window, backend=fxopt.backend(memory_plan="apply"))(a, b)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(a, want_a)
    torch.testing.assert_close(b, want_b)


def test_explain_says_whether_the_wrapper_follows_the_plan():
    """The report's memory-plan line said "the wrapper does not use the arena" under memory_plan="apply",
    whose wrapper allocates from it."""
    def f(x):
        a = torch.softmax(x * 2, -1)
        return (a - (a + 1).sum(0, keepdim=True)).relu() * x

    x = torch.randn(8, 40)
    lines = {mode: [ln for ln in str(fxopt.explain(f, x, memory_plan=mode)).splitlines()
                    if ln.startswith("memory plan")] for mode in (True, "apply")}
    assert "does not use the arena" in lines[True][0]
    assert "allocates these buffers from the arena" in lines["apply"][0]
    assert "arena = " in fxopt.explain(f, x, memory_plan="apply").wrapper_source
