"""fxopt/aot.py: aot_autograd with dynamo's bookkeeping and without importing Inductor."""
import subprocess
import sys
import textwrap

import torch
from torch._dynamo.utils import counters


def test_a_training_step_keeps_dynamos_counters_and_gradients():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 8, dtype=torch.float64)
    m = m.double()
    ref = m(x).square().sum()
    ref_grads = torch.autograd.grad(ref, list(m.parameters()))
    out = torch.compile(m, backend="fxopt")(x).square().sum()
    grads = torch.autograd.grad(out, list(m.parameters()))
    assert counters["aot_autograd"]["total"] == counters["aot_autograd"]["ok"] == 1  # DDP's splitter reads these
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_a_first_compile_imports_none_of_inductors_compiler():
    # a fresh process: what a user's first call imports (Inductor's scheduler and IR are seconds, cold)
    code = textwrap.dedent("""
        import sys, warnings, torch, fxopt
        warnings.simplefilter("ignore")
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        x = torch.randn(4, 8, requires_grad=True)
        torch.compile(m, backend="fxopt")(x).sum().backward()
        print(sorted(k for k in ("torch._inductor.debug", "torch._inductor.scheduler", "torch._inductor.ir",
                                 "torch._inductor.compile_fx") if k in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _training_step_printing_graphs(monkeypatch):
    """How many graphs aot_autograd printed as text (print_readable) while fxopt compiled a training step."""
    printed = []
    original = torch.fx.GraphModule.print_readable

    def counting(self, *args, **kwargs):
        printed.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.GraphModule, "print_readable", counting)
    _no_trace_readers(monkeypatch)
    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 3)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.compile(m, backend="fxopt")(x).square().sum().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    for p in m.parameters():
        p.grad = None
    m(x).square().sum().backward()
    for p, r in zip(m.parameters(), ref):
        torch.testing.assert_close(p.grad, r)  # the compiled gradients were right
    return len(printed)


def _no_trace_readers(monkeypatch):
    """The structured trace as a plain run has it: torch's lazy handler only (pytest adds its own readers)."""
    from torch._logging._internal import trace_log
    lazy = [h for h in trace_log.handlers if type(h).__name__ == "LazyTraceHandler" and h.root_dir is None]
    monkeypatch.setattr(trace_log, "handlers", lazy)


def test_aot_autograd_prints_no_graph_text_that_no_log_reads(monkeypatch):
    # the joint, forward and backward graphs' texts feed the structured trace and the AOT cache only
    assert _training_step_printing_graphs(monkeypatch) == 0


def test_other_threads_print_the_texts_as_torch_does(monkeypatch):
    import threading

    from fxopt import aot_graph_texts
    from torch._functorch._aot_autograd import graph_compile

    class Config:  # the fields of aot_autograd's AOTConfig the logging step reads
        cache_info = None
        enable_log = True
        aot_id = 0

    _no_trace_readers(monkeypatch)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with aot_graph_texts.skipping_graph_texts():
        assert graph_compile._log_joint_graph(gm, Config()) is None  # this thread: skipped
        seen = []
        worker = threading.Thread(target=lambda: seen.append(graph_compile._log_joint_graph(gm, Config())))
        worker.start()
        worker.join()
    assert isinstance(seen[0], str) and "linear" in seen[0].lower()  # another thread: torch's own step
    torch._logging.set_logs(aot_joint_graph=True)
    try:
        with aot_graph_texts.skipping_graph_texts():
            assert "linear" in graph_compile._log_joint_graph(gm, Config()).lower()  # its log is on: printed
    finally:
        torch._logging.set_logs()
