"""verify=True: run each pass's output graph on the same inputs as the captured graph and compare.

The first pass whose outputs differ (norm-wise relative error above `rtol`) is named, together with
the first node, in the pass's output order, whose value differs from the same-named captured node.

Generated code keeps a graph's fp16/bf16 chains in fp32 registers and rounds once where the captured
graph rounds after every op, so the two can differ by more than the tolerance while the generated code
is the more accurate (a softmax over fp16 logits amplifies the captured graph's roundings); and an
output that is zero up to rounding (`(x - x.mean(-1, keepdim=True)).sum(-1)`) has no relative error
to speak of. Where the generated code differs, the captured graph run in float64 arbitrates: the
generated code passes when it is as close to that as the captured graph is.

Every run is made to repeat the captured one and to leave no trace: it starts from the same RNG state
(a dropout mask is the same draw in each, and the caller's RNG stream is not advanced), works on clones
of the inputs, and puts back every tensor the graph holds as an attribute (a compiled optimizer step
updates parameters and state in place: each verification run would otherwise take another step).
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from .analysis.torch_ops import module_attribute
from .errors import VerifyError
from .pass_manager import snapshot


def graph_dtypes(gm: fx.GraphModule) -> set:
    """The dtypes of the tensors a graph's nodes compute (ATen graphs' `val`, dynamo's `example_value`)."""
    found = set()
    for n in gm.graph.nodes:
        value = n.meta.get("val", n.meta.get("example_value"))
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, torch.Tensor):
                found.add(v.dtype)
    return found


def real_inputs(example_inputs) -> list:
    """Real tensors for fake ones (same shape, strides, dtype, device): random floats, zero ints."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for x in example_inputs:
        if isinstance(x, FakeTensor) or (isinstance(x, torch.Tensor) and x.device.type == "meta"):
            # the layout's storage filled, then viewed: an expanded (stride-0) input shares elements, which a
            # copy into it would refuse
            extent = _extent(x)
            if x.dtype.is_floating_point:
                storage = torch.randn(extent, generator=gen).to(x.dtype)
            else:
                storage = torch.zeros(extent, dtype=x.dtype)
            out.append(storage.to(x.device).as_strided(x.shape, x.stride()))
        elif isinstance(x, torch.Tensor):
            out.append(x.detach().clone())
        else:
            out.append(x)
    return out


def rel_error(a, b) -> float:
    """Norm-wise relative error of `a` (a pass's or the generated code's value) against `b` (the captured
    graph's). Where `b` is NaN nothing is compared: verify feeds random values (a backward graph's saved
    log-sum-exp or rstd among them), which can leave the captured graph's own result undefined there;
    a NaN in `a` where `b` has a number is an infinite error."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):  # a higher-order op's outputs
        if len(a) != len(b):
            return float("inf")
        return max([rel_error(x, y) for x, y in zip(a, b)] or [0.0])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        try:
            return 0.0 if bool(a == b) else float("inf")
        except (RuntimeError, TypeError, ValueError):  # values == cannot compare: not a difference we can name
            return 0.0
    if a.shape != b.shape:
        return float("inf")
    if not a.dtype.is_floating_point:
        return 0.0 if torch.equal(a.cpu(), b.cpu()) else float("inf")
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    undefined = torch.isnan(b64)  # where the captured graph itself gives NaN on verify's random inputs
    if torch.isnan(a64).logical_and(~undefined).any():
        return float("inf")
    a64, b64 = torch.nan_to_num(a64).masked_fill(undefined, 0.0), torch.nan_to_num(b64).masked_fill(undefined, 0.0)
    denom = b64.norm().item()
    return (a64 - b64).norm().item() / (denom if denom > 0 else 1.0)


class _Recorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict[str, object] = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def verifier_for(captured: fx.GraphModule, example_inputs, rtol: float, graph_name: str):
    """(GraphVerifier, None), or (None, why) where the captured graph itself does not run on verify's
    inputs (random floats and zero ints for fake ones, under no_grad): a backward graph's saved LU pivots
    of zeros (lu_solve refuses them), a tensor hook registered on an intermediate that needs grad. Then
    the graph compiles unverified, the reason in its notes, instead of failing the compile."""
    try:
        return GraphVerifier(captured, example_inputs, rtol, graph_name), None
    except Exception as exc:  # the captured graph's own error: not a result verify could compare
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, (f"verify=True is skipped for the {graph_name} graph: the captured graph does not run on "
                      f"verify's example inputs ({type(exc).__name__}: {first[:200]})")


