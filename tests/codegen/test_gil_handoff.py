"""The short GIL switch interval of compile phases (codegen/gil_handoff.py) and the compiles' wait for
the thread computing Triton's per-process keys (codegen/precompile.py)."""
import sys
import threading

import pytest

from fxopt.codegen import gil_handoff, precompile
from fxopt.codegen.gil_handoff import quick_handoff

INTERVAL = 2e-4  # the default of FXOPT_COMPILE_SWITCH_INTERVAL


@pytest.fixture(autouse=True)
def default_interval():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(saved)


def test_interval_is_short_inside_and_restored_after():
    with quick_handoff():
        assert sys.getswitchinterval() == pytest.approx(INTERVAL, abs=2e-6)
    assert sys.getswitchinterval() == pytest.approx(0.005, abs=2e-6)


def test_overlapping_phases_on_two_threads_restore_after_the_last():
    """Phases are counted across threads: the interval stays short until the last one ends."""
    entered, release = threading.Event(), threading.Event()

    def other():
        with quick_handoff():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with quick_handoff():
        t.start()
        entered.wait(10)
    assert sys.getswitchinterval() == pytest.approx(INTERVAL, abs=2e-6)  # the other phase still runs
    release.set()
    t.join()
    assert sys.getswitchinterval() == pytest.approx(0.005, abs=2e-6)
    assert gil_handoff.quick_handoff.active == 0


def test_a_shorter_interval_is_left_alone():
    sys.setswitchinterval(1e-4)
    with quick_handoff():
        assert sys.getswitchinterval() == pytest.approx(1e-4, abs=2e-6)
    assert sys.getswitchinterval() == pytest.approx(1e-4, abs=2e-6)


def test_an_interval_set_by_someone_else_meanwhile_is_kept():
    with quick_handoff():
        sys.setswitchinterval(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002, abs=2e-6)


def test_restored_when_the_phase_raises():
    with pytest.raises(ValueError):
        with quick_handoff():
            raise ValueError("compile failed")
    assert sys.getswitchinterval() == pytest.approx(0.005, abs=2e-6)


def test_the_environment_sets_the_interval_or_turns_it_off(monkeypatch):
    monkeypatch.setenv("FXOPT_COMPILE_SWITCH_INTERVAL", "0.001")
    with quick_handoff():
        assert sys.getswitchinterval() == pytest.approx(0.001, abs=2e-6)
    monkeypatch.setenv("FXOPT_COMPILE_SWITCH_INTERVAL", "0")
    with quick_handoff():
        assert sys.getswitchinterval() == pytest.approx(0.005, abs=2e-6)
    monkeypatch.setenv("FXOPT_COMPILE_SWITCH_INTERVAL", "fast")
    with pytest.raises(ValueError, match="FXOPT_COMPILE_SWITCH_INTERVAL='fast' is not a number of seconds"):
        with quick_handoff():
            pass
    assert gil_handoff.quick_handoff.active == 0 and sys.getswitchinterval() == pytest.approx(0.005, abs=2e-6)


@pytest.fixture
def fresh_keys(monkeypatch):
    monkeypatch.setattr(precompile, "_keys_warmed", threading.Event())
    monkeypatch.setattr(precompile, "_keys_ready", threading.Event())


def test_compiles_do_not_wait_when_no_keys_thread_started(fresh_keys, monkeypatch):
    monkeypatch.setattr(precompile, "KEYS_WAIT_S", 60.0)
    precompile.wait_for_keys()  # returns at once: nothing computes the keys ahead
    assert not precompile._keys_ready.is_set()


def test_compiles_wait_for_the_keys_thread(fresh_keys, monkeypatch):
    """A compile started while the keys thread hashes waits for it instead of hashing too; the keys
    thread releases the waiters even when computing the keys fails."""
    started, release = threading.Event(), threading.Event()

    def slow_keys(target=None):
        started.set()
        release.wait(10)
        raise RuntimeError("no driver")

    monkeypatch.setattr(precompile, "_compute_keys", slow_keys)
    precompile._keys_warmed.set()
    keys = threading.Thread(target=precompile._keys_thread)
    keys.start()
    started.wait(10)
    waited = threading.Thread(target=precompile.wait_for_keys)
    waited.start()
    waited.join(0.2)
    assert waited.is_alive()  # still waiting for the keys
    release.set()
    waited.join(10)
    keys.join(10)
    assert not waited.is_alive() and precompile._keys_ready.is_set()
    assert sys.getswitchinterval() == pytest.approx(0.005, abs=2e-6)


def test_key_beside_tracing_script_reports_each_mode(capsys, monkeypatch):
    """benchmarks/key_beside_tracing.py (the measurement behind quick_handoff) runs on this machine; its
    times are for the results files, not asserted here."""
    pytest.importorskip("triton")
    from benchmarks import key_beside_tracing

    monkeypatch.setattr(sys, "argv", ["key_beside_tracing", "--repeat", "1", "--work", "200"])
    key_beside_tracing.main()
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if "|" in line][1:]
    assert [r[0].strip() for r in rows] == ["alone", "default", "quick_handoff"]
    assert all(float(r[1]) > 0 for r in rows)


def test_a_foreground_precompile_compiles_with_the_short_interval_a_background_one_without():
    """The main thread waits for a foreground precompile, so its compile threads get the GIL back sooner;
    in the background the main thread compiles the backward graph and keeps the default interval."""
    import types

    import torch
    import torch.fx as fx

    seen = []
    kernel = types.SimpleNamespace(name="k", source="", warmup_args=lambda: (), grid_tuple=lambda: (1,),
                                   options=lambda: {}, constexprs={})
    module = types.SimpleNamespace(k=types.SimpleNamespace(warmup=lambda *a, **kw: seen.append(sys.getswitchinterval())))
    graph = fx.Graph()
    graph.output(graph.placeholder("x"))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert precompile.precompile(gm, module, [kernel], "", None, 0) is None
    precompile.precompile(gm, module, [kernel], "", None, 0, background=True).result(timeout=10)
    assert seen == [pytest.approx(INTERVAL, abs=2e-6), pytest.approx(0.005, abs=2e-6)]
