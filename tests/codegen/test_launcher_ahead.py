"""A TMA kernel's launcher is built beside its compile (compile_worker.preload), from the source Triton
will ask for once the compile ends. On triton 3.6 that source is compared with the one Triton's own
CudaLauncher builds for the compiled kernel (compiled offline for an H100/H200 target: no GPU needed);
on Tritons with one generic launcher nothing is built ahead. The rules (which kernels, which targets,
that the build runs during the compile) are checked on any Triton with a stand-in `make_launcher`."""
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

triton = pytest.importorskip("triton")
from triton.backends.nvidia import driver as nvidia_driver  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from fxopt.codegen import compile_worker  # noqa: E402

PER_SIGNATURE = compile_worker.per_signature_launchers() is not None  # triton 3.6; 3.9: one generic launcher
DESCRIPTOR_SPEC = json.dumps({"signature": {"q": "tensordesc<bf16[1, 1, 128, 64]>", "lse": "*fp32",
                                            "pair": ["i32", "i32"], "BLOCK": "constexpr"}})
POINTER_SPEC = json.dumps({"signature": {"x": "*fp32", "n": "i32"}})


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    saved = driver._active

    def use(arch):
        compile_worker.use_offline_driver("cuda", arch, 32)

    use(90)
    yield use
    driver._active = saved


@pytest.fixture
def recorded(monkeypatch):
    """Stand-ins for Triton's launcher source and host build: what each was asked for."""
    calls = {"make": [], "build": []}

    def make_launcher(constants, signature, tensordesc_meta):
        calls["make"].append((dict(signature), tensordesc_meta))
        return "source for " + ",".join(map(str, signature.values()))

    monkeypatch.setattr(nvidia_driver, "make_launcher", make_launcher, raising=False)
    monkeypatch.setattr(nvidia_driver, "compile_module_from_src",
                        lambda src, **kw: calls["build"].append(src), raising=False)
    monkeypatch.setattr(nvidia_driver, "library_dirs", lambda: [], raising=False)
    return calls


def test_descriptor_kernel_on_hopper_gets_a_source_with_every_descriptor_lowered(offline, recorded):
    source = compile_worker.predicted_launcher_source(DESCRIPTOR_SPEC)
    assert source == "source for tensordesc<bf16[1, 1, 128, 64]>,*fp32,('i32', 'i32'),constexpr"
    (signature, meta), = recorded["make"]
    assert signature["pair"] == ("i32", "i32")  # JSON's list back to the tuple Triton holds
    assert meta == [{}]  # one entry per descriptor, none of them None: "lowered to TMA"


def test_no_source_ahead_without_descriptors_or_before_hopper(offline, recorded):
    assert compile_worker.predicted_launcher_source(POINTER_SPEC) is None  # torch's C launcher takes it
    offline(80)
    assert compile_worker.predicted_launcher_source(DESCRIPTOR_SPEC) is None
    assert compile_worker.predicted_launcher_source("not json") is None


def test_no_source_ahead_where_triton_has_one_generic_launcher(offline, monkeypatch):
    monkeypatch.delattr(nvidia_driver, "make_launcher", raising=False)
    assert compile_worker.predicted_launcher_source(DESCRIPTOR_SPEC) is None


def test_the_launcher_builds_while_the_kernel_compiles(offline, recorded, monkeypatch):
    built = threading.Event()
    monkeypatch.setattr(nvidia_driver, "compile_module_from_src",
                        lambda src, **kw: (recorded["build"].append(src), built.set()))

    class Kernel:  # a compile that only ends once the launcher's build has run beside it
        def preload(self, spec):
            return built.wait(timeout=30)

    assert compile_worker.preload(Kernel(), DESCRIPTOR_SPEC) is True
    assert recorded["build"] == ["source for tensordesc<bf16[1, 1, 128, 64]>,*fp32,('i32', 'i32'),constexpr"]
    built.clear()
    assert compile_worker.preload(Kernel(), POINTER_SPEC) is False  # nothing built ahead: it waited out
    assert len(recorded["build"]) == 1


# Run in a fresh process: the suite's modules were imported with the interpreter on, which makes
# the attention kernel's helper functions interpreted ones that the real compiler cannot call.
COMPARE = textwrap.dedent("""\
    import json, sys
    import torch
    from triton.backends.nvidia import driver as nvidia_driver
    from fxopt.codegen import compile_pool, compile_worker
    from fxopt.attention.flash_forward_tma import _flash_forward_tma_kernel, descriptor
    from fxopt.attention.flash_backward_tma import _dkdv_tma_kernel, _dq_tma_kernel

    compile_worker.use_offline_driver("cuda", 90, 32)
    built = []
    nvidia_driver.compile_module_from_src = lambda src, **kw: built.append(src)
    nvidia_driver.library_dirs = lambda: []  # this machine may have no libcuda
    t = torch.empty(2, 4, 256, 64, dtype=torch.bfloat16)
    rows = torch.empty(2, 4, 256)
    m, n = descriptor(t, 128), descriptor(t, 64)
    common = dict(HEAD_DIM=64, BLOCK_M=128, BLOCK_N=64, CAUSAL=True, num_warps=8, num_stages=2)
    kernels = {
        "forward": (_flash_forward_tma_kernel, (m, n, n, m, rows, 4, 1, 256, 256, 0.18),
                    dict(EVEN_M=True, EVEN_N=True, STORE_LSE=True, grid=(2, 8))),
        "dkdv": (_dkdv_tma_kernel, (m, n, n, m, n, n, rows, rows, 4, 1, 256, 256, 0.125, 0.18),
                 dict(EVEN_M=True, grid=(4, 8))),
        "dq": (_dq_tma_kernel, (m, n, n, m, m, rows, rows, 4, 1, 256, 256, 0.125, 0.18),
               dict(EVEN_N=True, grid=(2, 8))),
    }
    found = {}
    for name, (fn, args, kwargs) in kernels.items():
        spec = compile_pool.specialization(fn, *args, **common, **kwargs)
        del built[:]
        kernel = compile_worker.preload(fn, spec)
        ahead = list(built)
        try:
            nvidia_driver.CudaLauncher(kernel.src, kernel.metadata)
        except Exception:  # past the build (no libcuda here): only the sources are compared
            pass
        found[name] = {"ahead": ahead, "triton": built[len(ahead):],
                       "lowered": bool(kernel.metadata.tensordesc_meta)}
    json.dump(found, sys.stdout)
""")


@pytest.mark.skipif(not PER_SIGNATURE, reason="this Triton builds no launcher per signature")
def test_the_source_built_ahead_is_the_one_triton_builds_for_each_attention_kernel(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run([sys.executable, "-c", COMPARE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, found in json.loads(done.stdout).items():
        assert found["lowered"] and len(found["ahead"]) == 1, name  # built ahead; lowered to TMA
        assert found["triton"] == found["ahead"], name  # what Triton builds after the compile: the same
