"""Probe: the TMA attention forward with descriptors made on the device and a warp-specialized key loop.

    PYTHONPATH=. python -m benchmarks.probe_attention_ws [--T 2048]          # GPU: ms, TFLOP/s, error vs SDPA
    PYTHONPATH=. python -m benchmarks.probe_attention_ws --ttgir             # no GPU: does sm_90 get partitions?
    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.probe_attention_ws --check   # CPU numerics

Why: the 2026-12-02 probe (`2026-12-02-h200-c.md`) put `tl.range(..., warp_specialize=True)` on
flash_forward_tma's key loop and got no partitions on sm_90. That kernel takes host-built descriptors
(TensorDescriptor arguments); Triton's Hopper warp specialization (its NVGPUWarpSpecialization pass,
"autoWS") partitions attention with descriptors built inside the kernel (`tl.make_tensor_descriptor`)
and splits a 128-row query tile over two consumer warpgroups: FlashAttention-3's producer/consumer
schedule. This probe builds that variant (causal and not; sequence lengths a multiple of the tiles, no
masks, slopes or ragged ends) and times it against SDPA and fxopt's kernel in one process.
Not used by fxopt.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fxopt.attention.flash_forward_tma import flash_forward_tma


def ws_forward(q, k, v, *, scale, causal, cfg, ws=True):
    """(out, lse) like flash_forward_tma, for contiguous [B, H, T, D] inputs with T a multiple of BLOCK_M
    and BLOCK_N; causal: 0 none, 1 a warp-specialized loop then the diagonal blocks unrolled, 2 one loop
    masking every block."""
    batch, heads, seq, head_dim = q.shape
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    assert seq % block_m == 0 and seq % block_n == 0, "the probe takes whole tiles only"
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, device=q.device, dtype=torch.float32)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=q.device))
    grid = (seq // block_m, batch * heads)
    _ws_kernel[grid](q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                     batch, heads, seq, scale * 1.4426950408889634, HEAD_DIM=head_dim, BLOCK_M=block_m,
                     BLOCK_N=block_n, CAUSAL=causal, WS=ws, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse


@triton.jit
def _key_loop(acc, row_sum, row_max, q, k_desc, v_desc, base, m0, lo, hi, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr,
              WS: tl.constexpr):
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    for n0 in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        acc, row_sum, row_max = _key_block(acc, row_sum, row_max, q, k_desc, v_desc, base, n0, rows, cols, qk_scale,
                                           DIAGONAL)
    return acc, row_sum, row_max


@triton.jit
def _key_block(acc, row_sum, row_max, q, k_desc, v_desc, base, n0, rows, cols, qk_scale, DIAGONAL: tl.constexpr):
    """One key block's online-softmax update. DIAGONAL: 1 masks the causal diagonal, 2 masks where
    the block reaches the diagonal (a run-time branch), 0 none."""
    k = k_desc.load([base + n0, 0])
    s = tl.dot(q, tl.trans(k))
    if DIAGONAL == 1:
        s = tl.where(rows[:, None] >= n0 + cols[None, :], s * qk_scale, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        p = tl.exp2(s - new_max[:, None])
    else:
        if DIAGONAL == 2:
            s = tl.where(rows[:, None] >= n0 + cols[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - new_max[:, None])
    rescale = tl.exp2(row_max - new_max)
    row_sum = row_sum * rescale + tl.sum(p, 1)
    v = v_desc.load([base + n0, 0])
    acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None])
    return acc, row_sum, new_max


@triton.jit
def _ws_kernel(Q, K, V, O, Lse, sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
               batch_size, num_heads, seq, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WS: tl.constexpr):
    block_m = tl.program_id(0)
    if CAUSAL:
        block_m = tl.num_programs(0) - 1 - block_m
    bh = tl.program_id(1)
    m0 = block_m * BLOCK_M
    # 2-D descriptors over [B * H * T, D] (contiguous inputs): the partitioner splits 2-D blocks only
    rows_total = batch_size * num_heads * seq
    q_desc = tl.make_tensor_descriptor(Q, [rows_total, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K, [rows_total, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V, [rows_total, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(O, [rows_total, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    base = bh * seq
    q = q_desc.load([base + m0, 0])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if CAUSAL == 2:  # one loop over every visible block, each masked (the mask is cheap beside the partition)
        acc, row_sum, row_max = _key_loop(acc, row_sum, row_max, q, k_desc, v_desc, base, m0, 0, m0 + BLOCK_M,
                                          qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, 2, WS)
    else:
        free_end = m0 // BLOCK_N * BLOCK_N if CAUSAL else seq
        acc, row_sum, row_max = _key_loop(acc, row_sum, row_max, q, k_desc, v_desc, base, m0, 0, free_end,
                                          qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, 0, WS)
        if CAUSAL:  # the diagonal blocks unrolled, outside any loop (BLOCK_M // BLOCK_N of them)
            rows = m0 + tl.arange(0, BLOCK_M)
            cols = tl.arange(0, BLOCK_N)
            for i in tl.static_range(BLOCK_M // BLOCK_N):
                acc, row_sum, row_max = _key_block(acc, row_sum, row_max, q, k_desc, v_desc, base,
                                                   free_end + i * BLOCK_N, rows, cols, qk_scale, 1)
    o_desc.store([base + m0, 0], (acc / row_sum[:, None]).to(o_desc.dtype))
    rows = m0 + tl.arange(0, BLOCK_M)
    tl.store(Lse + bh.to(tl.int64) * seq + rows, (row_max + tl.log2(row_sum)) * 0.6931471805599453)


CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
           for bm, bn, w, st in ((128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2))]
# (config, warp_specialize) pairs the GPU run times: warp specialization partitions 4-warp 128-row tiles
RUNS = [(c, True) for c in CONFIGS[:3]] + [(CONFIGS[0], False), (CONFIGS[3], False)]


def check() -> None:
    """Interpreter numerics against float64 attention (causal and not)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 32, dtype=torch.float16) for _ in range(3))
    for causal in (0, 1, 2):
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=bool(causal))
        out, _ = ws_forward(q, k, v, scale=32 ** -0.5, causal=causal,
                            cfg=dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2))
        err = (out.double() - ref).abs().max().item()
        print(f"causal={causal}: max error {err:.2e}")
        assert err < 5e-3


