"""Compile workers (codegen/compile_pool.py, compile_worker.py) warm Triton's cache with the entry the
parent's own compile then looks up. Runs on the CPU: Triton compiles for an H100/H200 target without a
GPU (ptxas ships with it); the parent stands in the workers' offline driver for the GPU's."""
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402

try:  # Triton's binder imports gluon, whose import asserts tl's functions are compiled ones unless the
    import triton.experimental.gluon  # noqa: E402,F401  interpreter is on: import it now, as the suite runs
except ImportError:  # pragma: no cover - older triton                    (TRITON_INTERPRET=1)
    pass
from triton.runtime.driver import driver  # noqa: E402

from fxopt.codegen import compile_pool  # noqa: E402
from fxopt.codegen.compile_worker import use_offline_driver  # noqa: E402
from fxopt.codegen.wrapper_text import KERNELS_END  # noqa: E402

TARGET = ("cuda", 90, 32)
pytestmark = pytest.mark.skipif(not compile_pool.supported(), reason="this Triton lacks preload/jit_cache_hook")

KERNELS = textwrap.dedent('''\
    import triton
    import triton.language as tl


    @triton.jit
    def twice(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


    @triton.jit
    def plus_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)
    ''')


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """A private Triton cache, the real compiler (not the interpreter), and the offline driver."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    saved = driver._active
    use_offline_driver(*TARGET)
    yield tmp_path
    driver._active = saved


def _load(path, name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _compile_in_parent(fn, *args, **kwargs) -> bool:
    """Compile fn in this process; True if Triton found it in its cache."""
    hits = []
    old = knobs.compilation.listener
    knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    try:
        fn.warmup(*args, **kwargs)
    finally:
        knobs.compilation.listener = old
    return hits == [True]


def test_worker_compile_is_the_entry_the_parent_finds(offline):
    path = offline / "kernels.py"
    path.write_text(KERNELS)
    module = _load(path, "fxopt_test_worker_kernels")
    args = (torch.float32, torch.float32, 1000)
    spec = compile_pool.specialization(module.twice, *args, grid=(8,), BLOCK=128, num_warps=4)
    assert json.loads(spec)["name"].endswith("twice")
    assert knobs.runtime.jit_cache_hook is None  # the capture put back the hook it found
    pool = compile_pool.CompilePool(2, TARGET)
    try:
        reply = pool.submit(str(path), module.__name__, "twice", spec).result(timeout=120)
    finally:
        pool.close()
    assert reply["ok"], reply["error"]
    assert _compile_in_parent(module.twice, *args, grid=(8,), BLOCK=128, num_warps=4)
    # the control: a kernel no worker compiled is not a hit, so the check above can fail
    assert not _compile_in_parent(module.plus_one, torch.float32, 1000, grid=(8,), BLOCK=128, num_warps=4)


def test_capture_compiles_nothing_and_leaves_other_kernels_alone(offline):
    path = offline / "kernels.py"
    path.write_text(KERNELS)
    module = _load(path, "fxopt_test_worker_kernels_2")
    assert compile_pool.specialization(module.twice, torch.float16, torch.float16, 64, grid=(1,), BLOCK=64)
    assert not os.path.isdir(offline / "triton") or not any(p.suffix == ".cubin" for p in (offline / "triton").rglob("*"))
    assert not _compile_in_parent(module.twice, torch.float16, torch.float16, 64, grid=(1,), BLOCK=64)


def test_a_failed_worker_compile_is_reported_not_raised(offline):
    path = offline / "kernels.py"
    path.write_text(KERNELS + "\n\n@triton.jit\ndef broken(x_ptr):\n    tl.store(x_ptr, undefined_name)\n")
    module = _load(path, "fxopt_test_worker_kernels_3")
    spec = compile_pool.specialization(module.broken, torch.float32, grid=(1,))
    pool = compile_pool.CompilePool(1, TARGET)
    try:
        reply = pool.submit(str(path), module.__name__, "broken", spec).result(timeout=120)
        assert not reply["ok"] and "undefined_name" in reply["error"]
        again = pool.submit(str(path), module.__name__, "twice", compile_pool.specialization(
            module.twice, torch.float32, torch.float32, 10, grid=(1,), BLOCK=16)).result(timeout=120)
        assert again["ok"], again["error"]  # the worker lives on after a failed kernel
    finally:
        pool.close()


def test_a_dead_worker_fails_its_requests_instead_of_hanging():
    pool = compile_pool.CompilePool(1, TARGET)
    pool._procs[0].kill()
    try:
        reply = pool.submit("/nonexistent.py", "m", "k", "{}").result(timeout=60)
    finally:
        pool.close()
    assert not reply["ok"] and "exited" in reply["error"]


def test_generated_wrapper_kernel_part_loads_without_torch(tmp_path, monkeypatch):
    """The part of a real wrapper the workers load imports Triton alone (torch and fxopt blocked)."""
    import fxopt

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors: the kernels are generated (for the interpreter)
    def f(x, w):
        return torch.nn.functional.gelu(x * w + 1.0)

    rep = fxopt.explain(f, torch.randn(8, 16), torch.randn(16))
    source = rep.graphs[0].wrapper_source
    prefix = source[:source.index(KERNELS_END)]
    assert "@triton.jit" in prefix and "import torch" not in prefix
    (tmp_path / "k.py").write_text(prefix)
    check = ("import sys; sys.modules['torch'] = None; sys.modules['fxopt'] = None\n"
             "import importlib.util as u; s = u.spec_from_file_location('k', sys.argv[1]); m = u.module_from_spec(s)\n"
             "sys.modules['k'] = m; s.loader.exec_module(m)\n"
             "print(sorted(n for n, v in vars(m).items() if type(v).__name__ == 'JITFunction'))")
    out = subprocess.run([sys.executable, "-c", check, str(tmp_path / "k.py")], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(k.name in out.stdout for k in rep.graphs[0].kernels) and rep.graphs[0].kernels


def test_worker_count_from_the_environment(monkeypatch):
    from fxopt.options import Environment

    monkeypatch.setenv("FXOPT_COMPILE_WORKERS", "3")
    assert Environment.read().compile_workers == 3
    monkeypatch.setenv("FXOPT_COMPILE_WORKERS", "some")
    with pytest.raises(ValueError, match="FXOPT_COMPILE_WORKERS"):
        Environment.read()


def test_module_worker_imports_fxopt_kernels_without_the_compiler():
    """A worker for fxopt's own kernels imports them (torch and the kernel modules, not fxopt's
    package __init__) and finds a kernel by module and name: the preload reaches the name check."""
    pool = compile_pool.CompilePool(1, TARGET, module_workers=1)
    try:
        spec = json.dumps({"name": "some_other_kernel"})
        reply = pool.submit("", "fxopt.attention.flash_forward", "_flash_forward_kernel", spec).result(timeout=120)
    finally:
        pool.close()
    assert not reply["ok"]
    assert "some_other_kernel" in reply["error"] and "_flash_forward_kernel" in reply["error"], reply["error"]
    assert pool.ready_after, "the worker never said it was ready"


class _CausalBlock(torch.nn.Module):
    def __init__(self, d=128, heads=2, t=128):
        super().__init__()
        self.qkv, self.proj, self.heads = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads
        self.ln = torch.nn.LayerNorm(d)
        self.register_buffer("tril", torch.tril(torch.ones(t, t)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        s = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        s = s.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
        y = torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


def _train_step_equals_eager(model, x) -> list[tuple[str, bool, str]]:
    """One compiled training step of `model` on `x`, checked against eager (output and x's gradient);
    returns every Triton compile it did as (kernel, cache hit, thread)."""
    import fxopt

    compiles = []
    old = knobs.compilation.listener
    knobs.compilation.listener = lambda **kw: compiles.append(
        (kw["src"].name, kw["cache_hit"], threading.current_thread().name))
    try:
        out = torch.compile(model, backend=fxopt.backend())(x)
        out.float().square().mean().backward()
        torch.cuda.synchronize()
    finally:
        knobs.compilation.listener = old
    grad = x.grad.clone()
    x.grad = None
    ref = model(x)
    ref.float().square().mean().backward()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grad, x.grad, atol=2e-2, rtol=2e-2)
    return compiles


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_first_call_finds_the_workers_compiles(tmp_path, monkeypatch):
    """Training step of a block with attention: every kernel the first call compiles in this process
    (wrapper kernels and the attention kernels' first launches) is a hit in the cache the workers
    filled, and the result equals eager."""
    compile_pool._shutdown()
    compile_pool._POOLS.clear()  # workers read the cache folder from the environment they start with
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path / "fxopt"))
    monkeypatch.setenv("FXOPT_COMPILE_WORKERS", "4")
    torch._dynamo.reset()
    model = _CausalBlock().cuda().half()
    x = torch.randn(2, 128, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    compiles = _train_step_equals_eager(model, x)
    misses = [name for name, hit, _ in compiles if not hit]
    assert any("flash" in name or "dkdv" in name for name, _, _ in compiles), compiles
    assert not misses, f"compiled in this process, not found in the workers' cache: {misses}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_first_call_compiles_nothing_on_its_own_thread(tmp_path, monkeypatch):
    """Without workers, every kernel of a training step (the wrapper kernels and the attention kernels
    its first launches ask for, codegen/own_op_compiles.py) compiles on the precompile pool's threads
    while the graph compiles, none at a launch on the calling thread; the attention backward's kernels
    compile ahead, while the forward graph compiles, once; the result equals eager."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path / "fxopt"))
    monkeypatch.setenv("FXOPT_COMPILE_WORKERS", "0")
    torch._dynamo.reset()
    # another head size than the test above: a JITFunction keeps what it compiled for the process
    model = _CausalBlock(d=256).cuda().half()
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.float16, requires_grad=True)
    compiles = _train_step_equals_eager(model, x)
    assert any("flash_forward" in name for name, _, _ in compiles) and any("dkdv" in name for name, _, _ in compiles)
    pools = ("ThreadPoolExecutor", "fxopt-backward-ahead")
    at_launch = [name for name, _, thread in compiles if not thread.startswith(pools)]
    assert not at_launch, f"compiled at a launch, not before the first call: {at_launch} ({compiles})"
    backward = [(name, thread) for name, _, thread in compiles if "dkdv" in name or "_dq" in name]
    assert backward and all(thread.startswith("fxopt-backward-ahead") for _, thread in backward), compiles
    assert len({name for name, _ in backward}) == len(backward), f"compiled twice: {compiles}"


def test_compile_keys_are_computed_ahead_of_the_first_compile(offline):
    """precompile._compute_keys fills Triton's per-process key (found under this Triton's module
    name), so the precompile pool's threads do not each hash Triton's library at once."""
    from triton.runtime import cache as triton_cache

    from fxopt.codegen import precompile

    key = getattr(triton_cache, "triton_key", None)
    if key is None:
        pytest.skip("this Triton keeps triton_key elsewhere")
    key.cache_clear()
    precompile._compute_keys(TARGET)
    assert key.cache_info().currsize == 1
    precompile.warm_compile_keys([torch.randn(2)])  # CPU inputs: nothing to warm, no thread
    assert not any(t.name == "fxopt-compile-keys" for t in threading.enumerate())


def test_cache_hit_cost_script_runs_both_ways(capsys, monkeypatch):
    """benchmarks/cache_hit_cost.py (the measurement behind warm_compile_keys) runs on this machine and
    reports both modes; its numbers are for the results files, not asserted here."""
    from benchmarks import cache_hit_cost

    monkeypatch.setattr(sys, "argv", ["cache_hit_cost", "--kernels", "2", "--repeat", "1"])
    cache_hit_cost.main()
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if "|" in line][1:]
    assert [r[0].strip() for r in rows] == ["at-first-compile", "ahead"]
    assert float(rows[0][1]) == 0.0 and float(rows[1][1]) > 0.0  # keys computed ahead only in the second


