"""The compile-time probes of benchmarks/ run on the CPU machine and measure what they say: the post-grad
passes on graphs with fake CUDA values (passes_on_fake_cuda.py), and a dumped kernel's compile beside a
busy main thread (compile_beside_tracing.py). Their times are for the results files, not asserted here."""
import gc
import importlib

import pytest
import torch

import fxopt
from benchmarks import passes_on_fake_cuda


def test_passes_on_fake_cuda_values_make_the_same_groups_on_cuda_values(capsys):
    graphs = passes_on_fake_cuda.captured_graphs(layers=1, d_model=32, tokens=8)
    assert [name for name, _ in graphs] == ["forward", "backward"]
    for name, gm in graphs:
        _, cpu, _, _ = passes_on_fake_cuda.run_passes(name, gm, "interpret", profile=False)
        _, cuda, records, _ = passes_on_fake_cuda.run_passes(name, gm, "cuda", profile=False)
        groups = [[n for n in g.graph.nodes if n.op == "call_module"] for g in (cpu, cuda)]
        assert len(groups[0]) == len(groups[1]) > 0
        vals = [n.meta["val"] for n in cuda.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        assert vals and all(v.device.type == "cuda" for v in vals)  # the passes saw CUDA values
        assert {"fuse", "fuse_reductions"} <= {r.name for r in records}
    passes_on_fake_cuda.main(["--layers", "1", "--d-model", "32", "--tokens", "8"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["forward"],
                                                                                                ["backward"])]
    assert [r[:2] for r in rows] == [["forward", "interpret"], ["forward", "cuda"], ["backward", "interpret"],
                                     ["backward", "cuda"]]


def test_compile_beside_tracing_compiles_a_dumped_kernel_alone_and_beside(tmp_path, monkeypatch, capsys):
    pytest.importorskip("triton")
    from benchmarks import compile_beside_tracing
    monkeypatch.setenv("FXOPT_DUMP", str(tmp_path))
    fxopt.explain(lambda t: torch.sigmoid(t * 2) + 1, torch.randn(64))
    kernel = next((tmp_path / "kernels").glob("*.py"))
    compile_beside_tracing.main([str(kernel), "--work", "200"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("busy thread alone:")
    name, alone, beside, lost = out[-1].split()
    assert name == kernel.name and float(alone) > 0 and float(beside) > 0 and float(lost) > -1


def test_gc_first_call_puts_each_full_collection_in_a_phase(capsys, monkeypatch):
    """benchmarks/gc_first_call.py: the phases it names follow the compile window it records, and with
    the collector forced to run a full pass inside fxopt's compile (the pause switched off) one is seen."""
    from benchmarks import gc_first_call
    windows = [(1.0, 2.0)]
    assert [gc_first_call.phase_of(t, windows) for t in (0.5, 1.5, 2.5)] == [
        "before it (dynamo)", "inside fxopt's compile", "after it (first run)"]
    assert gc_first_call.phase_of(0.5, []) == "the whole call"
    monkeypatch.setenv("FXOPT_COMPILE_GC_PAUSE", "0")
    pipeline = importlib.import_module("fxopt.pipeline")
    monkeypatch.setattr(pipeline, "post_grad_passes", _collecting(pipeline.post_grad_passes))
    torch._dynamo.reset()
    gc_first_call.main(["gpt_block", "--quick", "--dtype", "fp32"])
    out = capsys.readouterr().out
    assert "first call of gpt_block on fxopt" in out
    assert "inside fxopt's compile" in out and "fxopt's compile:" in out


def _collecting(original):
    """post_grad_passes with a full collection first: one the probe must place inside the compile."""
    def passes(*args, **kwargs):
        gc.collect()
        return original(*args, **kwargs)
    return passes
