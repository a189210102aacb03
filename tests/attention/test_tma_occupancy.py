"""The masked TMA forward keeps the causal kernel's occupancy: two programs per SM on an H100/H200.

Pipelining [64, 64] mask tiles beside three stages of K and V took 131,128 bytes of shared memory for
hd128, one program per SM, and HF Llama's masked forward ran 1.6x slower than causal over the same tiles
(benchmarks/results/2026-12-08-h100.md). The loops that read the mask pipeline MASK_TILE_STAGES instead.
Compiled for sm_90 by Triton's own compiler on this machine (no GPU; codegen/offline_compile.py); the
shared memory is read from the compiled kernels' metadata.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

# An sm_90 SM has 228 KB (233,472 bytes) of shared memory and reserves 1 KB per resident block.
TWO_PER_SM = 233_472 // 2 - 1024

COMPILE = textwrap.dedent("""\
    import sys
    import torch
    from fxopt.attention.flash_common import forward_config
    from fxopt.attention.flash_forward import flash_forward
    from fxopt.codegen.offline_compile import compiling_launches

    T, D, dtype = 1024, 128, torch.bfloat16
    q, k, v = (torch.randn(1, 2, T, D, dtype=dtype) for _ in range(3))
    masked = sys.argv[1] == "masked"
    keep = torch.ones(T, T, dtype=torch.bool).tril()  # HF Llama's 4-D additive mask, no padding
    mask = torch.zeros(1, 1, T, T, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min).expand(1, 2, T, T)
    with compiling_launches("cuda:90"):
        cfg = forward_config(D, not masked, dtype, T, T, "cuda", has_mask=masked)
        assert cfg["TMA"], cfg
        flash_forward(q, k, v, scale=D ** -0.5, causal=not masked, mask=mask if masked else None, config=cfg)
""")


def forward_shared_bytes(kind: str, cache) -> int:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", COMPILE, kind], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    found = [json.loads(p.read_text())["shared"] for p in cache.rglob("_flash_forward_tma_kernel.json")]
    assert len(found) == 1, found
    return found[0]


def test_masked_tma_forward_fits_two_programs_per_sm_as_causal_does(tmp_path):
    causal = forward_shared_bytes("causal", tmp_path / "causal")
    masked = forward_shared_bytes("masked", tmp_path / "masked")
    assert causal <= TWO_PER_SM, causal
    assert masked <= TWO_PER_SM, (masked, causal)
