"""Whose time is a dynamic-shape call's extra time: torch.compile's layers, or fxopt's compiled code?

    PYTHONPATH=. python -m benchmarks.dynamic_overhead --workloads gpt_block_b1,gpt_block_b1_cg [--rounds 7]

Each workload is compiled twice in one process, with dynamic=False and dynamic=True, through the fxopt
backend with a recorder around two layers: the callable the backend hands dynamo (aot_autograd's
runtime wrapper around fxopt's code) and the callable fxopt compiled for aot_autograd (the generated
wrapper, or its CUDA-graph replayer). Each layer is then called directly with the arguments it last
received, so three times are measured per mode, the GPU synchronised once around a loop of calls:

  torch.compile   the call as a user makes it (dynamo's guards and argument handling included)
  aot + fxopt     without dynamo's frame
  fxopt           fxopt's own code alone

A host-bound workload whose dynamic/static ratio is near 1 in the last column and not in the first
loses its time above fxopt. Host speed varies between processes, so the modes alternate in rounds
and the medians are reported.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from . import measure, workloads

fxopt_backend = importlib.import_module("fxopt.backend")  # the module (fxopt.backend is also a function)

LAYERS = ("torch.compile", "aot + fxopt", "fxopt")


class Recorder:
    """A compiled callable that keeps the arguments of its last call (boxed: a list the callee may clear)."""

    def __init__(self, fn, boxed: bool):
        self.fn, self.boxed, self.args = fn, boxed, None
        if boxed:
            self._boxed_call = True

    def __call__(self, *args):
        if self.boxed:
            self.args = list(args[0])
            return self.fn(args[0])
        self.args = args
        return self.fn(*args)

    def replay(self):
        return self.fn(list(self.args)) if self.boxed else self.fn(*self.args)


def compile_recorded(w, fn, dynamic: bool) -> tuple:
    """(the torch.compile'd function, recorders of the backend's callables, of fxopt's callables)."""
    outer, inner = [], []
    original = fxopt_backend._aot

    def aot(gm, example_inputs, compiler):
        def recorded(gm, example_inputs, **kw):
            r = Recorder(compiler(gm, example_inputs, **kw), boxed=True)
            inner.append(r)
            return r
        return original(gm, example_inputs, recorded)

    def backend(gm, example_inputs):
        fxopt_backend._aot = aot
        try:
            r = Recorder(_fxopt(w)(gm, example_inputs), boxed=False)
        finally:
            fxopt_backend._aot = original
        outer.append(r)
        return r

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, dynamic=dynamic), outer, inner


def _fxopt(w):
    """The runner's fxopt backend for this workload (its precision and CUDA-graph options)."""
    return measure._recording_fxopt(precision=w.precision, cudagraphs=bool(w.cudagraphs))


def per_call_ms(call, calls: int, device: str) -> float:
    measure.sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    measure.sync(device)
    return (time.perf_counter() - t0) / calls * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dynamic_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="gpt_block_b1,gpt_block_b1_cg")
    p.add_argument("--dtype", default="bf16", choices=sorted(measure.DTYPES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke test of the plumbing only
    print(f"{'workload':18s} {'layer':14s} {'static ms':>10s} {'dynamic ms':>11s} {'dynamic/static':>15s}")
    for w in workloads.get(args.workloads):
        fn, inputs = w.make(device, measure.DTYPES[args.dtype] if device == "cuda" else torch.float32,
                            device == "cpu")
        modes = {}
        with measure.grad_mode(w):
            for dynamic in (False, True):
                compiled, outer, inner = compile_recorded(w, fn, dynamic)
                for _ in range(3):  # warm-up (and, with CUDA graphs, capture)
                    compiled(*inputs)
                if len(outer) != 1 or len(inner) != 1:
                    raise SystemExit(f"{w.name}: {len(outer)} dynamo graphs, {len(inner)} aot graphs; "
                                     "this probe times single-graph inference workloads")
                modes[dynamic] = (lambda c=compiled: c(*inputs), outer[0].replay, inner[0].replay)
            times = {(d, k): [] for d in modes for k in range(3)}
            for _ in range(args.rounds):
                for d, calls in modes.items():
                    for k, call in enumerate(calls):
                        times[(d, k)].append(per_call_ms(call, args.calls, device))
        for k, layer in enumerate(LAYERS):
            s, d = statistics.median(times[(False, k)]), statistics.median(times[(True, k)])
            print(f"{w.name:18s} {layer:14s} {s:10.4f} {d:11.4f} {d / s:15.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
