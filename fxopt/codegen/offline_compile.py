"""Compile kernels for a GPU on a machine without one: `python kernels/<name>.py --compile-for cuda:90`
(the files explain and FXOPT_DUMP write, codegen/harness.py) compiles each launch for that target with
Triton's own compiler (ptxas ships with Triton) and launches nothing; inside `compiling_launches(target)`
every launch of fxopt's own kernels (attention, cross-entropy: interpreter_guard.launcher) does the same.

Why: on a machine without a GPU the kernels run in Triton's interpreter, which accepts code the GPU
compiler refuses (types it would not unify, calls it cannot inline). This checks the compile without
the GPU; the numbers still come from the interpreter or the GPU.
"""
from __future__ import annotations

import contextlib
import functools

from . import interpreter_guard
from .compile_worker import use_offline_driver


def parse_target(text: str) -> tuple[str, int, int]:
    """'cuda:90' -> ("cuda", 90, 32): Triton's GPUTarget (backend, compute capability, warp size)."""
    backend, _, arch = text.partition(":")
    if backend != "cuda" or not arch.isdigit():
        raise ValueError(f"fxopt: --compile-for takes cuda:<compute capability>, e.g. cuda:90 (an H100/H200), "
                         f"not {text!r}")
    return backend, int(arch), 32


class CompileOnly:
    """Stands in for a kernel: `kernel[grid](*args)` compiles it for those arguments, without a launch."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return functools.partial(self.fn.warmup, grid=grid)


def compile_only(target: str, namespace: dict, names: list[str]) -> None:
    """Make Triton compile for `target` offline and every launch of `names` in `namespace` a compile."""
    use_offline_driver(*parse_target(target))
    for name in names:
        namespace[name] = CompileOnly(namespace[name])


@contextlib.contextmanager
def compiling_launches(target: str):
    """Inside, each fxopt kernel launch (CPU tensors are fine: only their dtypes and alignment count)
    compiles the kernel for `target` instead of running it. Triton must have been imported with
    TRITON_INTERPRET=0. The outputs are left unwritten."""
    from triton.runtime.driver import driver

    saved = driver._active
    use_offline_driver(*parse_target(target))
    interpreter_guard.compile_only = CompileOnly
    try:
        yield
    finally:
        interpreter_guard.compile_only = None
        driver._active = saved


def compile_files(paths: list[str], target: str = "cuda:90", timeout: float = 3600) -> dict[str, str]:
    """Compile kernel files (`kernels/<name>.py`) for `target`: {path: "" if it compiled, else the
    error}. One subprocess for all of them, with Triton's compiler (this process may be interpreting)."""
    import json
    import os
    import subprocess
    import sys

    parse_target(target)
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-m", "fxopt.codegen.offline_compile", "--in-process", "--target", target,
                           *paths], capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULTS)]
    if not lines:
        raise RuntimeError(f"fxopt: the offline compile process failed: {done.stderr[-3000:]}")
    return json.loads(lines[-1][len(_RESULTS):])


_RESULTS = "FXOPT_OFFLINE_COMPILE "


def _compile_here(paths: list[str], target: str) -> dict[str, str]:
    import runpy
    import sys
    import traceback

    results = {}
    for path in paths:
        sys.argv = [path, "--compile-for", target]
        try:
            runpy.run_path(path, run_name="__main__")
            results[path] = ""
        except Exception:
            results[path] = traceback.format_exc()[-3000:]
    return results


def main(argv: list[str] | None = None) -> int:
    """python -m fxopt.codegen.offline_compile DIR_OR_FILE... [--target cuda:90]: compile every kernel
    file (a dump's kernels/ folder) for a GPU without one; exit status 1 if any failed."""
    import argparse
    import glob
    import json
    import os

    parser = argparse.ArgumentParser(prog="python -m fxopt.codegen.offline_compile", description=main.__doc__)
    parser.add_argument("paths", nargs="+", help="kernel files, or folders of them")
    parser.add_argument("--target", default="cuda:90")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        parse_target(args.target)
    except ValueError as exc:
        parser.error(str(exc))
    paths = [p for a in args.paths for p in (sorted(glob.glob(os.path.join(a, "*.py"))) if os.path.isdir(a) else [a])]
    if args.in_process:
        print(_RESULTS + json.dumps(_compile_here(paths, args.target)), flush=True)
        return 0
    results = compile_files(paths, args.target)
    failed = {p: e for p, e in results.items() if e}
    for path, error in failed.items():
        print(f"FAILED {path}\n{error}")
    print(f"{len(results) - len(failed)} of {len(results)} kernel files compiled for {args.target}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
