"""A compile worker: a process that compiles Triton kernels into Triton's on-disk cache, nothing else.

Triton's front end (Python AST -> TTIR) holds the GIL, so threads compile one kernel at a time;
processes compile them at once. This file runs as a script (`python compile_worker.py`), not as part
of the fxopt package: importing fxopt imports torch (seconds), while this imports only Triton
(a third of a second), so a worker is ready before the first graph's kernels are generated.

Protocol: one JSON object per line on stdin, one reply per line on stdout.
  request  {"id": int, "path": str, "module": str, "name": str, "spec": str,
            "target": [backend, arch, warp_size]}       (path "": import `module`)
  reply    {"id": int, "ok": bool, "error": str, "seconds": float}
`path` is a module holding the kernel at the line where the parent's module holds it, loaded under
the parent module's name (Triton's cache key includes the function's source, first line and module), `spec` is the specialisation Triton's
`jit_cache_hook` gave the parent (`JITFunction.preload` replays it), so the worker's compile writes the
cache entry the parent's own compile then finds. Nothing the worker does decides a result: a parent
whose key differs, or a worker that fails, just compiles the kernel itself.
The worker never touches the GPU: it stands in a driver that names the parent's target and device 0.
"""
import importlib.util
import json
import os
import sys
import threading
import time

if __name__ == "__main__":  # this folder on sys.path would let fxopt's modules shadow installed ones
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]


