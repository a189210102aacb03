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
