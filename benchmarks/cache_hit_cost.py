"""What a Triton cache hit costs a fresh process's precompile pool, with and without Triton's
per-process keys computed ahead (fxopt.codegen.precompile.warm_compile_keys).

    PYTHONPATH=. python -m benchmarks.cache_hit_cost [--kernels 4] [--repeat 2]

Each measurement is a fresh process loading the same kernels from a warmed Triton cache on a thread
pool, as `precompile` does. Without a GPU it compiles for an offline sm_90 target (ptxas ships with
Triton), so it runs on the CPU machine too.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

KERNEL = textwrap.dedent('''\
    import triton
    import triton.language as tl


    @triton.jit
    def scaled_tanh(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n).to(tl.float32)
        tl.store(y_ptr + i, (x * 0.5 + x * x).to(tl.bfloat16), mask=i < n)
    ''')

CHILD = textwrap.dedent('''\
    import importlib.util, sys, time
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from fxopt.codegen import compile_pool, precompile
    from fxopt.codegen.compile_worker import use_offline_driver
    if not torch.cuda.is_available():
        use_offline_driver("cuda", 90, 32)
    spec = importlib.util.spec_from_file_location("kmod", sys.argv[1])
    m = importlib.util.module_from_spec(spec); sys.modules["kmod"] = m; spec.loader.exec_module(m)
    keys = 0.0
    if sys.argv[2] == "ahead":
        t = time.perf_counter(); precompile._compute_keys(compile_pool.current_target()); keys = time.perf_counter() - t
    blocks = [64 << i for i in range(int(sys.argv[3]))]
    t = time.perf_counter()
    with ThreadPoolExecutor(len(blocks)) as pool:
        list(pool.map(lambda b: m.scaled_tanh.warmup(torch.bfloat16, torch.bfloat16, 4096, grid=(4,), BLOCK=b), blocks))
    print(f"{keys:.3f} {time.perf_counter() - t:.3f}")
    ''')


def child(path: str, mode: str, kernels: int, env: dict) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, path, mode, str(kernels)], env=env, capture_output=True,
                         text=True, check=True)
    keys, loads = out.stdout.split()[-2:]
    return float(keys), float(loads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=int, default=4)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernels.py")
        with open(path, "w") as f:
            f.write(KERNEL)
        env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(tmp, "triton"), "TRITON_INTERPRET": "0",
               "TRITON_DEFAULT_FP_FUSION": os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"),
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        child(path, "first", args.kernels, env)  # fills the cache
        print(f"{args.kernels} cache hits on a {args.kernels}-thread pool, fresh process each")
        print("keys computed | keys s | loads s")
        for _ in range(args.repeat):
            for mode in ("at-first-compile", "ahead"):
                keys, loads = child(path, mode, args.kernels, env)
                print(f"{mode:>13} | {keys:6.3f} | {loads:7.3f}")


if __name__ == "__main__":
    main()
