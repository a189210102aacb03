"""codegen/static_launch.py: which kernels torch's C launcher takes, and with which arguments.

On the CPU the kernels are compiled offline for sm_90 (Triton's own compiler and ptxas, no GPU needed)
and the launch plan is read from their real metadata; the launches themselves run in the GPU tests."""
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from fxopt.codegen import static_launch
from fxopt.codegen.fast_launch import FastKernel
from fxopt.codegen.static_launch import launch_attributes, parameter_codes, plan_static_launch
from fxopt.compile import _triton_interpreter

with _triton_interpreter(False):  # compiled kernels, whatever TRITON_INTERPRET says for the tests
    @triton.jit
    def axpb(x_ptr, y_ptr, n, one, big, s, BLOCK: tl.constexpr):
        """y = x * s + (big - 2**40) * one over n elements (one is specialised to a constant 1)."""
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m) * s + (big - 1099511627776) * one, mask=m)


def _offline(signature, constexprs):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    return triton.compile(ASTSource(axpb, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32))


SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "one": "constexpr", "big": "i64", "s": "fp32",
             "BLOCK": "constexpr"}


def test_constants_are_dropped_and_scalars_typed_from_a_real_compile():
    compiled = _offline(SIGNATURE, {"one": 1, "BLOCK": 64})
    codes, keep, scratch = parameter_codes(compiled, n_args=6)
    assert keep == [0, 1, 2, 4, 5]  # `one` == 1 was folded into the cubin
    assert codes == "OOilf" + "O" * scratch  # two pointers, i32, i64, fp32, then null scratch pointers
    assert launch_attributes(compiled) is None


def test_a_16_bit_scalar_keeps_tritons_launcher():
    compiled = _offline({**SIGNATURE, "s": "fp16"}, {"one": 1, "BLOCK": 64})
    assert "fp16" in parameter_codes(compiled, n_args=6)


def _fake(signature, constants=None, **meta):
    return SimpleNamespace(src=SimpleNamespace(signature=signature, constants=constants or {}),
                           metadata=SimpleNamespace(**meta), asm={"cubin": b""})


def test_tensor_descriptors_scratch_and_launch_attributes_are_refused():
    assert "tensordesc" in parameter_codes(_fake({"d": "tensordesc<fp16[64, 64]>"}), 1)
    assert "global_scratch_size" in parameter_codes(_fake({"x": "*fp32"}, global_scratch_size=128), 1)
    assert "not positional" in parameter_codes(_fake({"x": "*fp32", "y": "*fp32"}), 1)
    assert launch_attributes(SimpleNamespace(metadata=SimpleNamespace(num_ctas=2))) == "num_ctas 2"
    assert launch_attributes(SimpleNamespace(metadata=SimpleNamespace(num_ctas=1, launch_pdl=True))) == "launch_pdl"
    assert "cluster_dims" in launch_attributes(SimpleNamespace(metadata=SimpleNamespace(cluster_dims=(2, 1, 1))))


def test_constants_keyed_by_name_or_index_are_both_folded():
    fake = _fake({"x": "*fp32", "n": "i32", "m": "i32"}, constants={"n": 1, (2,): 1})
    assert parameter_codes(fake, 3) == ("O", [0], 0)


@pytest.mark.skipif(static_launch._LAUNCHER is not None, reason="this torch has the C launcher")
def test_without_the_c_launcher_the_reason_is_given():
    assert plan_static_launch(_fake({"x": "*fp32"}), 1, 0) == "torch has no _StaticCudaLauncher"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 64])
def test_launches_through_the_c_launcher_match_tritons(n):
    x = torch.randn(n, device="cuda")
    k = FastKernel(axpb)
    outs = []
    for _ in range(3):
        y = torch.full_like(x, float("nan"))
        k[(triton.cdiv(n, 128),)](x, y, n, 1, 2**40 + 3, 0.5, BLOCK=128)
        outs.append(y)
    torch.cuda.synchronize()
    want = x.double() * 0.5 + 3
    for y in outs:  # every launch through torch's C launcher, the first one too (compiled by warmup)
        torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    assert k.static_refused is None and (k.fast_launches, k.static_launches, k.triton_launches) == (2, 3, 0)
    # so Triton never built its own launcher for it (a host-compiler run per signature, cold cache)
    assert all(c.module is None for c, _, _ in k._compiled.values())
    assert all(c.n_regs > 0 for c, _, _ in k._compiled.values())  # ptxas's count, as Triton would give it


@pytest.mark.gpu
def test_a_kernel_the_c_launcher_refuses_launches_through_triton_from_the_first_call(monkeypatch):
    from fxopt.codegen import fast_launch
    monkeypatch.setattr(fast_launch, "plan_static_launch", lambda *a: "refused by this test")
    x = torch.randn(300, device="cuda")
    k = FastKernel(axpb)
    outs = []
    for _ in range(2):
        y = torch.full_like(x, float("nan"))
        k[(3,)](x, y, 300, 1, 2**40, 0.25, BLOCK=128)
        outs.append(y)
    torch.cuda.synchronize()
    for y in outs:
        torch.testing.assert_close(y.double(), x.double() * 0.25, rtol=1e-6, atol=1e-6)
    assert k.static_refused == "refused by this test"
    assert (k.triton_launches, k.fast_launches, k.static_launches) == (1, 1, 0)


