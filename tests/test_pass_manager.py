"""The pass manager's instruments: lint, timing, snapshots, and verify naming the pass that broke numerics."""
from dataclasses import dataclass

import pytest
import torch

import fxopt
from fxopt import pipeline
from fxopt.errors import VerifyError
from fxopt.pass_manager import PassResult


@dataclass(frozen=True)
class MulBecomesAdd:
    """A deliberately wrong pass: rewrites the first aten.mul into aten.add."""

    name: str = "mul_becomes_add"

    def __call__(self, gm, ctx):
        for n in gm.graph.nodes:
            if n.target is torch.ops.aten.mul.Tensor:
                n.target = torch.ops.aten.add.Tensor
                return PassResult(gm, True, {"broken": 1})
        return PassResult(gm, False, {})


@dataclass(frozen=True)
class Raises:
    name: str = "raises"

    def __call__(self, gm, ctx):
        raise ValueError("boom")


def f(x, y):
    return torch.sigmoid(x * y) + 1


def test_verify_names_the_broken_pass_and_node(monkeypatch):
    passes = pipeline.post_grad_passes(fxopt.Options())
    monkeypatch.setattr(pipeline, "post_grad_passes", lambda opts: [passes[0], MulBecomesAdd(), *passes[1:]])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with pytest.raises(Exception) as info:
        fxopt.explain(f, x, y, verify=True)
    msg = str(info.value)
    assert "pass 'mul_becomes_add'" in msg and "first differing node: 'mul" in msg
    assert isinstance(info.value, VerifyError) or "VerifyError" in msg


def test_verify_passes_on_the_real_pipeline_and_records_errors():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    rep = fxopt.explain(f, x, y, verify=True)
    errors = [p.max_rel_error for p in rep.passes]
    assert errors and all(e is not None and e < 1e-5 for e in errors)
    assert rep.passes[-1].name == "codegen"  # the generated kernels are checked too


def test_failing_pass_is_named_with_the_passes_before_it(monkeypatch):
    passes = pipeline.post_grad_passes(fxopt.Options())
    monkeypatch.setattr(pipeline, "post_grad_passes", lambda opts: [passes[0], Raises()])
    with pytest.raises(Exception, match=r"pass 'raises' failed on the inference graph; passes that ran before it: cleanup"):
        fxopt.explain(f, torch.randn(4), torch.randn(4))


def test_records_time_and_node_counts():
    rep = fxopt.explain(f, torch.randn(4), torch.randn(4))
    fuse = next(p for p in rep.passes if p.name == "fuse")
    assert fuse.nodes_before == 3 and fuse.nodes_after == 1 and fuse.stats["groups"] == 1
    assert fuse.seconds > 0 and fuse.changed
    assert "self.fused" in fuse.text and "# f32[4] cpu" in fuse.text


def test_snapshots_of_a_graph_with_a_constant_tensor_share_it():
    """explain keeps a copy of the graph after every pass; a tensor constant (torch.tensor(...) in the
    model) must not be cloned there: under aot_autograd's fake mode cloning its storage fails."""
    def fn(x):
        return x * torch.tensor([0.5, 0.25, 2.0]) + 1

    x = torch.randn(4, 3)
    rep = fxopt.explain(fn, x)
    graph = rep.graphs[0]
    constants = [getattr(gm, n.target) for gm in graph.snapshots.values() for n in gm.graph.nodes
                 if n.op == "get_attr" and isinstance(getattr(gm, n.target), torch.Tensor)]
    assert constants and len({c.data_ptr() for c in constants}) == 1
    assert torch.equal(constants[0], torch.tensor([0.5, 0.25, 2.0]))
