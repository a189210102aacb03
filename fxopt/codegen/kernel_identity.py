"""When two generated kernels are the same program: equal up to the names of their own variables.

Kernels name their values after the graph's nodes (`mul_17 = (sub_5 * rsqrt_2)`), so the 24 blocks of
a GPT-2 medium give 24 texts of each kernel, and Triton compiled each one (24x the compile work of one
block on a cold first call). Two kernels whose token streams are equal once the names they bind
themselves (the function's own name, assigned and loop variables, helpers defined beside it) are
numbered in order of appearance, and comments are dropped (a regular expression reads the tokens, the
bracket depth carried from line to line: Python's tokenize and ast took 1.1 s for a 24-block backward's
242 kernels), compute the same thing: the wrapper defines the program once and names the repeats after
it (kernel.kernel_definitions), and graphs share one JITFunction for it (compile.py `_KERNELS`).
Everything else is kept as it is: names the kernel does not bind (`tl`, `libdevice`, attributes after a
dot), keyword names in calls, and the parameters, which launches pass by name (`XBLOCK=`); so kernels
that call different functions or take different arguments never compare equal."""
from __future__ import annotations

import functools
import hashlib
import keyword
import re

# strings and comments first (a `#` in a string is no comment), then names, numbers, operators
_TOKEN = re.compile(r""""(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|#[^\n]*|[A-Za-z_]\w*|\d[\w.]*|==|[^\s\w]""")
_OPEN, _CLOSE = ("(", "[", "{"), (")", "]", "}")


@functools.lru_cache(maxsize=4096)
def kernel_identity(source: str) -> str:
    """A hash equal for kernels that differ only in the names they bind and in comments."""
    tokens = _tokens(source)
    bound = _bound_names(tokens)
    numbers: dict[str, str] = {}
    out = []
    for i, (text, depth, line_start, indent) in enumerate(tokens):
        if line_start:
            out += ["\n", str(indent)]  # indentation is part of the program
        keyword_arg = depth > 0 and i + 1 < len(tokens) and tokens[i + 1][0] == "="
        after_dot = i > 0 and tokens[i - 1][0] == "."
        if text in bound and not (keyword_arg or after_dot):
            text = numbers.setdefault(text, f"${len(numbers)}")  # `$`: no name of the source can equal it
        out.append(text)
    return hashlib.sha256(" ".join(out).encode()).hexdigest()


def _tokens(source: str) -> list[tuple[str, int, bool, int]]:
    """(text, bracket depth it stands at, first of its line, the line's indentation), comments dropped.
    The depth carries over lines: a call continued on the next line (`mask=m)`) is still inside it."""
    out, depth = [], 0
    for line in source.splitlines():
        texts = [t for t in _TOKEN.findall(line) if not t.startswith("#")]
        indent = len(line) - len(line.lstrip())
        for j, text in enumerate(texts):
            depth -= text in _CLOSE
            out.append((text, depth, j == 0, indent))
            depth += text in _OPEN
    return out


def _bound_names(tokens: list) -> frozenset[str]:
    """Names the source binds, but parameters: `def name`, `for a, b in`, and the targets of
    `a, b = ...` (or an augmented `+=`, `-=`, ...) at the start of a statement."""
    names = set()
    for i, (text, depth, line_start, _) in enumerate(tokens):
        if not (line_start and depth == 0):
            continue
        if text == "def" and i + 1 < len(tokens):
            names.add(tokens[i + 1][0])
            continue
        j, targets = (i + 1 if text == "for" else i), []
        while j < len(tokens) and (j == i or not tokens[j][2]) and (
                tokens[j][0] == "," or (tokens[j][0].isidentifier() and not keyword.iskeyword(tokens[j][0]))):
            if tokens[j][0] != ",":
                targets.append(tokens[j][0])
            j += 1
        after = [t[0] for t in tokens[j:j + 2]]
        assigned = after[:1] == ["="] or (after[1:] == ["="] and after[0] in _AUGMENTED)
        if (after[:1] == ["in"]) if text == "for" else assigned:
            names.update(targets)
    return frozenset(names)


_AUGMENTED = ("+", "-", "*", "/", "%", "&", "|", "^")  # `+=` and the like (`//=`, `**=`, `<<=`: not recognised)