class FakeLauncher:
    """torch._C._StaticCudaLauncher's two calls, recorded (the CPU build has no such launcher)."""
    def __init__(self, returns_module=True):
        self.loaded, self.launched, self.returns_module = [], [], returns_module

    def _load_kernel(self, path, name, shared, device):
        with open(path, "rb") as f:
            self.loaded.append((f.read(), name, shared, device))
        return (11, 22, 32, 0) if self.returns_module else (22, 32, 0)

    def _launch_kernel(self, function, gx, gy, gz, warps, shared, codes, args, stream):
        self.launched.append((function, (gx, gy, gz), warps, codes, args, stream))


@pytest.mark.parametrize("returns_module", [True, False], ids=["torch>=2.12", "older"])
def test_the_plan_loads_the_cubin_once_and_passes_only_the_cubins_arguments(monkeypatch, returns_module):
    fake = FakeLauncher(returns_module)
    monkeypatch.setattr(static_launch, "_LAUNCHER", fake)
    compiled = _offline(SIGNATURE, {"one": 1, "BLOCK": 64})
    plan = plan_static_launch(compiled, 6, device=3)
    assert fake.loaded == [(compiled.asm["cubin"], compiled.metadata.name, compiled.metadata.shared, 3)]
    assert (plan.module, plan.function) == ((11, 22) if returns_module else (None, 22))
    assert (plan.n_regs, plan.n_spills) == (32, 0)
    x, y = object(), object()
    plan.launch(4, 1, 1, 7, (x, y, 100, 1, 2**40, 0.5))
    plan.launch(0, 1, 1, 7, (x, y, 100, 1, 2**40, 0.5))  # an empty grid launches nothing
    (function, grid, warps, codes, args, stream), = fake.launched
    scratch = len(codes) - 5
    assert (function, grid, warps, stream) == (22, (4, 1, 1), compiled.metadata.num_warps, 7)
    assert args == (x, y, 100, 2**40, 0.5) + (None,) * scratch  # `one` (== 1) is in the cubin


def test_when_nothing_is_folded_the_arguments_pass_as_they_are(monkeypatch):
    fake = FakeLauncher()
    monkeypatch.setattr(static_launch, "_LAUNCHER", fake)
    plan = plan_static_launch(_offline({**SIGNATURE, "one": "i32"}, {"BLOCK": 64}), 6, device=0)
    args = (object(), object(), 100, 7, 2**40, 0.5)
    plan.launch(2, 3, 1, 0, args)
    (_, grid, _, codes, passed, _), = fake.launched
    assert grid == (2, 3, 1) and codes.startswith("OOiilf") and passed[:6] == args


def test_static_refusal_says_whether_tritons_launcher_is_needed_at_all(monkeypatch):
    """The precompile pool builds Triton's launcher ahead only for kernels the C launcher refuses
    whatever their arguments: descriptors, scratch, launch attributes; a real plain kernel passes."""
    monkeypatch.setattr(static_launch, "_LAUNCHER", object())
    assert static_launch.static_refusal(_offline(SIGNATURE, {"one": 1, "BLOCK": 64})) is None
    assert "tensordesc" in static_launch.static_refusal(_fake({"d": "tensordesc<fp16[64, 64]>"}))
    assert "global_scratch_size" in static_launch.static_refusal(_fake({"x": "*fp32"}, global_scratch_size=8))
    assert static_launch.static_refusal(_fake({"x": "*fp32"}, num_ctas=2)) == "num_ctas 2"
    assert static_launch.static_refusal(SimpleNamespace(asm={}, metadata=None)) == "no cubin"
    monkeypatch.setattr(static_launch, "_LAUNCHER", None)
    assert "no _StaticCudaLauncher" in static_launch.static_refusal(_fake({"x": "*fp32"}))


@pytest.mark.parametrize("signature, static_env, built", [
    ({"x": "*fp32"}, "1", False), ({"d": "tensordesc<fp16[64, 64]>"}, "1", True), ({"x": "*fp32"}, "0", True)])
def test_precompile_builds_tritons_launcher_only_where_it_will_launch(monkeypatch, signature, static_env, built):
    from fxopt.codegen import precompile

    monkeypatch.setattr(static_launch, "_LAUNCHER", object())
    monkeypatch.setenv("FXOPT_STATIC_LAUNCH", static_env)
    kernel = _fake(signature)
    warmed = []
    monkeypatch.setattr(precompile, "warm_launcher", warmed.append)
    precompile._preload(SimpleNamespace(preload=lambda spec: kernel, fn=axpb), "spec", 0)
    assert warmed == ([kernel] if built else [])
