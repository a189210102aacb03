"""Kernels equal up to the names they bind share one JITFunction (one Triton compile); kernels that differ
in anything else (a called function, a constant, a keyword, a parameter) never do."""
from __future__ import annotations

import torch

import fxopt.compile as fxopt_compile
from fxopt.codegen.kernel_identity import kernel_identity
from fxopt.codegen.kernel import Kernel, kernel_definitions
from tests.helpers import CountingBackend, jit_kernels

_KERNEL = '''@triton.jit
def fused_mul_{n}(in_ptr0, out_ptr0, xnumel, XBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    xmask = xindex < xnumel
    {a} = tl.load(in_ptr0 + xindex, {mask}=xmask, other=0)  # f32[8] ({a})
    {b} = tl.{fn}({a}) * {c}  # aten.mul.Tensor
    tl.store(out_ptr0 + xindex, {b}, xmask)
'''


def _kernel(**changes) -> str:
    fields = dict(n=0, a="arg0_1", b="mul", mask="mask", fn="exp", c="2.0")
    return _KERNEL.format(**{**fields, **changes})


def test_names_and_comments_do_not_matter():
    assert kernel_identity(_kernel()) == kernel_identity(_kernel(n=7, a="getitem_31", b="mul_17"))
    assert kernel_identity(_kernel()) == kernel_identity(_kernel().replace("# aten.mul.Tensor", "# another note"))


def test_anything_else_does():
    base = kernel_identity(_kernel())
    for change in (dict(fn="log"), dict(c="3.0"), dict(mask="other2")):
        assert kernel_identity(_kernel(**change)) != base, change
    renamed_parameter = _kernel().replace("in_ptr0", "in_ptr9")  # launches pass constexprs by name
    assert kernel_identity(renamed_parameter) != base
    swapped = _kernel(a="mul", b="arg0_1")  # consistent renaming both ways: the same program
    assert kernel_identity(swapped) == base
    assert kernel_identity(_kernel(a="x", b="x")) != base  # one name for two values: another program


def test_calls_continued_on_the_next_line_keep_their_keywords():
    """Found by a sweep: read line by line, `mask=m)` on a continuation line looked like an assignment,
    and a kernel binding `mask` compared equal to one binding `other` (no generated kernel spans lines
    today; a later one would have launched the wrong program)."""
    def loop(keyword, var="r0"):
        return (f"def k(p, m):\n    acc = 0.0\n    for {var} in range(4):\n        x = tl.load(p + {var},\n"
                f"            {keyword}=m)\n        {keyword} = x\n        acc += {keyword}\n    return acc\n")
    assert kernel_identity(loop("mask")) != kernel_identity(loop("other"))
    assert kernel_identity(loop("mask")) == kernel_identity(loop("mask", var="r7"))  # the loop variable is its own


class _Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.proj(self.norm(x))) * 0.5


def _compile_blocks(n_blocks: int, monkeypatch):
    """(JITFunctions loaded, kernels generated, model, input, output, functions the wrappers define) for n
    blocks, from empty caches."""
    monkeypatch.setattr(fxopt_compile, "_KERNELS", {})
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(24) for _ in range(n_blocks)])
    x = torch.randn(5, 24, requires_grad=True)
    backend = CountingBackend()
    y = torch.compile(model, backend=backend)(x)
    y.square().sum().backward()
    kernels = sum(len(g.kernels) for g in backend.report.graphs)
    defined = sum(jit_kernels(g.wrapper_source) for g in backend.report.graphs)
    return len(fxopt_compile._KERNELS), kernels, model, x, y, defined


def test_identical_blocks_share_their_kernels_and_match_float64(monkeypatch):
    loaded_3, kernels_3, *_, defined_3 = _compile_blocks(3, monkeypatch)
    loaded_6, kernels_6, model, x, y, defined_6 = _compile_blocks(6, monkeypatch)
    assert kernels_6 > kernels_3 and loaded_6 == loaded_3, (loaded_3, kernels_3, loaded_6, kernels_6)
    assert defined_6 == defined_3 < kernels_6, (defined_3, defined_6, kernels_6)  # the wrappers define each once
    model64 = torch.nn.Sequential(*[_Block(24) for _ in range(6)]).double()
    model64.load_state_dict(model.state_dict())
    x64 = x.detach().double().requires_grad_()
    y64 = model64(x64)
    y64.square().sum().backward()
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)
    for p, p64 in zip(model.parameters(), model64.parameters()):
        torch.testing.assert_close(p.grad.double(), p64.grad, rtol=1e-4, atol=1e-4)


def _plain(name: str, source: str, **parts) -> Kernel:
    return Kernel(name=name, kind="reduction", source=source, ops=[], grid=1, int_args=[], constexprs={},
                  num_warps=4, **parts)


def test_a_repeated_kernel_and_its_prologue_become_second_names():
    first = _plain("fused_mul_0", _kernel(n=0), prologue=_plain("fused_mul_10", _kernel(n=10, c="3.0")))
    again = _plain("fused_mul_1", _kernel(n=1, a="x_9"), prologue=_plain("fused_mul_11", _kernel(n=11, c="3.0")))
    other = _plain("fused_mul_2", _kernel(n=2, fn="log"))
    text = kernel_definitions([first, again, other])
    assert "fused_mul_11 = fused_mul_10  # the same program as fused_mul_10" in text
    assert "fused_mul_1 = fused_mul_0  # the same program as fused_mul_0" in text
    assert jit_kernels(text) == 3 and "def fused_mul_2(" in text
    namespace = {}
    exec("import triton\nimport triton.language as tl\n" + text, namespace)  # every launched name is defined
    assert namespace["fused_mul_1"] is namespace["fused_mul_0"]
    assert namespace["fused_mul_11"] is namespace["fused_mul_10"]
    assert namespace["fused_mul_2"] is not namespace["fused_mul_0"]


def test_kernels_without_repeats_keep_their_text():
    kernels = [_plain("fused_mul_0", _kernel(n=0), prologue=_plain("fused_mul_10", _kernel(n=10, c="3.0"))),
               _plain("fused_mul_2", _kernel(n=2, fn="log"))]
    assert kernel_definitions(kernels) == "".join("\n" + k.full_source() + "\n" for k in kernels)
