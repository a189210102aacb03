"""Sizes as sympy expressions of dynamo's size symbols (s0, s1, ...), read without adding guards.

A graph compiled with dynamic shapes holds fake tensors whose sizes are SymInts. Comparing two
SymInts, or calling int()/bool() on one, asks the ShapeEnv, which may add a guard (specialise the
graph to the example size). fxopt reads `sym.node.expr` instead and does its arithmetic in sympy, so
compile-time decisions never narrow what the compiled code serves. Heuristics (block sizes, recompute
costs, roofline numbers) use the example values (`hint`), which is safe: they only choose how to
compute, never what.

Dynamo specialises sizes 0 and 1 (they become ints) and gives every other backed size the range
[2, inf); `known_ge` relies on that range through the ShapeEnv's own bounds.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.printers import PythonPrinter

Size = "int | sympy.Expr"


def expr(x) -> int | sympy.Expr:
    """An int as itself; a SymInt as its sympy expression (an int when dynamo made it a constant, or
    when a guard pins its symbols: see `pinned`)."""
    if isinstance(x, torch.SymInt):
        e = x.node.expr
        if not e.is_number:
            pins = pinned(x.node.shape_env)
            if pins and not pins.keys().isdisjoint(e.free_symbols):
                e = sympy.expand(e.xreplace(pins))
        return int(e) if e.is_number else e
    if isinstance(x, sympy.Expr):
        return int(x) if x.is_number else x
    return int(x)


def pinned(shape_env) -> dict:
    """Symbols that a guard fixes to a number ({s77: 1} for a guard Eq(s77, 1)).

    Dynamo normally turns a size of 1 into the constant 1, but under
    `torch.fx.experimental._config.backed_size_oblivious = True` a size 1 seen while tracing keeps its
    symbol, and an op that must know it is 1 adds the guard Eq(s, 1) without replacing the symbol: the
    graph then mixes s and 1 for one size (LayerNorm's [s, s, 1] statistics next to its [1, 1, 1]
    rstd). The compiled graph only runs where its guards hold, so reading s as 1 is exact. Cached per
    ShapeEnv and number of guards (guards only grow)."""
    if shape_env is None:
        return {}
    count = len(shape_env.guards)
    cached = getattr(shape_env, "_fxopt_pinned", None)
    if cached is None or cached[0] != count:
        pins = {}
        for guard in shape_env.guards:
            e = guard.expr
            if isinstance(e, sympy.Eq):
                a, b = e.args
                if a.is_Symbol and b.is_number:
                    pins[a] = b
                elif b.is_Symbol and a.is_number:
                    pins[b] = a
        cached = shape_env._fxopt_pinned = (count, pins)
    return cached[1]


def sizes(val: torch.Tensor) -> tuple:
    return tuple(expr(s) for s in val.shape)


def strides(val: torch.Tensor) -> tuple:
    return tuple(expr(s) for s in val.stride())


def row_major_strides(shape) -> tuple:
    """The strides of a contiguous tensor of these sizes (numbers or size expressions)."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step = step * size
    return tuple(reversed(strides))


def is_row_major(val: torch.Tensor) -> bool:
    """Contiguous for every value of the size symbols (a dim of size 1 may have any stride), decided
    structurally: `val.is_contiguous()` on symbolic sizes asks the ShapeEnv and may add a guard (under
    backed_size_oblivious, `Ne(s, 1)` for every size that could be 1)."""
    shape = sizes(val)
    dims = zip(shape, strides(val), row_major_strides(shape))
    return all(size == 1 or same(stride, expected) for size, stride, expected in dims)


def storage_offset(val: torch.Tensor) -> int | sympy.Expr:
    return expr(val.storage_offset())


def is_symbolic(x) -> bool:
    return isinstance(x, sympy.Expr) and not x.is_number


def same(a, b) -> bool:
    """Structural equality of two sizes (never a guard): equal for every value of the symbols."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def shape_env_of(gm: fx.GraphModule):
    """The ShapeEnv behind the graph's SymInts, or None for a static graph."""
    for n in gm.graph.nodes:
        env = shape_env_of_value(n.meta.get("val"))
        if env is not None:
            return env
    return None


def shape_env_of_value(v):
    """The ShapeEnv behind a value's SymInts (a fake tensor, a SymInt, a list of them), or None."""
    for s in _symints(v):
        return s.node.shape_env
    return None


def _symints(v):
    if isinstance(v, torch.SymInt):
        yield v
    elif isinstance(v, torch.Tensor):
        for s in (*v.shape, *v.stride(), v.storage_offset()):
            if isinstance(s, torch.SymInt) and not s.node.expr.is_number:
                yield s
    elif isinstance(v, (tuple, list)):
        for x in v:
            yield from _symints(x)


def graph_symbols(gm: fx.GraphModule) -> list[sympy.Symbol]:
    """Every size symbol the graph's values use, sorted by name."""
    found: set = set()
    for n in gm.graph.nodes:
        for s in _symints(n.meta.get("val")):
            found |= s.node.expr.free_symbols
    return sorted(found, key=lambda s: (len(s.name), s.name))


def has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    """Sizes dynamo left symbolic (dynamic=True, or automatic dynamic after a second shape)."""
    return any(True for n in gm.graph.nodes for _ in _symints(n.meta.get("val")))


