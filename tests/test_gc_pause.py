"""fxopt/gc_pause.py: Python's cyclic garbage collector is paused while fxopt compiles, and put back as
it was after, whatever happens inside."""
import gc
import threading

import pytest
import torch

from fxopt.gc_pause import collector_paused


@pytest.fixture
def collector_states(monkeypatch):
    """gc.isenabled() as each ATen graph's compile saw it (forward, then backward), when its passes start."""
    from fxopt import pipeline
    seen, original = [], pipeline.post_grad_passes

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)
    monkeypatch.setattr(pipeline, "post_grad_passes", recording)
    return seen


def _train_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 3)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    ref_grads = torch.autograd.grad(m(x).square().sum(), list(m.parameters()))
    grads = torch.autograd.grad(torch.compile(m, backend="fxopt")(x).square().sum(), list(m.parameters()))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_the_collector_is_paused_during_both_graphs_compiles_and_back_on_after(collector_states):
    assert gc.isenabled()
    _train_step()
    assert collector_states == [False, False]  # forward and backward (the backward compiles at its first call)
    assert gc.isenabled()


def test_the_switch_leaves_the_collector_running(collector_states, monkeypatch):
    monkeypatch.setenv("FXOPT_COMPILE_GC_PAUSE", "0")
    _train_step()
    assert collector_states == [True, True]


def test_a_collector_the_user_disabled_stays_disabled(collector_states):
    gc.disable()
    try:
        _train_step()
        assert collector_states == [False, False] and not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_puts_the_collector_back():
    with pytest.raises(RuntimeError, match="inside"):
        with collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled()


def test_overlapping_pauses_on_two_threads_end_with_the_last():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    states = {}

    def first():
        with collector_paused():
            first_in.set()
            second_in.wait(5)
        states["after first"] = gc.isenabled()
        first_out.set()

    def second():
        first_in.wait(5)
        with collector_paused():
            second_in.set()
            first_out.wait(5)
            states["inside second, first done"] = gc.isenabled()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert states == {"after first": False, "inside second, first done": False}
    assert gc.isenabled()


@pytest.fixture
def tracing_states():
    """gc.isenabled() as each dynamo compile saw it when it started tracing: a start callback registered
    after fxopt's (dynamo runs them in order), removed after the test."""
    from torch._dynamo.callback import callback_handler
    seen = []

    def record(*_):
        seen.append(gc.isenabled())
    torch._dynamo.reset()  # drops every callback, fxopt's too: each test registers what it tests
    import fxopt
    fxopt.backend()  # torch.compile handed fxopt's backend: the pause over dynamo's compiles registered
    callback_handler.register_start_callback(record)
    yield seen
    if record in callback_handler.start_callbacks:
        callback_handler.remove_start_callback(record)


def _compiled_sum():
    x = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(torch.compile(lambda t: (t * 2).sum(), backend="fxopt")(x), (x * 2).sum())


def test_dynamos_tracing_runs_with_the_collector_paused_and_it_is_back_after(tracing_states):
    _compiled_sum()
    assert tracing_states == [False]
    assert gc.isenabled()


def test_the_switch_leaves_dynamos_tracing_alone(tracing_states, monkeypatch):
    monkeypatch.setenv("FXOPT_COMPILE_GC_PAUSE", "0")
    _compiled_sum()
    assert tracing_states == [True] and gc.isenabled()


def test_an_error_in_tracing_puts_the_collector_back(tracing_states):
    def broken(t):
        return t.no_such_method()
    with pytest.raises(Exception, match="no_such_method"):
        torch.compile(broken, backend="fxopt", fullgraph=True)(torch.randn(3))
    assert tracing_states == [False] and gc.isenabled()


def test_fxopts_next_compile_registers_the_pause_again_after_a_reset():
    from torch._dynamo.callback import callback_handler

    from fxopt.gc_pause import _dynamo_compile_started
    torch._dynamo.reset()
    assert _dynamo_compile_started not in callback_handler.start_callbacks
    _compiled_sum()  # traced without it (reset dropped it); fxopt's compile puts it back for the next
    assert callback_handler.start_callbacks.count(_dynamo_compile_started) == 1
    _compiled_sum()
    assert callback_handler.start_callbacks.count(_dynamo_compile_started) == 1
    assert gc.isenabled()
