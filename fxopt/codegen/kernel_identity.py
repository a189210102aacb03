"""When two generated kernels are the same program: equal up to the names of their own variables.

Kernels name their values after the graph's nodes (`mul_17 = (sub_5 * rsqrt_2)`), so the 24 blocks of
a GPT-2 medium give 24 texts of each kernel, and Triton compiled each one (24x the compile work of one
block on a cold first call). Two kernels whose token streams are equal once the names they bind
themselves (the function's own name, assigned and loop variables, helpers defined beside it) are
numbered in order of appearance, and comments are dropped (a regular expression reads the tokens:
Python's tokenize and ast took 1.1 s for a 24-block backward's 242 kernels), compute the same thing:
the wrapper then launches one JITFunction for both (compile.py `_KERNELS`). Everything else is kept as it is: names the
kernel does not bind (`tl`, `libdevice`, attributes after a dot), keyword names in calls, and the
parameters, which launches pass by name (`XBLOCK=`); so kernels that call different functions or take
different arguments never compare equal."""
from __future__ import annotations

import functools
import hashlib
import keyword
import re

# strings and comments first (a `#` in a string is no comment), then names, numbers, operators
_TOKEN = re.compile(r""""(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|#[^\n]*|[A-Za-z_]\w*|\d[\w.]*|==|[^\s\w]""")
# what a line binds: `def name`, `for a, b in`, `a, b = ...` (or `+=` and the other augmented forms)
_BINDS = re.compile(r"^[ \t]*(?:def[ \t]+(\w+)|for[ \t]+([\w, \t]+?)[ \t]+in\b"
                    r"|([\w, \t]+?)[ \t]*(?:[-+*/%&|^]|//|\*\*|<<|>>)?=(?!=))", re.M)


@functools.lru_cache(maxsize=4096)
def kernel_identity(source: str) -> str:
    """A hash equal for kernels that differ only in the names they bind and in comments."""
    bound = _bound_names(source)
    numbers: dict[str, str] = {}
    out = []
    for line in source.splitlines():
        tokens = [t for t in _TOKEN.findall(line) if not t.startswith("#")]
        if not tokens:
            continue
        out.append(str(len(line) - len(line.lstrip())))  # indentation is part of the program
        depth = 0
        for i, text in enumerate(tokens):
            depth += text in ("(", "[", "{")
            depth -= text in (")", "]", "}")
            keyword_arg = depth > 0 and i + 1 < len(tokens) and tokens[i + 1] == "="
            after_dot = i > 0 and tokens[i - 1] == "."
            if text in bound and not (keyword_arg or after_dot):
                text = numbers.setdefault(text, f"${len(numbers)}")  # `$`: no name of the source can equal it
            out.append(text)
        out.append("\n")
    return hashlib.sha256(" ".join(out).encode()).hexdigest()


def _bound_names(source: str) -> frozenset[str]:
    """Names the source binds, but parameters: the functions it defines, assignment and loop targets."""
    names = set()
    for match in _BINDS.finditer(source):
        for group in match.groups():
            if group:
                names.update(n for n in re.split(r"[\s,]+", group) if n and not keyword.iskeyword(n))
    return frozenset(names)
