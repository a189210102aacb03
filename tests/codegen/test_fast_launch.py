"""FastKernel (codegen/fast_launch.py): a launch goes straight to the compiled kernel only when it has
the specialisation that kernel was compiled for. Checked here with a stand-in JITFunction (the CPU
interpreter has no compiled launcher); the GPU tests run every generated kernel through it for real."""
import pytest
import torch

from fxopt.codegen import fast_launch
from fxopt.codegen.fast_launch import FastKernel, specialisation


class Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.log.append(("fast", (gx, gy, gz), stream, args))


class StandIn:
    """What FastKernel uses of a JITFunction: arg_names and kernel[grid](*args, **kwargs)."""
    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self):
        self.log, self.compiled = [], 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", tuple(grid), args, dict(kwargs)))
            self.compiled += 1
            return Compiled(self.log)
        return launch


@pytest.fixture(autouse=True)
def no_cuda_stream(monkeypatch):
    monkeypatch.setattr(fast_launch, "launch_target", lambda: (0, 7))


def test_second_launch_with_the_same_specialisation_is_fast():
    fn, x = StandIn(), torch.empty(64)
    k = FastKernel(fn)
    k[(4,)](x, 64, BLOCK=16, num_warps=4)
    k[(4,)](x, 64, BLOCK=16, num_warps=4)
    assert [e[0] for e in fn.log] == ["triton", "fast"]
    assert fn.log[1] == ("fast", (4, 1, 1), 7, (x, 64, 16))  # every argument in signature order, grid padded
    assert k.fast_launches == 1
    assert k.static_launches == 0 and k.static_refused  # the stand-in has no cubin: Triton's launcher


class Recording:
    """A StaticLaunch stand-in: records what the C launcher would be given."""
    def __init__(self, log):
        self.log = log

    def launch(self, gx, gy, gz, stream, args):
        self.log.append(("static", (gx, gy, gz), stream, args))


def test_a_kernel_the_c_launcher_takes_goes_through_it(monkeypatch):
    fn, x = StandIn(), torch.empty(64)
    planned = []
    monkeypatch.setattr(fast_launch, "plan_static_launch",
                        lambda compiled, n_args, device: planned.append((n_args, device)) or Recording(fn.log))
    k = FastKernel(fn)
    k[(4, 2)](x, 64, BLOCK=16)
    k[(4, 2)](x, 64, BLOCK=16)
    assert planned == [(2, 0)]  # planned once, for the positional arguments, on the launch's device
    assert fn.log[1] == ("static", (4, 2, 1), 7, (x, 64))  # constexprs are in the cubin, not passed
    assert (k.fast_launches, k.static_launches) == (1, 1)


def test_static_launch_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("FXOPT_STATIC_LAUNCH", "0")
    monkeypatch.setattr(fast_launch, "plan_static_launch", lambda *a: pytest.fail("planned"))
    fn, x = StandIn(), torch.empty(64)
    k = FastKernel(fn)
    k[(4,)](x, 64, BLOCK=16)
    k[(4,)](x, 64, BLOCK=16)
    assert [e[0] for e in fn.log] == ["triton", "fast"] and k.static_refused == "FXOPT_STATIC_LAUNCH=0"


def test_another_device_compiles_its_own_entry(monkeypatch):
    fn, x = StandIn(), torch.empty(64)
    k = FastKernel(fn)
    k[(4,)](x, 64, BLOCK=16)
    monkeypatch.setattr(fast_launch, "launch_target", lambda: (1, 9))
    k[(4,)](x, 64, BLOCK=16)  # a kernel loaded for device 0 is not launched on device 1
    assert [e[0] for e in fn.log] == ["triton", "triton"]


@pytest.mark.parametrize("change", ["misaligned", "size_one", "int64", "constexpr", "num_warps", "dtype"])
def test_a_different_specialisation_takes_tritons_path(change):
    fn, x = StandIn(), torch.empty(64)
    k = FastKernel(fn)
    k[(4,)](x, 64, BLOCK=16, num_warps=4)
    args, kwargs = [x, 64], dict(BLOCK=16, num_warps=4)
    if change == "misaligned":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "size_one":
        args[1] = 1
    elif change == "int64":
        args[1] = 2**32
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    elif change == "num_warps":
        kwargs["num_warps"] = 8
    else:
        args[0] = torch.empty(64, dtype=torch.float16)
    k[(4,)](*args, **kwargs)
    assert [e[0] for e in fn.log] == ["triton", "triton"]
    k[(4,)](*args, **kwargs)  # that specialisation is remembered too
    assert [e[0] for e in fn.log] == ["triton", "triton", "fast"]


def test_launch_hooks_take_tritons_path(monkeypatch):
    fn, x = StandIn(), torch.empty(64)
    k = FastKernel(fn)
    k[(4,)](x, 64, BLOCK=16)
    monkeypatch.setattr(fast_launch, "hooks_installed", lambda: True)
    k[(4,)](x, 64, BLOCK=16)
    assert [e[0] for e in fn.log] == ["triton", "triton"]


@pytest.mark.skipif(not hasattr(getattr(fast_launch._RUNTIME, "launch_enter_hook", None), "add"),
                    reason="this triton has no HookChain")
def test_a_hook_added_to_tritons_chain_is_seen():
    chain = fast_launch._RUNTIME.launch_enter_hook
    assert not fast_launch.hooks_installed()
    hook = lambda *a: None  # noqa: E731
    chain.add(hook)
    try:
        assert fast_launch.hooks_installed()
    finally:
        chain.remove(hook)
    assert not fast_launch.hooks_installed()


def test_specialisation_reads_alignment_divisibility_and_width():
    x = torch.empty(8)
    assert specialisation([x, 32, 1, 2**40, 0.5]) == (
        (torch.float32, True), (True, False, True), (False, True, True), (True, False, False), float)
    assert specialisation([x[1:]])[0] == (torch.float32, False)


class TwoPointers(StandIn):
    arg_names = ["in_ptr0", "out_ptr0", "n", "BLOCK"]


@pytest.mark.parametrize("checked", [(0,), (0, 2)])
def test_a_launch_site_rechecks_only_its_checked_positions(checked):
    """A wrapper site's own buffers (here the output, position 1) and literal ints are fixed by
    construction: left out of the per-launch key; a checked input's misalignment still takes Triton's
    path, and so does a checked int's new specialisation."""
    fn, x, out = TwoPointers(), torch.empty(64), torch.empty(64)
    k = FastKernel(fn, checked=checked)
    k[(4,)](x, out, 64, BLOCK=16)
    k[(4,)](x, torch.empty(80)[:64], 64, BLOCK=16)  # another output buffer: the same compiled kernel
    assert [e[0] for e in fn.log] == ["triton", "fast"]
    k[(4,)](x[1:], out, 64, BLOCK=16)  # a misaligned input: Triton decides again
    assert [e[0] for e in fn.log] == ["triton", "fast", "triton"]
    k[(4,)](x, out, 1, BLOCK=16)  # n == 1: a new specialisation only where n is checked
    assert fn.log[-1][0] == ("triton" if 2 in checked else "fast")


def test_a_site_with_nothing_to_check_still_keys_on_constexprs():
    fn, x, out = TwoPointers(), torch.empty(64), torch.empty(64)
    k = FastKernel(fn, checked=())
    k[(4,)](x, out, 64, BLOCK=16)
    k[(4,)](x, out, 64, BLOCK=16)
    k[(4,)](x, out, 64, BLOCK=32)
    assert [e[0] for e in fn.log] == ["triton", "fast", "triton"]
