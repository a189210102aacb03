"""A training step's kernels compile in the background (codegen/precompile.py): the forward's while the
backward graph is made, the attention backward's predicted from the forward graph
(codegen/own_op_compiles.backward_compiles); each graph's first call waits for its own (compile.py).
CPU tests of the bookkeeping; the GPU test that the kernels really compile there is in
test_compile_workers.py (test_cuda_first_call_compiles_nothing_on_its_own_thread)."""
import operator
import threading
import types

import pytest
import torch
import torch.fx as fx

from fxopt.codegen import precompile as precompile_module
from fxopt.compile import _after
from fxopt.errors import FxoptError


def _attention_graph(save_lse: bool):
    """A forward graph with one flash_attention node on CUDA fake values, as aot_autograd hands one over:
    a training step's forward returns the log-sum-exp (saved for the backward); inference does not."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fxopt.attention.op  # noqa: F401  (registers torch.ops.fxopt)

    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 64, 32, device="cuda", dtype=torch.float16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(2, 4, 64, device="cuda")
    graph = fx.Graph()
    inputs = []
    for name, val in zip("qkv", (q, k, v)):
        inputs.append(graph.placeholder(name))
        inputs[-1].meta["val"] = val
    att = graph.call_function(torch.ops.fxopt.flash_attention.default, (*inputs, None, 0.125, True))
    att.meta["val"] = (out, lse)
    got = [graph.call_function(operator.getitem, (att, i)) for i in (0, 1)]
    graph.output((got[0], got[1]) if save_lse else (got[0],))
    return fx.GraphModule(torch.nn.Module(), graph), (q, k, v, out, lse)


def test_backward_compiles_are_predicted_from_a_training_forward(monkeypatch):
    """own_op_compiles.backward_compiles calls the backward op a training forward's flash_attention is
    followed by, on its inputs and outputs, the gradient laid out like the output; none for inference."""
    from fxopt.codegen import own_op_compiles

    calls = []
    monkeypatch.setattr(own_op_compiles, "_stand_in_call",
                        lambda name, callee, args, kwargs, out_val: calls.append((callee, kwargs, out_val)) or [])
    gm, (q, k, v, out, lse) = _attention_graph(save_lse=True)
    own_op_compiles.backward_compiles(gm)
    assert len(calls) == 1
    callee, kwargs, grads = calls[0]
    assert callee == "flash_attention_backward"
    assert kwargs["dout"] is out and kwargs["out"] is out and kwargs["lse"] is lse
    assert kwargs["q"] is q and kwargs["k"] is k and kwargs["v"] is v
    assert (kwargs["mask"], kwargs["scale"], kwargs["causal"]) == (None, 0.125, True)
    assert [g.shape for g in grads] == [q.shape] * 3
    calls.clear()
    own_op_compiles.backward_compiles(_attention_graph(save_lse=False)[0])
    assert calls == []


def _kernel(name: str):
    """What precompile reads of a generated kernel."""
    return types.SimpleNamespace(name=name, source=f"# source of {name}", warmup_args=lambda: (),
                                 grid_tuple=lambda: (1,), options=lambda: {}, constexprs={})


def _empty_graph() -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.placeholder("x"))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_background_precompile_returns_at_once_and_its_future_compiles_every_kernel():
    release, warmed = threading.Event(), []

    def warmup(name):
        def run(*args, **kwargs):
            release.wait(10)
            warmed.append((name, threading.current_thread().name))
        return run

    module = types.SimpleNamespace(a=types.SimpleNamespace(warmup=warmup("a")),
                                   b=types.SimpleNamespace(warmup=warmup("b")))
    pending = precompile_module.precompile(_empty_graph(), module, [_kernel("a"), _kernel("b")], "", None, 0,
                                           background=True)
    assert pending is not None and not pending.done()  # returned while the compiles wait
    release.set()
    pending.result(timeout=10)
    assert sorted(name for name, _ in warmed) == ["a", "b"]
    assert all(thread != threading.main_thread().name for _, thread in warmed)
    release.clear()
    assert precompile_module.precompile(_empty_graph(), module, [], "", None, 0) is None  # foreground: done


def test_a_background_compile_error_raises_at_every_call_of_the_graph():
    def fails(*args, **kwargs):
        raise RuntimeError("ptxas says no")

    module = types.SimpleNamespace(k=types.SimpleNamespace(warmup=fails))
    pending = precompile_module.precompile(_empty_graph(), module, [_kernel("k")], "", None, 0, background=True)
    calls = []
    call = _after(pending, lambda args: calls.append(args))
    for _ in range(2):
        with pytest.raises(FxoptError, match="could not compile kernel k.*ptxas says no"):
            call([1])
    assert calls == []  # the graph never ran without its kernels


def test_the_first_call_waits_for_the_background_compiles():
    from concurrent.futures import Future

    pending, seen = Future(), []
    call = _after(pending, lambda args: seen.append(pending.done()) or args[0] + 1)
    threading.Timer(0.2, pending.set_result, (None,)).start()
    assert call([41]) == 42 and seen == [True]
    assert call([1]) == 2


def test_a_kernel_compiling_ahead_is_waited_for_not_compiled_again(monkeypatch):
    """The backward graph's precompile asks for a kernel still compiling ahead: it waits for that compile
    instead of starting a second one; once done, the entry is forgotten (the JIT cache holds the kernel)."""
    started, release, preloads = threading.Event(), threading.Event(), []

    class Fn:
        fn = types.SimpleNamespace(__name__="_dkdv_kernel")

        def preload(self, spec):
            preloads.append(spec)
            started.set()
            release.wait(10)

    monkeypatch.setattr(precompile_module, "warm_launcher", lambda kernel: None)
    monkeypatch.setattr(torch.cuda, "device", lambda index: __import__("contextlib").nullcontext())
    fn = Fn()
    precompile_module._compile_ahead(fn, "spec", 0)
    precompile_module._compile_ahead(fn, "spec", 0)  # asked twice: one compile
    assert started.wait(10)
    waiter = threading.Thread(target=precompile_module._preload_own_op, args=(fn, "spec", 0))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waiting for the compile ahead
    release.set()
    waiter.join(10)
    assert preloads == ["spec"]
    assert (fn, "spec") not in precompile_module._ahead


def test_backward_compiles_with_the_forward_on_cuda_only_and_can_be_turned_off(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxopt.backend import backward_with_forward
    from fxopt.options import Environment, Options

    with FakeTensorMode():
        on_gpu = [torch.empty(4, 8, device="cuda")]
    on_cpu = [torch.empty(4, 8)]
    monkeypatch.delenv("FXOPT_BACKWARD_WITH_FORWARD", raising=False)
    env = Environment.read()
    assert backward_with_forward(Options(), env, on_gpu)
    assert not backward_with_forward(Options(), env, on_cpu)  # no background kernels to gain from
    assert not backward_with_forward(Options(cudagraphs=True), env, on_gpu)  # not yet run on a GPU
    monkeypatch.setenv("FXOPT_BACKWARD_WITH_FORWARD", "0")
    assert not backward_with_forward(Options(), Environment.read(), on_gpu)


def test_pool_threads_compile_for_the_graphs_gpu_not_device_0(monkeypatch):
    """A pool thread starts on device 0; a graph on cuda:1 (rank 1 of a two-GPU job) must have its
    kernels compiled with cuda:1 current, or Triton caches them for device 0 and the first call
    compiles them again."""
    import contextlib

    current = threading.local()

    @contextlib.contextmanager
    def device(index):
        before = getattr(current, "index", 0)
        current.index = index
        try:
            yield
        finally:
            current.index = before

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(precompile_module, "own_op_compiles", lambda gm: [])
    monkeypatch.setattr(precompile_module, "backward_compiles", lambda gm: [])
    seen = []
    record = types.SimpleNamespace(warmup=lambda *a, **k: seen.append(getattr(current, "index", 0)))
    graph = fx.Graph()
    x = graph.placeholder("x")
    # what _graph_device reads of a placeholder's value (a fake tensor on cuda:1 needs a second GPU)
    x.meta["val"] = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))
    graph.output(x)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    module = types.SimpleNamespace(a=record, b=record)
    precompile_module.precompile(gm, module, [_kernel("a"), _kernel("b")], "", None, 0, background=True).result(10)
    assert seen == [1, 1]


def _torch_level_attention_graph():
    """A torch-level graph (before aot_autograd) with the fused op as the attention pass leaves it: only
    its output 0 is read, values in dynamo's `example_value`."""
    gm, (q, k, v, out, lse) = _attention_graph(save_lse=False)
    gm.graph.eliminate_dead_code()  # (the unread getitem of the statistics)
    for node in gm.graph.nodes:
        node.meta["example_value"] = node.meta.pop("val", None)
    return gm, (q, k, v, out, lse)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_fused_ops_compile_from_the_torch_level_graph(monkeypatch, training):
    """Before aot_autograd: inference asks for the forward without statistics; training for the forward
    with them and the predicted backward, on the values dynamo recorded."""
    from fxopt.codegen import own_op_compiles

    calls = []
    monkeypatch.setattr(own_op_compiles, "_stand_in_call",
                        lambda name, callee, args, kwargs, out_val: calls.append((callee, args, kwargs)) or [])
    gm, (q, k, v, out, lse) = _torch_level_attention_graph()
    own_op_compiles.before_autograd_compiles(gm, training)
    callees = [c[0] for c in calls]
    assert callees == (["flash_attention", "flash_attention_backward"] if training else ["flash_attention_out_only"])
    assert calls[0][1][:3] == (q, k, v)
    if training:
        assert calls[1][2]["out"] is out and calls[1][2]["lse"] is lse and calls[1][2]["dout"] is out


def test_early_compiles_start_for_cuda_graphs_only(monkeypatch):
    """CPU graphs start nothing; a CUDA graph whose inputs require grad asks for the training compiles."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    started = []
    monkeypatch.setattr(precompile_module, "before_autograd_compiles", lambda gm, training: [("fn", f"{training}")])
    monkeypatch.setattr(precompile_module, "_compile_ahead", lambda fn, spec, device: started.append((fn, spec)))
    gm = _empty_graph()
    assert precompile_module.start_own_op_compiles(gm, [torch.ones(2)]) == 0 and not started
    with FakeTensorMode():
        weight = torch.empty(2, device="cuda").requires_grad_()
    assert precompile_module.start_own_op_compiles(gm, [weight]) == 1
    with torch.no_grad():
        precompile_module.start_own_op_compiles(gm, [weight])
    assert started == [("fn", "True"), ("fn", "False")]
