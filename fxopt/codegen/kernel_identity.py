"""When two generated kernels are the same program: equal up to the names of their own variables.

Kernels name their values after the graph's nodes (`mul_17 = (sub_5 * rsqrt_2)`), so the 24 blocks of
a GPT-2 medium give 24 texts of each kernel, and Triton compiled each one (24x the compile work of one
block on a cold first call). Two kernels whose token streams are equal once the names they bind
themselves (the function's own name, assigned and loop variables, helpers defined beside it) are
numbered in order of appearance, and comments are dropped, compute the same thing: the wrapper then
launches one JITFunction for both (compile.py `_KERNELS`). Everything else is kept as it is: names the
kernel does not bind (`tl`, `libdevice`, attributes after a dot), keyword names in calls, and the
parameters, which launches pass by name (`XBLOCK=`); so kernels that call different functions or take
different arguments never compare equal."""
from __future__ import annotations

import ast
import functools
import hashlib
import io
import keyword
import tokenize

_SKIPPED = (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER)
_LAYOUT = {tokenize.NEWLINE: "\n", tokenize.INDENT: "{", tokenize.DEDENT: "}"}


@functools.lru_cache(maxsize=4096)
def kernel_identity(source: str) -> str:
    """A hash equal for kernels that differ only in the names they bind and in comments."""
    bound = _bound_names(source)
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in _SKIPPED]
    numbers: dict[str, str] = {}
    out, depth = [], 0
    for i, tok in enumerate(tokens):
        text = tok.string
        depth += text in "([{" and tok.type == tokenize.OP
        depth -= text in ")]}" and tok.type == tokenize.OP
        keyword_arg = depth > 0 and i + 1 < len(tokens) and tokens[i + 1].string == "="
        after_dot = i > 0 and tokens[i - 1].string == "."
        if tok.type == tokenize.NAME and text in bound and not (keyword_arg or after_dot or keyword.iskeyword(text)):
            text = numbers.setdefault(text, f"${len(numbers)}")  # `$`: no name of the source can equal it
        elif tok.type in _LAYOUT:
            text = _LAYOUT[tok.type]
        out.append(text)
    return hashlib.sha256(" ".join(out).encode()).hexdigest()


def _bound_names(source: str) -> frozenset[str]:
    """Names the source binds, but parameters: the functions it defines, assignment and loop targets."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
    return frozenset(names)
