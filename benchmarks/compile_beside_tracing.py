"""How much of a Triton compile holds the GIL: dumped kernel files compiled on a thread beside a main
thread busy with a fixed amount of Python (as fxopt's compile of the next graph keeps it while the
compile pool works on the last one's kernels).

    FXOPT_DUMP=dump python ...                     # any compile: the kernels land in dump/kernels/
    PYTHONPATH=. python -m benchmarks.compile_beside_tracing dump/kernels/cast_inputs_1.py ... [--target cuda:90]

Each row is a fresh process with an empty Triton cache, compiling for --target without a GPU
(`python kernels/X.py --compile-for`), so it runs on the CPU machine too. "lost s" is how much later the
busy thread finished beside the compile than alone: the seconds the compile held the GIL it wanted.
Where "lost s" is close to "compile s alone", threads cannot compile kernels in parallel with each other
or with the main thread; only processes can.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

from benchmarks.key_beside_tracing import BUSY_MAIN

CHILD = textwrap.dedent('''\
    import runpy, sys, threading, time
    import fxopt.codegen.offline_compile  # noqa: F401 (the kernel files' --compile-for needs it)
    mode, path, target, work, interval = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    if interval:
        sys.setswitchinterval(interval)
    done = []
    def compile_it():
        sys.argv = [path, "--compile-for", target]
        start = time.perf_counter()
        runpy.run_path(path, run_name="__main__")
        done.append(time.perf_counter() - start)
    thread = threading.Thread(target=compile_it) if mode != "busy" else None
    t0 = time.perf_counter()
    if thread:
        thread.start()
    ''') + BUSY_MAIN + textwrap.dedent('''\
    if thread:
        thread.join()
    print(f"{done[0] if done else 0.0:.3f} {busy:.3f}")
    ''')


def _run(mode: str, path: str, target: str, work: int, interval: float) -> tuple[float, float]:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="fxopt-gil-"))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    argv = [sys.executable, "-c", CHILD, mode, path, target, str(work), str(interval)]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout.split()
    return float(out[-2]), float(out[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernels", nargs="+", help="kernel files from an FXOPT_DUMP folder's kernels/")
    ap.add_argument("--target", default="cuda:90")
    ap.add_argument("--work", type=int, default=60000, help="the busy thread's units of Python work")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="sys.setswitchinterval in the child (0: the interpreter's 5 ms)")
    args = ap.parse_args(argv)
    run = lambda mode, path: _run(mode, path, args.target, args.work, args.switch_interval)  # noqa: E731
    _, busy_alone = run("busy", args.kernels[0])
    print(f"busy thread alone: {busy_alone:.3f} s")
    print(f"{'kernel':36} {'compile s alone':>15} {'compile s beside':>16} {'lost s':>7}")
    for path in args.kernels:
        alone, _ = run("alone", path)
        beside, busy = run("beside", path)
        print(f"{os.path.basename(path):36} {alone:15.3f} {beside:16.3f} {busy - busy_alone:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
