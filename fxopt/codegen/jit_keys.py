"""Triton cache keys for fxopt's own kernels that do not depend on which kernel a process hashed first.

A @triton.jit function's cache key (`JITFunction.cache_key`) folds in the keys of the functions it
calls and the module constants (`tl.constexpr` globals) they read. Triton 3.6 merges a callee's
constants into its caller's key *before* it hashes the callee (`DependenciesFinder._update_hash`), so
a callee hashed for the first time inside its caller's hashing adds nothing, and one hashed earlier
(by another kernel) adds its constants. The same kernel then has two keys, decided by what the process
happened to hash before. fxopt's attention backward kernel `_dq_tma_kernel` calls `head_slope`,
which reads `LOG2E`: the parent, which had hashed the forward kernel (and with it `head_slope`) first,
keyed `_dq_tma_kernel` differently from a compile worker that compiled it first, so the parent never
found the worker's compile (benchmarks/results/2026-12-05-h100-b.md), and a second process could miss
the first one's on-disk cache the same way. Triton 3.9 hashes the callee first itself.

`settle(namespace)` hashes every @triton.jit function a module defines after the functions it calls,
at the end of the module's import: since a module's callees in other modules were imported (and
settled) before it, every process then computes every key completely, whatever it hashes first.
A no-op under TRITON_INTERPRET=1 (interpreted functions have no cache key).
"""
from __future__ import annotations

import ast

from triton.runtime.jit import JITFunction

__all__ = ["settle", "callees"]


def callees(fn: JITFunction) -> list[JITFunction]:
    """The @triton.jit functions `fn`'s body calls by a global name, in the order they appear."""
    found: list[JITFunction] = []
    for node in ast.walk(fn.parse()):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            value = fn.__globals__.get(node.id)
            if isinstance(value, JITFunction) and value is not fn and all(value is not f for f in found):
                found.append(value)
    return found


def settle(namespace: dict) -> None:
    """Compute the cache key of each JITFunction defined in the module whose globals are `namespace`,
    each after the keys of every function it calls (depth first; a call cycle is left to Triton).
    A function whose key is already computed (`hash` set) is left as it is."""

    def visit(fn: JITFunction, path: frozenset) -> None:
        if fn.hash is not None or id(fn) in path:
            return
        for callee in callees(fn):
            visit(callee, path | {id(fn)})
        fn.cache_key  # noqa: B018 - the property computes and keeps the key

    for value in list(namespace.values()):
        if isinstance(value, JITFunction) and value.__module__ == namespace.get("__name__"):
            visit(value, frozenset())
