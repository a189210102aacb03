"""What `torch.compile(model, backend="fxopt")` loads through the `torch_dynamo_backends` entry point.

Dynamo loads it when torch.compile is called, before it traces the model: the moment to start
Triton's one-time set-up (its driver's C utilities, its cache keys) on threads, so they are ready
when fxopt's first compile needs them (codegen/precompile.warm_before_tracing), and to pause Python's
garbage collector over dynamo's compiles, tracing included (gc_pause.pause_dynamo_compiles). Importing
fxopt itself starts nothing; `fxopt.backend(...)` starts the same when it is called.
"""
from .backend import before_tracing, fxopt_backend

before_tracing()

__all__ = ["fxopt_backend"]