def ttgir() -> None:
    """Compile for sm_90 without a GPU and say whether the key loop was partitioned."""
    from fxopt.codegen.compile_worker import use_offline_driver
    use_offline_driver("cuda", 90, 32)
    q = torch.empty(8, 16, 2048, 128, dtype=torch.bfloat16)
    for causal in (0, 1, 2):
        for cfg in CONFIGS[:4]:
            args = (q, q, q, q, q, *q.stride(), *q.stride(), *q.stride(), *q.stride(), 8, 16, 2048, 0.1)
            try:
                kernel = _ws_kernel.warmup(*args, HEAD_DIM=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                           CAUSAL=causal, WS=True, num_warps=cfg["num_warps"],
                                           num_stages=cfg["num_stages"], grid=(1,))
                ir = kernel.asm["ttgir"]
                print(causal, cfg, "partitions" if "ttg.warp_specialize" in ir else "no partitions",
                      "smem", kernel.metadata.shared, "warps", kernel.metadata.num_warps)
            except Exception as e:  # a probe: report and go on
                print(causal, cfg, "failed:", str(e).splitlines()[0][:200])


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--ttgir", action="store_true")
    p.add_argument("--T", type=int, default=2048)
    a = p.parse_args(argv)
    if a.check:
        check()
        return 0
    if a.ttgir:
        ttgir()
        return 0
    from triton.testing import do_bench
    torch.manual_seed(0)
    batch, heads, seq, dim = 8, 16, a.T, 128
    for causal in (1, 2, 0):
        q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * seq * seq * dim / (2 if causal else 1)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)), warmup=10, rep=40)
        print(f"causal={causal} sdpa {ms:.4f} ms {flops / ms / 1e9:.1f} TFLOP/s")
        base = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
        ms0 = do_bench(lambda: flash_forward_tma(q, k, v, scale=dim ** -0.5, causal=bool(causal), cfg=base),
                       warmup=10, rep=40)
        print(f"causal={causal} fxopt tma {ms0:.4f} ms {flops / ms0 / 1e9:.1f} TFLOP/s")
        for cfg, ws in RUNS:
            try:
                out, _ = ws_forward(q, k, v, scale=dim ** -0.5, causal=causal, cfg=cfg, ws=ws)
                err = (out.float() - ref.float()).abs().max().item()
                t = do_bench(lambda: ws_forward(q, k, v, scale=dim ** -0.5, causal=causal, cfg=cfg, ws=ws),
                             warmup=10, rep=40)
                print(f"causal={causal} ws={ws} {cfg}: {t:.4f} ms {flops / t / 1e9:.1f} TFLOP/s "
                      f"{ms / t:.2f}x sdpa err {err:.1e}")
            except Exception as e:  # a probe: report and go on
                print(f"causal={causal} ws={ws} {cfg}: failed {str(e).splitlines()[0][:160]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
