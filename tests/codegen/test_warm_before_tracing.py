"""Triton's one-time set-up (driver, cache keys) starts when torch.compile is handed fxopt's backend,
before dynamo traces (codegen/precompile.warm_before_tracing), and a stand-in call waits for the
driver thread instead of building the driver a second time."""
import importlib
import sys
import threading

import pytest
import torch

from fxopt.codegen import precompile


@pytest.fixture
def fresh(monkeypatch):
    """Fresh events, and the threads' work replaced by a recorder (nothing real is built here)."""
    for name in ("_keys_warmed", "_keys_ready", "_driver_done"):
        monkeypatch.setattr(precompile, name, threading.Event())
    started = []
    monkeypatch.setattr(precompile, "_driver_ready", lambda: (started.append("driver"), precompile._driver_done.set()))
    monkeypatch.setattr(precompile, "_keys_thread", lambda: (started.append("keys"), precompile._keys_ready.set()))
    return started


def _joined(started):
    for t in threading.enumerate():
        if t.name in ("fxopt-compile-driver", "fxopt-compile-keys"):
            t.join(10)
    return sorted(started)


def test_starts_once_with_a_gpu_and_the_compiler(fresh, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert precompile.warm_before_tracing()
    precompile.warm_before_tracing()  # a second backend in the process: nothing more
    precompile.warm_compile_keys([])  # nor when its graph arrives
    assert _joined(fresh) == ["driver", "keys"]


@pytest.mark.parametrize("gpu,interpret", [(False, "0"), (True, "1")])
def test_nothing_starts_without_a_gpu_or_under_the_interpreter(fresh, monkeypatch, gpu, interpret):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert not precompile.warm_before_tracing()
    assert not precompile._keys_warmed.is_set() and _joined(fresh) == []


def test_backend_factory_and_entry_point_start_it(monkeypatch):
    """fxopt.backend(...) and the module the entry point names both call before_tracing, which starts
    warm_before_tracing and the collector's pause over dynamo's compiles."""
    import fxopt

    backend_module = importlib.import_module("fxopt.backend")  # (the attribute fxopt.backend is the factory)
    calls = []
    monkeypatch.setattr(backend_module, "before_tracing", lambda: calls.append("before tracing"))
    fxopt.backend(precision="fp32")
    monkeypatch.delitem(sys.modules, "fxopt.entry_point", raising=False)
    module = importlib.import_module("fxopt.entry_point")
    assert calls == ["before tracing", "before tracing"]
    assert module.fxopt_backend is backend_module.fxopt_backend
    monkeypatch.undo()
    monkeypatch.setattr(backend_module, "warm_before_tracing", lambda: calls.append("warm"))
    monkeypatch.setattr(backend_module, "pause_dynamo_compiles", lambda: calls.append("pause"))
    backend_module.before_tracing()
    assert calls[2:] == ["warm", "pause"]


def test_stand_in_calls_wait_for_the_driver_thread(fresh, monkeypatch):
    monkeypatch.setattr(precompile, "KEYS_WAIT_S", 60.0)
    precompile.wait_for_driver()  # nothing started: returns at once
    precompile._keys_warmed.set()  # started, not done: waits until it is
    waiter = threading.Thread(target=precompile.wait_for_driver)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    precompile._driver_done.set()
    waiter.join(10)
    assert not waiter.is_alive()


def test_the_driver_thread_releases_waiters_when_it_fails(monkeypatch):
    monkeypatch.setattr(precompile, "_driver_done", threading.Event())

    def no_driver():
        raise RuntimeError("no driver")

    monkeypatch.setattr(precompile.compile_pool, "current_target", no_driver)
    precompile._driver_ready()
    assert precompile._driver_done.is_set()