class OfflineDriver:
    """The part of Triton's driver that compiling asks for: the target, a device index and a stream."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def __getattr__(self, name):  # anything that needs the GPU itself: say so, instead of guessing
        raise AttributeError(f"compile worker: Triton asked the driver for '{name}', which needs the GPU")


def use_offline_driver(backend: str, arch, warp_size: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    offline = OfflineDriver(GPUTarget(backend, arch, warp_size))
    if hasattr(driver, "set_active"):
        driver.set_active(offline)
    else:  # pragma: no cover - older triton
        driver._active = offline


_MODULES: dict[tuple[str, str], object] = {}


def load_kernel(path: str, module_name: str, name: str):
    """The JITFunction `name` of the module file `path`, loaded once per worker under the parent's
    module name (Triton's key and the specialisation name the function by module and name); with no
    path, of the importable module `module_name` (fxopt's attention kernels)."""
    if not path:
        return getattr(importlib.import_module(module_name), name)
    module = _MODULES.get((path, module_name))
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # triton.jit looks the function's module up here
        spec.loader.exec_module(module)
        _MODULES[(path, module_name)] = module
    return getattr(module, name)


def import_fxopt_kernels(root: str, modules: list[str]) -> None:
    """Import fxopt's kernel modules (`modules`) without fxopt's package __init__, which imports the
    whole compiler (dynamo, aot_autograd: seconds); the kernel modules need torch and a few of
    fxopt's small ones. `root` is the folder holding the parent's fxopt package."""
    import types

    package = types.ModuleType("fxopt")
    package.__path__ = [os.path.join(root, "fxopt")]
    sys.modules.setdefault("fxopt", package)
    for name in modules:
        importlib.import_module(name)


def per_signature_launchers():
    """Triton's CUDA driver module where it builds a C launcher per kernel signature (a C file through
    the host compiler, 0.3 s cold: triton 3.6 does, 3.9 has one generic launcher), else None."""
    try:
        from triton.backends.nvidia import driver as nvidia_driver
    except ImportError:
        return None
    return nvidia_driver if hasattr(nvidia_driver, "make_launcher") else None


def warm_launcher(kernel) -> None:
    """Build Triton's launcher for the kernel too where this Triton builds one per signature, into the
    same cache."""
    try:
        nvidia_driver = per_signature_launchers()
        if kernel is not None and nvidia_driver is not None:
            nvidia_driver.CudaLauncher(kernel.src, kernel.metadata)
    except Exception:  # the parent builds it at the first launch, as without workers
        pass


def predicted_launcher_source(spec: str) -> str | None:
    """The C source of the launcher this Triton will build for the kernel `spec` specialises, known
    before the compile ends where that source is a function of the specialisation alone: on triton 3.6
    (one launcher per signature, `make_launcher`) for a kernel taking TMA descriptors on a Hopper-class
    target, where the source depends on the signature and on which descriptors the compile lowered to
    TMA, which there is all of them. None elsewhere (3.9 has one generic launcher; torch's C launcher
    takes descriptor-free kernels). A wrong guess costs a wasted build: Triton's own, keyed by its
    source, builds what it needs."""
    try:
        from triton.runtime.driver import driver

        nvidia_driver = per_signature_launchers()
        target = driver.active.get_current_target()
        if nvidia_driver is None or target.backend != "cuda" or target.arch < 90:
            return None
        signature = {name: _tuples(ty) for name, ty in json.loads(spec)["signature"].items()}
        descriptors = sum(isinstance(ty, str) and ty.startswith("tensordesc") for ty in signature.values())
        if not descriptors:
            return None
        return nvidia_driver.make_launcher({}, signature, [{}] * descriptors)  # {}: "lowered to TMA"; only that is read
    except Exception:  # another Triton's internals: no build ahead
        return None


def _tuples(ty):
    """A signature entry as Triton holds it (JSON made its tuples lists)."""
    return tuple(_tuples(t) for t in ty) if isinstance(ty, list) else ty


def build_launcher(source: str) -> None:
    """Build the launcher from `source` into Triton's cache, as CudaLauncher would (same key: the source
    and the platform), so Triton's own build for the compiled kernel finds it there."""
    try:
        nvidia_driver = per_signature_launchers()
        nvidia_driver.compile_module_from_src(src=source, name="__triton_launcher",
                                              library_dirs=nvidia_driver.library_dirs(),
                                              include_dirs=nvidia_driver.include_dirs,
                                              libraries=nvidia_driver.libraries)
    except Exception:  # Triton's own build after the compile says what is wrong, if anything
        pass


def preload(fn, spec: str):
    """`fn.preload(spec)`, with the kernel's launcher built beside the compile where its source is
    known ahead (predicted_launcher_source): a GPT-2 block's attention kernel compiled in 0.94 s and
    then built its launcher in 0.31 s more on the first call's critical path
    (benchmarks/results/2026-12-04-h200-f.md)."""
    source = predicted_launcher_source(spec)
    ahead = threading.Thread(target=build_launcher, args=(source,), name="fxopt-launcher-ahead",
                             daemon=True) if source else None
    if ahead is not None:
        ahead.start()
    kernel = fn.preload(spec)
    if ahead is not None:
        ahead.join(timeout=60)  # Triton's build for the kernel then finds this one's in its cache
    return kernel


def compile_one(request: dict) -> dict:
    start = time.perf_counter()
    try:
        use_offline_driver(*request["target"])
        warm_launcher(preload(load_kernel(request["path"], request["module"], request["name"]), request["spec"]))
        return {"id": request["id"], "ok": True, "error": "", "seconds": time.perf_counter() - start}
    except Exception as exc:  # reported, not raised: the parent compiles this kernel itself
        return {"id": request["id"], "ok": False, "error": f"{type(exc).__name__}: {exc}",
                "seconds": time.perf_counter() - start}


def warm_up(target) -> None:
    """What every compile needs first, done while the parent is still tracing: Triton's compiler
    modules, `ptxas --version` (a second on a cold disk), and one real compile of a tiny kernel into a
    throwaway cache (the first compile in a process sets up LLVM's and ptxas's state: without this the
    worker's first kernel took twice as long as the parent's, benchmarks/results/2026-12-04-h200.md)."""
    import tempfile

    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        make_backend(GPUTarget(*target)).hash()
        use_offline_driver(*target)
        saved = os.environ.get("TRITON_CACHE_DIR")
        with tempfile.TemporaryDirectory() as scratch:
            os.environ["TRITON_CACHE_DIR"] = scratch
            try:
                source = triton.compiler.ASTSource(_define_tiny(), {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                                                   constexprs={"BLOCK": 128})
                triton.compile(source, target=GPUTarget(*target))
            finally:
                if saved is None:
                    del os.environ["TRITON_CACHE_DIR"]
                else:
                    os.environ["TRITON_CACHE_DIR"] = saved
    except Exception:  # the first real compile will say what is wrong
        pass


def _define_tiny():
    import triton
    import triton.language as tl

    @triton.jit
    def _tiny(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.exp(tl.load(x_ptr + i, mask=i < n)), mask=i < n)

    return _tiny


def main() -> None:
    """argv: the target as JSON; then, for a worker that compiles fxopt's attention kernels, the folder
    holding fxopt and the kernel modules to import before it says it is ready."""
    os.environ["TRITON_INTERPRET"] = "0"
    __import__("triton")  # before the first request: this is most of a worker's start-up

    out = sys.stdout
    sys.stdout = sys.stderr  # anything a compile prints must not corrupt the reply stream
    target = json.loads(sys.argv[1])
    warm_up(target)
    if len(sys.argv) > 3:
        import_fxopt_kernels(sys.argv[2], sys.argv[3].split(","))
    print(json.dumps({"id": -1, "ok": True, "error": "", "seconds": 0.0}), file=out, flush=True)  # ready
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(compile_one(json.loads(line))), file=out, flush=True)


if __name__ == "__main__":
    main()
