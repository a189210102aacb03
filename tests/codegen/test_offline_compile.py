"""Generated kernels compile for the GPU on a machine without one (codegen/offline_compile.py).

The suite checks every generated kernel's numbers in Triton's interpreter, which accepts code the GPU
compiler refuses, and generates the interpreter's variant of each kernel ("interpret": no libdevice, no
inline PTX). Here the same fused groups are generated for "cuda" as well, for programs that reach each
code path (libdevice and approximate math, integer ops, every reduction schedule, norm backwards with
column sums, combined casts), written as the kernel files explain writes, and compiled for an H100/H200
target with `--compile-for cuda:90`: Triton's real compiler and ptxas, no GPU. Numbers are not checked
here (the interpreter and GPU tests do that).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import fxopt
import fxopt.compile as fxopt_compile
from tests.cuda_variants import install
from fxopt.codegen.offline_compile import compile_files

triton = pytest.importorskip("triton")



def pointwise_float(x, y):
    return (torch.tanh(x) * torch.sigmoid(y) + torch.erf(x) - torch.log1p(y.abs()) + torch.fmod(x, 0.7)
            + torch.atan2(x, y) + F.gelu(y) + F.gelu(x, approximate="tanh") + torch.rsqrt(y.abs() + 1)
            + torch.pow(x.abs(), 1.7) + torch.round(x * 3) + torch.where(x > y, x.exp2(), y.expm1()))


def pointwise_int(i, j):
    return (i // j, i % j, i >> 1, i << 2, i & j, i | 3, ~i, i.abs(), torch.clamp(i, -3, 5), i.to(torch.float32) / j,
            torch.maximum(i, j), torch.sign(i))


def reductions(x):
    return (torch.softmax(x, -1), x.sum(0), x.amax(-1), x.argmax(-1), torch.var_mean(x, -1), x.logsumexp(-1),
            F.layer_norm(x, x.shape[-1:]), F.rms_norm(x, x.shape[-1:]))


def long_rows(x):
    return torch.softmax(x, -1), x.sum()


PROGRAMS = [  # (name, fn, inputs, explain options)
    ("float32 pointwise", pointwise_float, lambda: (torch.randn(8, 33), torch.randn(8, 33)), {}),
    ("bf16 pointwise", pointwise_float,
     lambda: (torch.randn(8, 33).bfloat16(), torch.randn(8, 33).bfloat16()), {}),
    ("int32 pointwise", pointwise_int,
     lambda: (torch.randint(-50, 50, (8, 33), dtype=torch.int32), torch.randint(1, 9, (8, 33), dtype=torch.int32)), {}),
    ("uint8 pointwise", lambda a, b: (~(a ^ b), a & b, a | 3, torch.logical_not(a)),
     lambda: (torch.randint(0, 255, (37,), dtype=torch.uint8), torch.randint(0, 255, (37,), dtype=torch.uint8)), {}),
    ("row and column reductions", reductions, lambda: (torch.randn(16, 96),), {}),
    ("long rows, one big sum", long_rows, lambda: (torch.randn(2, 40000),), {}),
    ("float64 long rows", long_rows, lambda: (torch.randn(2, 40000, dtype=torch.float64),), {}),
    ("norm backwards (column sums)",
     lambda x, w, b: (F.layer_norm(x, x.shape[-1:], w, b).square().sum(), F.rms_norm(x, x.shape[-1:], w).sum()),
     lambda: (torch.randn(64, 128, requires_grad=True), torch.randn(128, requires_grad=True),
              torch.randn(128, requires_grad=True)), {}),
    ("fp16 comparisons with rounded scalars, clamp with NaN and tensor bounds, integer max",
     lambda h, t, b, i: ((h * 1) == 0.1, (h * 1) >= t, torch.where(h > 0.15, h * 1, 0.1),
                         (h * 1).clamp(min=float("nan")), torch.clamp(h.float() * 2, min=b, max=b + 1),
                         (i + 1).amax(-1) * 1),
     lambda: (torch.randn(8, 33).half(), torch.tensor(0.1), torch.randn(8, 33),
              torch.randint(-50, 50, (8, 33), dtype=torch.int32)), {}),
    ("norm backward over a width of 1",
     lambda x, w, b: F.layer_norm(x, (1,), w, b).square().sum(),
     lambda: (torch.randn(6, 1, requires_grad=True), torch.randn(1, requires_grad=True),
              torch.randn(1, requires_grad=True)), {}),
    ("two-step casts, cat pieces of one element, comparisons of rounded 16-bit values",
     lambda x, i, a, h: ((x * 1).to(torch.uint8), (i * 3).to(torch.bfloat16),
                         torch.cat([a.expand(4, 3), x[:4, :2]], 1) * 2, torch.where(h.exp() > 1.5, h, 0),
                         torch.remainder(h * 1, 0.1)),
     lambda: (torch.randn(8, 33), torch.randint(-50, 50, (8, 33), dtype=torch.int32), torch.tensor(2.0),
              torch.randn(8, 33).half()), {}),
    ("bf16 casts and matmuls", lambda x, w: F.silu(x @ w).softmax(-1),
     lambda: (torch.randn(16, 32), torch.randn(32, 32)), {"precision": "bf16"}),
]


@pytest.fixture(scope="module")
def cuda_kernel_files(tmp_path_factory):
    """Each program's fused groups generated for "cuda" beside the interpreter's, as kernel files."""
    folder = tmp_path_factory.mktemp("cuda_kernels")
    made = []
    patch = pytest.MonkeyPatch()
    install(made.append, patch.setattr)
    try:
        for _, fn, inputs, options in PROGRAMS:
            fxopt.explain(fn, *inputs(), **options)
    finally:
        patch.undo()
    paths = []
    for i, k in enumerate(made):
        path = folder / f"{i:02d}_{k.name}.py"
        path.write_text(fxopt_compile.standalone_source(k))
        paths.append(str(path))
    return folder, paths, made


def test_cuda_variants_of_every_generated_kernel_compile_for_an_h200(cuda_kernel_files, tmp_path, monkeypatch):
    folder, paths, kernels = cuda_kernel_files
    ops = {op.split(".")[1] for k in kernels for op in k.ops}
    assert {"tanh", "erf", "gelu", "remainder", "bitwise_not", "sign", "amax", "rsqrt", "_to_copy", "eq",
            "clamp"} <= ops, ops
    assert any("libdevice." in k.source for k in kernels)  # the GPU variants, not the interpreter's
    assert any(k.prologue is not None for k in kernels)  # a split reduction's partials kernel
    assert any(k.name.startswith("cast_inputs") for k in kernels)  # bf16's combined parameter casts
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    results = compile_files(paths, "cuda:90", timeout=900)
    assert set(results) == set(paths)
    failed = {os.path.basename(p): error for p, error in results.items() if error}
    assert not failed, failed
    cubins = list((tmp_path / "triton").rglob("*.cubin"))
    assert len(cubins) >= len(paths), (len(cubins), len(paths))  # really compiled, each launch at least once


OWN_KERNELS = textwrap.dedent("""\
    import json, os
    import torch
    from triton import knobs
    from fxopt.codegen.offline_compile import compiling_launches
    from fxopt.attention.flash_common import backward_config, forward_config
    from fxopt.attention.flash_forward import flash_forward
    from fxopt.attention.flash_backward import flash_backward
    from fxopt.attention.flash_decode import flash_decode
    from fxopt.losses.cross_entropy_kernels import GPU_BLOCK_V, cross_entropy_forward, cross_entropy_grad

    compiled = []
    knobs.compilation.listener = lambda **kw: compiled.append(getattr(kw["src"].fn, "__name__", "?"))
    T = 256
    with compiling_launches("cuda:90"):
        for dtype, head_dim, kv_heads in [(torch.bfloat16, 64, 2), (torch.float16, 128, 1), (torch.float32, 64, 2)]:
            q = torch.randn(1, 2, T, head_dim, dtype=dtype)
            k, v = (torch.randn(1, kv_heads, T, head_dim, dtype=dtype) for _ in range(2))
            for causal in (True, False):  # the GPU's configs, TMA where they pick it
                cfg = forward_config(head_dim, causal, dtype, T, T, "cuda")
                out, lse = flash_forward(q, k, v, scale=0.125, causal=causal, config=cfg)
                flash_backward(torch.randn_like(q), q, k, v, out, lse, scale=0.125, causal=causal,
                               config=backward_config(head_dim, causal, dtype, T, T, "cuda"))
            mask = torch.randn(1, 1, T, T, dtype=dtype).expand(1, 2, T, T)
            cfg = forward_config(head_dim, False, dtype, T, T, "cuda", has_mask=True)
            rows = mask[:, :, :1].expand(1, 2, T, T)  # a key padding mask: one row for every query
            keep_rows, keep = rows > 0, mask > 0  # bool masks (a -inf fill, SDPA's bool attn_mask)
            for m, safe in ((rows, False), (rows, True), (mask, True), (mask, False), (keep_rows, True), (keep, False)):
                out, lse = flash_forward(q, k, v, scale=0.125, causal=False, mask=m, config=cfg, safe_softmax=safe)
            for m, fill in ((mask, False), (mask, True), (rows, False), (keep_rows, True)):  # (fill: empty rows get 0)
                flash_backward(torch.randn_like(q), q, k, v, out, lse, scale=0.125, causal=False, mask=m,
                               config=backward_config(head_dim, False, dtype, T, T, "cuda"), zero_empty_rows=fill)
            decode_masks = ((None, False), (mask[:, :, :1], False), (mask[:, :, :1], True), (keep[:, :, :1], True))
            for decode_mask, safe in decode_masks:
                flash_decode(q[:, :, :1], k, v, scale=0.125, causal=False, num_splits=4, mask=decode_mask,
                             config={"BLOCK_N": 64, "BLOCK_M": 64, "num_warps": 4, "num_stages": 3}, safe_softmax=safe)
        logits, target = torch.randn(64, 5000, dtype=torch.bfloat16), torch.randint(0, 5000, (64,))
        for reduction in ("mean", "none"):
            loss, stats = cross_entropy_forward(logits, target, -100, reduction, block_v=GPU_BLOCK_V)
            cross_entropy_grad(logits, target, stats, torch.ones(loss.shape), -100, reduction, block_v=GPU_BLOCK_V)
    print("COMPILED " + json.dumps(compiled))
