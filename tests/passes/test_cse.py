"""passes/cse.py: fxopt's CSE on aot_autograd's joint graph.

The reference is torch's own CSE (`fx_graph_cse`, what the min-cut partitioner runs by default): on the
joint graphs of the HF-style GPT-2 (with dropout) and Llama it must leave the same ops. Then the cases
it must not merge, checked by running the graph, and the reason it exists: a training compile that
never imports Inductor."""
import collections
import copy
import os
import subprocess
import sys

import torch
from functorch.compile import default_partition, make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.proxy_tensor import make_fx

from fxopt.passes.cse import eliminate_common_subexpressions
from tests.models.hf_gpt2 import GPT2Config, GPT2LMHeadModel
from tests.models.hf_llama import LlamaConfig, LlamaForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ops(graph) -> collections.Counter:
    return collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")


def _joint_graphs(model, *inputs) -> list:
    joints = []

    def capture(joint, joint_inputs, **kwargs):
        joints.append(copy.deepcopy(joint))
        return default_partition(joint, joint_inputs, **kwargs)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g), partition_fn=capture)
    torch.compile(model, backend=backend)(*inputs).backward()
    torch._dynamo.reset()
    return joints


def test_same_ops_left_as_torchs_cse_on_gpt2_and_llama_joint_graphs():
    from torch._functorch.compile_utils import fx_graph_cse
    torch.manual_seed(0)
    ids = torch.randint(0, 80, (2, 16))
    cases = [(GPT2LMHeadModel(GPT2Config(embd_pdrop=0.1, attn_pdrop=0.1)), (ids, ids)),
             (LlamaForCausalLM(LlamaConfig()), (ids, torch.ones_like(ids), ids))]
    merged = 0
    for model, inputs in cases:
        for joint in _joint_graphs(model, *inputs):
            ours = copy.deepcopy(joint)
            merged += eliminate_common_subexpressions(ours.graph)
            ours.graph.lint()
            assert _ops(ours.graph) == _ops(fx_graph_cse(copy.deepcopy(joint).graph))
    assert merged > 0  # the graphs do hold equal calls (Llama's rotary cos/sin, GPT-2's views)


def test_merges_equal_calls_and_keeps_what_differs():
    def f(x, n):
        a, b = x * 2, x * 2  # equal: one is kept
        i, j = n + 1, n + 1.0  # int tensor: int64 and float results, not equal
        r1, r2 = torch.rand_like(x), torch.rand_like(x)  # two draws
        return a + b, i, j, r1 - r2
    x, n = torch.randn(8), torch.arange(8)
    gm = make_fx(f)(x, n)
    removed = eliminate_common_subexpressions(gm.graph)
    gm.recompile()
    assert removed == 1
    assert _ops(gm.graph)["aten.rand_like.default"] == 2
    s, i, j, r = gm(x, n)
    torch.testing.assert_close(s, x * 4)
    assert i.dtype == torch.int64 and j.dtype == torch.float32
    torch.testing.assert_close(j, n + 1.0)
    assert r.abs().max() > 0  # two different draws


def test_nothing_merges_across_a_mutation_and_equal_outputs_stay_two_tensors():
    def f(x):
        before = x * 3
        x.add_(1)
        after = x * 3  # the same call on a changed x
        return before, after, x.sin(), x.sin()
    x = torch.randn(6)
    gm = make_fx(f)(x.clone())
    assert eliminate_common_subexpressions(gm.graph) == 0
    gm.recompile()
    before, after, s1, s2 = gm(x.clone())
    torch.testing.assert_close(after - before, torch.full_like(x, 3.0))
    assert s1.data_ptr() != s2.data_ptr()


def test_a_training_compile_does_not_import_inductor():
    """torch's own CSE would import torch._inductor.pattern_matcher (Inductor's lowerings: seconds)."""
    code = ("import sys, torch, fxopt\n"
            "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))\n"
            "x = torch.randn(2, 8, requires_grad=True)\n"
            "torch.compile(m, backend='fxopt')(x).sum().backward()\n"
            "assert x.grad is not None\n"
            "print('imported' if 'torch._inductor.pattern_matcher' in sys.modules else 'not imported')\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "not imported"


def test_size_arithmetic_between_equal_calls_does_not_stop_the_merge():
    def f(x):
        a = x * 2
        n = torch.sym_max(x.shape[0], 3)  # a call_function that is not ATen, on sizes only
        b = x * 2
        return a + b, torch.full((n,), 1.0)
    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(5))
    assert any(n.target is torch.sym_max for n in gm.graph.nodes)
    assert eliminate_common_subexpressions(gm.graph) == 1
    gm.recompile()
    s, full = gm(torch.ones(6))
    assert torch.equal(s, torch.full((6,), 4.0)) and full.shape == (6,)


def test_signed_zeros_do_not_merge():
    """x * 0.0 and x * -0.0 differ in the sign of their zeros (1 / them: +inf against -inf)."""
    def f(x):
        return 1 / (x * 0.0), 1 / (x * -0.0)

    x = torch.tensor([1.0, -2.0])
    gm = make_fx(f)(x)
    assert eliminate_common_subexpressions(gm.graph) == 0
    gm.recompile()
    pos, neg = gm(x)
    assert pos.tolist() == [float("inf"), float("-inf")] and neg.tolist() == [float("-inf"), float("inf")]
