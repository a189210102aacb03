"""fxopt's own Triton kernels get the same cache key in every process, whatever the process hashed
first (codegen/jit_keys.py). Triton 3.6 left a callee's module constants out of its caller's key when
the caller was hashed first, so a compile worker and the parent keyed `_dq_tma_kernel` differently.
Keys are computed with the compiler's JITFunction, so each check runs in a subprocess without the
interpreter (this suite runs under TRITON_INTERPRET=1)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _keys_hashing_first(first: str) -> dict:
    """Import the attention and cross-entropy kernel modules, hash `first` before anything else asks
    for a key, then the rest; each kernel's key."""
    return _run(f"""
        import json, importlib
        names = {{"fwd": ("fxopt.attention.flash_forward_tma", "_flash_forward_tma_kernel"),
                  "dq": ("fxopt.attention.flash_backward_tma", "_dq_tma_kernel"),
                  "dkdv": ("fxopt.attention.flash_backward_tma", "_dkdv_tma_kernel"),
                  "fwd_ptr": ("fxopt.attention.flash_forward", "_flash_forward_kernel"),
                  "ce": ("fxopt.losses.cross_entropy_kernels", "_forward_kernel")}}
        fns = {{k: getattr(importlib.import_module(m), f) for k, (m, f) in names.items()}}
        order = [{first!r}] + [k for k in fns if k != {first!r}]
        print(json.dumps({{k: fns[k].cache_key for k in order}}))
    """)


def test_kernel_keys_do_not_depend_on_which_kernel_is_hashed_first():
    # the parent hashes the forward first; a compile worker may compile the backward's dQ first
    forward_first, dq_first = _keys_hashing_first("fwd"), _keys_hashing_first("dq")
    assert forward_first == dq_first


def test_settle_hashes_callees_before_callers(tmp_path):
    """In a module of our own: the caller's key includes the constant its callee reads, as it does when
    the callee was hashed first, and `callees` lists what the body calls."""
    (tmp_path / "kmod.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl
        from fxopt.codegen.jit_keys import settle

        SCALE: tl.constexpr = tl.constexpr(2.0)

        @triton.jit
        def outer(x):
            return inner(x) + 1

        @triton.jit
        def inner(x):
            return x * SCALE

        settle(globals())
    """))
    got = _run(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import kmod
        from fxopt.codegen.jit_keys import callees
        print(json.dumps({{"outer_constants": [n for (n, _), _ in kmod.outer.used_global_vals.items()],
                          "callees": [f.__name__ for f in callees(kmod.outer)],
                          "inner_callees": [f.__name__ for f in callees(kmod.inner)]}}))
    """)
    assert got == {"outer_constants": ["SCALE"], "callees": ["inner"], "inner_callees": []}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="this process runs Triton's compiler")
def test_settle_is_a_no_op_under_the_interpreter():
    from fxopt.attention import flash_common
    from fxopt.codegen.jit_keys import settle

    settle(vars(flash_common))  # interpreted functions: nothing to hash, nothing raised