""")


def test_fxopt_own_kernels_compile_for_an_h200_with_the_gpu_configs(tmp_path):
    """Attention (pointer and TMA kernels, forward, backward, masked with their visible key ranges, decode
    with and without a mask) and cross-entropy with the launch configs the GPU uses, compiled by this Triton for sm_90 (the GPU
    sessions check them on the GPU machine's Triton; this checks CI's)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", OWN_KERNELS], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = json.loads(done.stdout.split("COMPILED ")[-1])
    expected = {"_flash_forward_kernel", "_flash_forward_tma_kernel", "_dkdv_kernel", "_dq_kernel", "_delta_kernel",
                "_dkdv_tma_kernel", "_dq_tma_kernel", "_split_partials_kernel", "_combine_splits_kernel",
                "_forward_kernel", "_finish_kernel", "_backward_kernel", "_visible_range_kernel"}
    assert expected <= set(compiled), sorted(expected - set(compiled))
    assert len(list((tmp_path / "triton").rglob("*.cubin"))) >= len(set(compiled))


def test_compiling_needs_the_compiler_and_a_named_target():
    """In this process Triton interprets (the suite's TRITON_INTERPRET=1): a compile-only launch says
    what it needs instead of running the kernel; a target it cannot read is named."""
    from fxopt.attention.flash_forward import flash_forward
    from fxopt.codegen import interpreter_guard
    from fxopt.codegen.offline_compile import compiling_launches, parse_target

    q = torch.randn(1, 1, 16, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=0"):
        with compiling_launches("cuda:90"):
            flash_forward(q, q, q, scale=0.25, causal=True)
    assert interpreter_guard.compile_only is None  # put back after the error
    assert parse_target("cuda:80") == ("cuda", 80, 32)
    with pytest.raises(ValueError, match="cuda:90"):
        parse_target("sm_90")


def test_wide_integers_reach_16_bit_floats_in_two_roundings(tmp_path, monkeypatch):
    """Eager casts int32/int64 -> bf16/fp16 through float32 (two roundings); LLVM folded the kernel's
    `.to(tl.float32).to(tl.bfloat16)` into one cvt.rn.bf16.s32 (one rounding: 2^24 + 2^16 + 1 became
    16908288, eager's 16777216; an H100 test caught it). The GPU variants take the float32 step in PTX the
    compiler cannot fold. (The interpreter leaves these casts to ATen: the group is fused here as on a GPU.)"""
    import fxopt.analysis.op_classes as op_classes
    monkeypatch.setattr(op_classes, "_int_to_half_cast", lambda *args: False)
    made = []
    install(made.append, monkeypatch.setattr)
    for source in (torch.int32, torch.int64):
        for out in (torch.bfloat16, torch.float16):
            fxopt.explain(lambda t: (t * 1).to(out), torch.arange(64).to(source))
    paths = []
    for i, k in enumerate(made):
        path = tmp_path / f"{i:02d}_{k.name}.py"
        path.write_text(fxopt_compile.standalone_source(k))
        paths.append(str(path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert not any(compile_files(paths, "cuda:90", timeout=600).values())
    ptx = "\n".join(p.read_text() for p in (tmp_path / "triton").rglob("*.ptx"))
    assert len(made) == 4 and ptx.count("cvt.rn.f32.s32") >= 2 and ptx.count("cvt.rn.f32.s64") >= 2, ptx[-2000:]
    for single in ("cvt.rn.bf16.s32", "cvt.rn.bf16.s64", "cvt.rn.f16.s32", "cvt.rn.f16.s64"):
        assert single not in ptx
