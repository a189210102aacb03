"""The benchmark workloads: a registry of named (fn, inputs) factories plus what each must cost at minimum.

A workload is registered with the `workload` decorator on a factory `make(device, dtype, quick)` that
returns `(fn, inputs)`; `fn(*inputs)` is what every backend runs. `quick=True` shrinks the sizes so
the runner can be smoke-tested on a CPU. Besides the factory a workload records:

  min_bytes(inputs, outputs) -> int   bytes a perfect implementation must move: every input read once
                                      and every output written once (`io_bytes`, the default). A
                                      workload whose lower bound differs (e.g. training, which also
                                      writes gradients it does not return) passes its own function.
  flops(inputs) -> int | None         floating-point operations, for compute-bound workloads (matmul,
                                      attention); None for memory-bound ones.
  training                            False: run under torch.no_grad(). True: run with grad enabled;
                                      fn itself then does the forward and backward it wants timed.
  rtol, atol                          tolerance of the check against eager; None = default for the dtype.
  kind                                "pointwise", "reduction", "attention" or "model".
  anchor(*inputs)                     optional: the same computation written with PyTorch's own fused op
                                      (for attention: F.scaled_dot_product_attention), taking the same
                                      inputs. The runner's "sdpa" backend times it in eager mode, so each
                                      number has PyTorch's best in the same run to be judged against.

Adding a workload (a softmax, a layernorm, attention, a training step) is one decorated function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

FULL_SIDE = 8192  # 8192 x 8192 = 67,108,864 elements (128 MiB in bf16)
QUICK_SIDE = 256


def side(quick: bool) -> int:
    return QUICK_SIDE if quick else FULL_SIDE


def tensors(obj) -> list[torch.Tensor]:
    """The tensors in an output: a tensor, or a (nested) tuple/list/dict of them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in tensors(item)]
    return []


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's own elements (a broadcast or transposed view still counts each element once)."""
    return t.numel() * t.element_size()


def io_bytes(inputs: Sequence[Any], outputs: Any) -> int:
    """Every input tensor read once plus every output tensor written once."""
    return sum(nbytes(t) for t in tensors(list(inputs))) + sum(nbytes(t) for t in tensors(outputs))


@dataclass(frozen=True)
class Workload:
    name: str
    make: Callable[[str, torch.dtype, bool], tuple[Callable, tuple]]
    description: str = ""
    kind: str = "pointwise"
    min_bytes: Callable[[Sequence[Any], Any], int] = io_bytes
    flops: Callable[[Sequence[Any]], int] | None = None
    training: bool = False
    rtol: float | None = None
    atol: float | None = None
    anchor: Callable | None = None
    precision: str | None = None
    cudagraphs: bool = False


WORKLOADS: dict[str, Workload] = {}


def workload(name: str, description: str = "", **fields):
    """Decorator: register `make(device, dtype, quick) -> (fn, inputs)` under `name`."""
    def register(make):
        if name in WORKLOADS:
            raise ValueError(f"workload {name!r} registered twice")
        WORKLOADS[name] = Workload(name=name, make=make, description=description, **fields)
        return make
    return register


def get(names: str | None) -> list[Workload]:
    """Workloads by comma-separated names (None or "all": every one, in registration order)."""
    if not names or names == "all":
        return list(WORKLOADS.values())
    picked = []
    for n in (s.strip() for s in names.split(",") if s.strip()):
        if n not in WORKLOADS:
            raise SystemExit(f"unknown workload {n!r}; known: {', '.join(WORKLOADS)}")
        picked.append(WORKLOADS[n])
    return picked


def randn(*shape, device, dtype):
    return torch.randn(*shape, device=device, dtype=dtype)


# ---------------------------------------------------------------- pointwise (memory-bound) workloads
# The functions are module-level so that dynamo sees the same code object on every run.

def _chain(x, w, b):
    y = x * w + b
    y = F.gelu(y) * torch.sigmoid(x) + x
    return torch.tanh(y) * 0.5 + y * y


@workload("chain", "y=x*w+b; y=gelu(y)*sigmoid(x)+x; tanh(y)*0.5+y*y; x,w,b [N,N]")
def make_chain(device, dtype, quick):
    n = side(quick)
    return _chain, tuple(randn(n, n, device=device, dtype=dtype) for _ in range(3))


def _bias_gelu(x, bias):
    return F.gelu(x + bias)


@workload("bias_gelu", "gelu(x + bias); x [N,N], bias [N] broadcast over rows")
def make_bias_gelu(device, dtype, quick):
    n = side(quick)
    return _bias_gelu, (randn(n, n, device=device, dtype=dtype), randn(n, device=device, dtype=dtype))


def _transposed(x, y):
    return x.t() * 2 + y


@workload("transposed", "x.t()*2 + y; x [N,N] read transposed, y [N,N] contiguous")
def make_transposed(device, dtype, quick):
    n = side(quick)
    return _transposed, (randn(n, n, device=device, dtype=dtype), randn(n, n, device=device, dtype=dtype))


def _multi_out(x):
    return x * 2 + 1, torch.sigmoid(x) * x


@workload("multi_out", "(x*2+1, sigmoid(x)*x); one input, two outputs")
def make_multi_out(device, dtype, quick):
    n = side(quick)
    return _multi_out, (randn(n, n, device=device, dtype=dtype),)


def _add(x, y):
    return x + y


@workload("add", "x + y; the cheapest op: should reach copy bandwidth")
def make_add(device, dtype, quick):
    n = side(quick)
    return _add, (randn(n, n, device=device, dtype=dtype), randn(n, n, device=device, dtype=dtype))


from . import workloads_reduction  # noqa: E402,F401  (registers the reduction workloads)
from . import workloads_attention  # noqa: E402,F401  (registers the attention workloads)
from . import workloads_losses  # noqa: E402,F401  (registers the loss workloads)
from . import workloads_models  # noqa: E402,F401  (registers the mixed-precision, training and CUDA-graph blocks)
