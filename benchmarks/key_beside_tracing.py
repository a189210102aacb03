"""How long Triton's per-process key takes on a thread beside a main thread busy with Python (as
dynamo and aot_autograd keep it during a first call), with the interpreter's default GIL switch
interval and under fxopt's `quick_handoff` (fxopt/codegen/gil_handoff.py).

    PYTHONPATH=. python -m benchmarks.key_beside_tracing [--repeat 2] [--work 20000]

Each row is a fresh process (Triton caches the key per process). "busy s" is when the main thread's
fixed amount of Python work finished: the handoff must not slow it. Runs on the CPU machine too.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap

# The main thread's fixed Python work in a child (mode, work and t0 set before it): shared with
# compile_beside_tracing.py.
BUSY_MAIN = '''\
busy = 0.0
if mode != "alone":
    for _ in range(work):
        sum(i * i for i in range(1000))
    busy = time.perf_counter() - t0
'''
CHILD = textwrap.dedent('''\
    import contextlib, sys, threading, time
    from triton.runtime.cache import triton_key
    from fxopt.codegen.gil_handoff import quick_handoff
    mode, work = sys.argv[1], int(sys.argv[2])
    done = []
    def key():
        with (quick_handoff() if mode == "quick_handoff" else contextlib.nullcontext()):
            triton_key()
        done.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    thread = threading.Thread(target=key)
    thread.start()
    ''') + BUSY_MAIN + textwrap.dedent('''\
    thread.join()
    print(f"{done[0]:.3f} {busy:.3f}")
    ''')


def child(mode: str, work: int, env: dict) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(work)], env=env, capture_output=True, text=True,
                         check=True)
    key, busy = out.stdout.split()[-2:]
    return float(key), float(busy)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--work", type=int, default=20000, help="iterations of the main thread's Python work")
    args = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    print("mode | key s | busy s")
    for _ in range(args.repeat):
        for mode in ("alone", "default", "quick_handoff"):
            key, busy = child(mode, args.work, env)
            print(f"{mode:>13} | {key:5.3f} | {busy:6.3f}")


if __name__ == "__main__":
    main()