class GraphVerifier:
    def __init__(self, captured: fx.GraphModule, example_inputs, rtol: float, graph_name: str):
        with unset_fake_temporarily():  # aot_autograd calls compilers under its fake mode
            self._setup(captured, example_inputs, rtol, graph_name)

    def _setup(self, captured, example_inputs, rtol, graph_name):
        self.inputs = real_inputs(example_inputs)
        self.rtol, self.graph_name = rtol, graph_name
        # the passes rewrite the captured graph in place: a copy of it (its tensors shared) is kept for the
        # float64 run, made only where the generated code differs
        self.captured = None
        if any(d.is_floating_point for d in graph_dtypes(captured)):
            with contextlib.suppress(Exception):  # a graph that does not copy: no arbiter, verify as before
                self.captured = snapshot(captured)
        self.attributes = _attribute_tensors(captured)
        rec = _Recorder(captured)
        with torch.no_grad(), self._repeatable():
            self.expected = rec.run(*[_clone(x) for x in self.inputs])
        self.reference = rec.values

    @contextlib.contextmanager
    def _repeatable(self):
        """The same RNG state on entry to every run, the caller's restored after, and the graph's
        attribute tensors put back as they were."""
        saved = [(t, t.detach().clone()) for t in self.attributes]
        devices = sorted({x.device.index or 0 for x in [*self.inputs, *self.attributes]
                          if isinstance(x, torch.Tensor) and x.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices):
            torch.random.default_generator.manual_seed(_SEED)  # (only the generators fork_rng restores)
            for d in devices:
                torch.cuda.default_generators[d].manual_seed(_SEED)
            try:
                yield
            finally:
                with torch.no_grad():
                    for t, before in saved:
                        t.copy_(before)

    def __call__(self, gm: fx.GraphModule, pass_name: str) -> float:
        rec = _Recorder(gm)
        self.attributes = list(dict.fromkeys(self.attributes + _attribute_tensors(gm)))
        with torch.no_grad(), unset_fake_temporarily(), self._repeatable():
            got = rec.run(*[_clone(x) for x in self.inputs])
            err = self._max_error(got)
            bad = self._first_bad_node(gm, rec.values) if err > self.rtol else ""
        if err > self.rtol:
            raise VerifyError(f"fxopt verify: pass '{pass_name}' changed the {self.graph_name} graph's results "
                              f"(max relative error {err:.3g} > {self.rtol}); first differing node: "
                              f"{bad}")
        return err

    def check_callable(self, call) -> float:
        """The generated wrapper (kernels included) against the captured graph."""
        with torch.no_grad(), unset_fake_temporarily(), self._repeatable():
            got = call([_clone(x) for x in self.inputs])
            err = self._max_error(got)
            arbiter = self._float64_verdict(got) if err > self.rtol else ""
        if err > self.rtol and not arbiter.startswith("as accurate"):
            raise VerifyError(f"fxopt verify: generated code for the {self.graph_name} graph differs from the "
                              f"captured graph (max relative error {err:.3g} > {self.rtol}{arbiter}); the graph "
                              f"passes verified, so the fault is in codegen: see rep.kernels and the wrapper source")
        return err

    def _float64_verdict(self, got) -> str:
        """"as accurate ..." when each of the generated code's outputs is as close to the captured graph
        run in float64 as the captured graph's own (within 2x, or the tolerance), or, for an output that
        is zero up to rounding, within rounding noise of it (64 ulps of the dtype times the inputs'
        norm: a relative error means nothing there); else why not. "" where the graph computes no
        floats or does not run in float64."""
        if self.captured is None:
            return ""
        try:
            with self._repeatable():
                ideal = _in_float64(self.captured)(*[_float64(_clone(x)) for x in self.inputs])
        except Exception:  # an op without a float64 kernel (flash attention): no arbiter
            return ""
        ideal = ideal if isinstance(ideal, (list, tuple)) else [ideal]
        got = got if isinstance(got, (list, tuple)) else [got]
        exp = self.expected if isinstance(self.expected, (list, tuple)) else [self.expected]
        eps = max(torch.finfo(d).eps for d in graph_dtypes(self.captured) if d.is_floating_point)
        noise = 64 * eps * max([_norm(x) for x in self.inputs if isinstance(x, torch.Tensor)] or [1.0])
        worst = (0.0, 0.0)
        for g, e, i in zip(got, exp, ideal):
            if not isinstance(e, torch.Tensor):
                continue
            ours, theirs = rel_error(g, i), rel_error(e, i)
            near_zero = _norm(i) <= noise and ours != float("inf") and _norm(g, minus=i) <= noise
            if ours > max(self.rtol, 2 * theirs) and not near_zero and ours > worst[0]:
                worst = (ours, theirs)
        if worst == (0.0, 0.0):
            return "as accurate against float64 as the captured graph"
        return f"; against the graph run in float64 {worst[0]:.3g}, the captured graph's own {worst[1]:.3g}"

    def _max_error(self, got) -> float:
        got = got if isinstance(got, (list, tuple)) else [got]
        exp = self.expected if isinstance(self.expected, (list, tuple)) else [self.expected]
        return max([rel_error(g, e) for g, e in zip(got, exp) if isinstance(e, torch.Tensor)] or [0.0])

    def _first_bad_node(self, gm: fx.GraphModule, values: dict) -> str:
        for n in gm.graph.nodes:
            if n.name in values and n.name in self.reference and n.op not in ("placeholder", "output"):
                if rel_error(values[n.name], self.reference[n.name]) > self.rtol:
                    return f"'{n.name}' ({n.target})"
        return "(no same-named node differs; the difference comes from a new node)"


def _in_float64(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph computing in float64: every floating dtype its ops name (casts, factories,
    accumulation dtypes), in its subgraphs too, and every floating tensor attribute made float64."""
    wide = copy.deepcopy(gm)
    widen = lambda a: torch.float64 if isinstance(a, torch.dtype) and a.is_floating_point else a  # noqa: E731
    for sub in [m for m in wide.modules() if isinstance(m, fx.GraphModule)]:
        for n in sub.graph.nodes:
            n.args, n.kwargs = tree_map(widen, n.args), tree_map(widen, n.kwargs)
        sub.recompile()
    for name, value in list(wide.named_parameters()) + list(wide.named_buffers()):
        if value.is_floating_point():
            owner, _, leaf = name.rpartition(".")
            module = wide.get_submodule(owner) if owner else wide
            setattr(module, leaf, torch.nn.Parameter(value.detach().double(), requires_grad=False)
                    if isinstance(value, torch.nn.Parameter) else value.detach().double())
    for module in list(wide.modules()):  # constants held as plain tensor attributes
        for leaf, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and value.is_floating_point() and not leaf.startswith("_"):
                setattr(module, leaf, value.detach().double())
    return wide


def _norm(x, minus=None) -> float:
    """The 2-norm of a floating tensor (of x - minus), in float64; 0 for others."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return 0.0
    x = x.detach().double().cpu()
    return (x if minus is None else x - minus.detach().double().cpu()).nan_to_num().norm().item()


def _float64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _clone(x):
    """A copy with x's own strides, expanded (stride-0) dims included: clone() makes those contiguous,
    and a kernel compiled for the expanded layout refuses it."""
    if not isinstance(x, torch.Tensor):
        return x
    if not x.numel():
        return x.clone()
    return x.as_strided((_extent(x),), (1,)).clone().as_strided(x.shape, x.stride())


def _extent(x: torch.Tensor) -> int:
    """Elements of storage x's layout spans from its first element."""
    return 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) if x.numel() else 0


_SEED = 0x5EED


def _attribute_tensors(gm: fx.GraphModule) -> list:
    """The tensors a graph reads as module attributes (parameters, buffers, constants), the ones a run
    could change in place."""
    found = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            value = module_attribute(gm, n.target)
            if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
                found.append(value)
    return found