def test_stand_ins_refuse_a_node_too_large_to_borrow_memory_for(monkeypatch):
    """A node whose inputs and outputs need more than STAND_IN_LIMIT (or a quarter of free memory) gets
    no stand-ins: nothing is allocated, its kernels compile at its first launch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxopt.codegen import own_op_compiles

    with FakeTensorMode():  # CUDA-device metadata without a GPU, as a traced graph holds it
        logits = torch.empty(16384, 32768, device="cuda", dtype=torch.bfloat16)  # 1 GiB
        small = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)
    class Allocated(Exception):
        pass

    def empty(*args, **kwargs):
        raise Allocated()

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 << 30, 80 << 30))
    monkeypatch.setattr(torch, "empty", empty)
    assert own_op_compiles._stand_ins("logits", ((logits,), {}), logits) is None  # 2 GiB with its output
    # 32 KiB with its output: refused with 64 KiB free (a quarter is 16 KiB), allocated with 64 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 << 10, 80 << 30))
    assert own_op_compiles._stand_ins("small", ((small,), {}), small) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 << 30, 80 << 30))
    with pytest.raises(Allocated):
        own_op_compiles._stand_ins("small", ((small,), {}), small)


def test_stand_in_views_keep_the_values_misalignment():
    """A stand-in starts as far past a 16-byte boundary as the value it stands in for (assuming the
    value's storage is aligned, as the caching allocator's are): TMA or not is decided from that."""
    from fxopt.codegen.own_op_compiles import _extent_bytes, _view

    base = torch.empty(4096, dtype=torch.float16)
    for offset in (0, 3, 8, 13):
        like = base[offset:offset + 512].view(8, 64)
        buffer = torch.empty(_extent_bytes(like) + 16, dtype=torch.uint8)
        view = _view(buffer, like)
        assert view.shape == like.shape and view.stride() == like.stride()
        assert (view.data_ptr() - buffer.data_ptr()) % 16 == (like.data_ptr() - base.data_ptr()) % 16
        assert view.data_ptr() + _extent_bytes(view) <= buffer.data_ptr() + buffer.numel()



def test_compile_stages_records_triton_stage_times(offline):
    """benchmarks/compile_stages.py (first_call_profile --timeline) reads Triton's own per-stage times of
    a real compile (here for the offline sm_90 target): the Python front end and ptxas, each timed."""
    from benchmarks import compile_stages

    path = offline / "kernels.py"
    path.write_text(KERNELS)
    module = _load(path, "fxopt_test_stage_kernels")
    records, old = [], knobs.compilation.listener
    try:
        assert compile_stages.install(records)
        module.plus_one.warmup(torch.float32, 1000, grid=(8,), BLOCK=128, num_warps=4)
    finally:
        knobs.compilation.listener = old
    [(name, hit, thread, stages)] = records
    assert name == "plus_one" and not hit and thread == threading.current_thread().name
    assert stages[compile_stages.FRONT_END] > 0 and stages["cubin"] > 0, stages
    text = compile_stages.table(records)
    assert "plus_one" in text and "total ms" in text and "cubin" in text
    assert compile_stages.table([]) == ""