def hint(x, shape_env=None) -> int:
    """The example value of a size (for heuristics only: never for what the code computes)."""
    if isinstance(x, torch.SymInt):
        x, shape_env = x.node.expr, x.node.shape_env
    if isinstance(x, sympy.Expr) and not x.is_number:
        if shape_env is None:
            raise ValueError(f"fxopt: no ShapeEnv to evaluate the example value of {x}")
        # optimization_hint where torch has it (size_hint warns there); size_hint on torch 2.11
        example = getattr(shape_env, "optimization_hint", None) or shape_env.size_hint
        return int(example(x))
    return int(x)


def known_ge(e, bound: int, shape_env=None) -> bool:
    """True when e >= bound for every value the symbols may take (dynamo's ranges; [2, inf) by default)."""
    if not is_symbolic(e):
        return int(e) >= bound
    if shape_env is not None:
        lower = shape_env.bound_sympy(e).lower
    else:
        from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy
        import torch.utils._sympy.numbers as nums
        lower = bound_sympy(e, {s: ValueRanges(2, nums.int_oo) for s in e.free_symbols}).lower
    return bool(lower >= bound)


_PRINTER = PythonPrinter()


def pexpr(e) -> str:
    """Python (and Triton) source for a size expression over the symbols' names."""
    if isinstance(e, (int, bool)):
        return str(int(e))
    return _PRINTER.doprint(e)


def ptuple(xs) -> str:
    """`(s0, 5)`-style source for a tuple of sizes."""
    inner = ", ".join(pexpr(x) for x in xs)
    return f"({inner}{',' if len(xs) == 1 else ''})"


PLAIN = (sympy.Symbol, sympy.Integer, sympy.Add, sympy.Mul)


def plain_arithmetic(e) -> bool:
    """Only +, * of symbols and integers (what fxopt's index arithmetic and printing handle)."""
    if not isinstance(e, sympy.Basic):
        return True
    return all(isinstance(a, PLAIN) or (isinstance(a, sympy.Pow) and a.exp.is_Integer and a.exp > 0)
               for a in sympy.preorder_traversal(e))


def symbol_bindings(gm: fx.GraphModule) -> dict[sympy.Symbol, str]:
    """Where the wrapper reads each size symbol at call time: a SymInt input (`arg0_1`), or a dim or
    stride of an input tensor (`primals_2.shape[0]`) whose size is exactly that symbol."""
    found: dict[sympy.Symbol, str] = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
            found.setdefault(v.node.expr, n.name)
        elif isinstance(v, torch.Tensor):
            for i, s in enumerate(v.shape):
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    found.setdefault(s.node.expr, f"{n.name}.shape[{i}]")
            for i, s in enumerate(v.stride()):
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    found.setdefault(s.node.expr, f"{n.name}.stride({i})")
    return found


def symbolic_unsupported_reason(gm: fx.GraphModule) -> str | None:
    """Why fxopt cannot compile this symbolic graph (it then runs as ATen), or None."""
    bound = symbol_bindings(gm)
    for s in graph_symbols(gm):
        if not s.name.startswith("s"):
            return f"data-dependent size {s} (unbacked): its value is known only inside the graph"
        if s not in bound:
            return f"size symbol {s} is not the size of any input, so the wrapper cannot read it at call time"
    for n in gm.graph.nodes:
        for si in _symints(n.meta.get("val")):
            if not plain_arithmetic(si.node.expr):
                return f"node '{n.name}' has the size {si.node.expr}: only + and * of sizes are handled"
    return None


def plain_real(e) -> sympy.Expr | None:
    """A SymFloat's expression in plain sympy (torch's ToFloat, FloatTrueDiv, FloatPow and opaque sqrt
    spelled as sympy's own), or None when it uses anything else (floor, mod, min, ...)."""
    if e.is_Atom:
        return e
    args = [plain_real(a) for a in e.args]
    if any(a is None for a in args):
        return None
    name = type(e).__name__
    if name == "ToFloat":
        return args[0]
    if name in ("FloatTrueDiv", "IntTrueDiv"):
        return args[0] / args[1]
    if name in ("FloatPow", "PowByNatural"):
        return args[0] ** args[1]
    if name == "OpaqueUnaryFn_sqrt":
        return sympy.sqrt(args[0])
    if isinstance(e, (sympy.Add, sympy.Mul, sympy.Pow)):
        return e.func(*args)
    return None


def scalar_expr(x) -> float | sympy.Expr | None:
    """A SymFloat or SymInt scalar as a number, or as plain sympy over the size symbols; None if neither."""
    if not isinstance(x, (torch.SymFloat, torch.SymInt)):
        return None
    e = plain_real(x.node.expr)
    if e is None:
        return None
    return float(e) if e.is_number else e


def is_inverse_sqrt(e, size) -> bool:
    """e == 1/sqrt(size) for every value of the symbols (sympy proves it: no example values)."""
    if not isinstance(e, sympy.Basic):
        return False
    product = sympy.nsimplify(e * sympy.sqrt(sympy.sympify(size)), rational=True)
    return sympy.simplify(product - 1) == 0


def guard_texts(shape_env, symbols: list[sympy.Symbol]) -> list[str]:
    """Dynamo's guards on the sizes as text: each symbol's range, then every non-trivial guard."""
    out = []
    for s in symbols:
        r = shape_env.var_to_range.get(s)
        if r is not None:
            upper = "" if r.upper in (int_oo, sympy.oo) else f" <= {r.upper}"
            out.append(f"{r.lower} <= {s}{upper}")
    return out + [str(g) for g in shape_env.get_nontrivial_guards()]
