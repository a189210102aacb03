"""fxopt's post-grad passes on a stack's ATen graphs as a GPU host would run them, without a GPU.

    PYTHONPATH=. python -m benchmarks.passes_on_fake_cuda [--layers 24] [--d-model 1024] [--tokens 16]

The forward and backward graphs of `compile_seconds`' GPT-2 stack are taken from a CPU compile. Each is
then passed through `pipeline.post_grad_passes` twice: as captured (target "interpret"), and with every
node's `meta["val"]` made a fake CUDA tensor of the same size, stride and dtype (target "cuda"). If the
two times differ, a CUDA-only branch of some pass costs the difference. Under cProfile with `--profile`.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxopt import pipeline
from fxopt.aot import donated_backward_inputs
from fxopt.options import Environment, Options
from fxopt.pass_manager import PassContext, PassManager

from . import compile_seconds


def captured_graphs(layers: int, d_model: int, tokens: int) -> list[tuple[str, torch.fx.GraphModule]]:
    """(graph name, a copy of the ATen graph aot_autograd handed fxopt) for one CPU training step."""
    backend = sys.modules["fxopt.backend"]  # (the package's `fxopt.backend` is the options function)
    graphs, compile_aten_graph = [], backend.compile_aten_graph

    def keep(gm, example_inputs, **kw):
        graphs.append((kw["graph_name"], copy.deepcopy(gm)))
        return compile_aten_graph(gm, example_inputs, **kw)
    backend.compile_aten_graph = keep
    try:
        compile_seconds.measure(layers, d_model, tokens, "cpu")
    finally:
        backend.compile_aten_graph = compile_aten_graph
    return graphs


def as_fake_cuda(value, mode: FakeTensorMode):
    if isinstance(value, torch.Tensor):
        with mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cuda")
    if isinstance(value, (tuple, list)):
        return type(value)(as_fake_cuda(v, mode) for v in value)
    return value


def run_passes(name: str, gm: torch.fx.GraphModule, target: str, profile: bool):
    """(seconds, the graph after, the pass records, the profile or None) of the post-grad passes on a
    copy of gm."""
    gm = copy.deepcopy(gm)
    if target == "cuda":
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        for node in gm.graph.nodes:
            if "val" in node.meta:
                node.meta["val"] = as_fake_cuda(node.meta["val"], mode)
    options = Options(precision="bf16")
    ctx = PassContext(options=options, env=Environment.read(), graph_name=name, target=target,
                      donated=donated_backward_inputs(gm) if name == "backward" else frozenset())
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    out, records, _ = PassManager(pipeline.post_grad_passes(options), None).run(gm, ctx)
    if prof:
        prof.disable()
    return time.perf_counter() - start, out, records, prof


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--profile", action="store_true", help="cProfile each run; print the top 20")
    args = ap.parse_args(argv)
    for name, gm in captured_graphs(args.layers, args.d_model, args.tokens):
        for target in ("interpret", "cuda"):
            seconds, out, records, prof = run_passes(name, gm, target, args.profile)
            slowest = sorted(records, key=lambda r: -r.seconds)[:6]
            groups = sum(n.op == "call_module" for n in out.graph.nodes)
            print(f"{name:8} {target:9} {seconds:5.2f} s  {groups:3d} groups  "
                  + ", ".join(f"{r.name} {r.seconds:.2f}" for r in slowest))
            if prof:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
