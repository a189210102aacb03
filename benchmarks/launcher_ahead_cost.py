"""What building a TMA kernel's launcher beside its compile saves (codegen/compile_worker.preload): the
GPT-2 block's attention forward kernel compiled cold, then Triton's launcher built for it, one after the
other (Triton's way) or with the launcher's build started when the compile starts. Each mode runs in a
fresh process with an empty Triton cache, twice, alternating.

    PYTHONPATH=. python -m benchmarks.launcher_ahead_cost [--rounds 2]

Only Tritons that build a launcher per signature (3.6) have anything to save; elsewhere it says so.
On a machine without a GPU the kernel compiles for an H100/H200 target offline and the launcher links
against an empty stand-in libcuda (built here) and loads with lazy binding (nothing in it is called);
on the GPU host everything is real.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

ONE_MODE = textwrap.dedent("""\
    import json, os, sys, time
    import torch
    from triton.backends.nvidia import driver as nvidia_driver
    from fxopt.codegen import compile_pool, compile_worker
    from fxopt.attention.flash_forward_tma import _flash_forward_tma_kernel as kernel_fn, descriptor

    if not torch.cuda.is_available():
        compile_worker.use_offline_driver("cuda", 90, 32)
        sys.setdlopenflags(os.RTLD_LAZY)  # the stand-in libcuda defines no cu* function: load unbound
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.empty(16, 16, 1024, 64, dtype=torch.bfloat16, device=device)
    rows = torch.empty(16, 16, 1024, device=device)
    m, n = descriptor(t, 128), descriptor(t, 64)
    spec = compile_pool.specialization(kernel_fn, m, n, n, m, rows, 16, 1, 1024, 1024, 0.18, HEAD_DIM=64,
                                       BLOCK_M=128, BLOCK_N=64, CAUSAL=True, EVEN_M=True, EVEN_N=True,
                                       STORE_LSE=False, num_warps=8, num_stages=2, grid=(8, 256))
    start = time.perf_counter()
    kernel = compile_worker.preload(kernel_fn, spec) if sys.argv[1] == "ahead" else kernel_fn.preload(spec)
    compiled = time.perf_counter()
    nvidia_driver.CudaLauncher(kernel.src, kernel.metadata)
    end = time.perf_counter()
    print(json.dumps({"compile": compiled - start, "launcher": end - compiled, "total": end - start}))
""")


def stand_in_libcuda(folder: str) -> str:
    """An empty libcuda.so(.1): enough for the launcher's link step on a machine without the driver."""
    src = os.path.join(folder, "empty.c")
    with open(src, "w") as f:
        f.write("int fxopt_stand_in;\n")
    lib = os.path.join(folder, "libcuda.so.1")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, src], check=True)
    os.symlink(lib, os.path.join(folder, "libcuda.so"))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from fxopt.codegen.compile_worker import per_signature_launchers

    if per_signature_launchers() is None:
        print("this Triton builds one generic launcher, not one per signature: nothing to build ahead")
        return
    import torch

    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.getcwd()}
        if not torch.cuda.is_available():
            env["TRITON_LIBCUDA_PATH"] = stand_in_libcuda(scratch)
        print("mode | kernel compile s | launcher after it s | total s")
        for r in range(args.rounds):
            for mode in ("after", "ahead"):
                env["TRITON_CACHE_DIR"] = os.path.join(scratch, f"cache-{mode}-{r}")
                done = subprocess.run([sys.executable, "-c", ONE_MODE, mode], env=env, capture_output=True,
                                      text=True, timeout=600)
                if done.returncode:
                    sys.exit(done.stderr[-3000:])
                t = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"{mode} | {t['compile']:.3f} | {t['launcher']:.3f} | {t['total']:.3f}")


if __name__ == "__main__":
    main()
