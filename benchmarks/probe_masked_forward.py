"""GPU probe: HF Llama's masked attention forward against the causal path over the same tiles, with the
time of each kernel (the forward, the mask's range kernel) from torch.profiler.

Why: `attn_llama_mask` walks the same tiles as causal attention (the mask's whole tiles without reading
it), yet ran 1.6x slower (benchmarks/results/2026-12-08-h100.md, section 2).

    . benchmarks/gpu_batch_env.sh; python -m benchmarks.probe_masked_forward
"""
from __future__ import annotations

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from benchmarks.workloads_attention import (
    _causal_attention, _hf_llama_masked, _llama_4d_mask, _padding_keep, _qkv,
)


def main() -> None:
    B, H, T, D = 8, 16, 2048, 128
    q, k, v = _qkv("cuda", torch.bfloat16, B, H, T, T, D)
    masks = {"right-padded (the workload)": _llama_4d_mask(_padding_keep(B, T, "cuda"), torch.bfloat16),
             "no padding": _llama_4d_mask(torch.ones(B, 1, 1, T, dtype=torch.bool, device="cuda"), torch.bfloat16)}
    masked = torch.compile(_hf_llama_masked, backend="fxopt", dynamic=False)
    causal = torch.compile(_causal_attention, backend="fxopt", dynamic=False)
    causal(q, k, v)
    print(f"causal, no mask tensor: {triton.testing.do_bench(lambda: causal(q, k, v)):.4f} ms")
    for name, mask in masks.items():
        masked(q, k, v, mask)
        print(f"Llama mask, {name}: {triton.testing.do_bench(lambda: masked(q, k, v, mask)):.4f} ms")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                masked(q, k, v, mask)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=4, max_name_column_width=40))


if __name__ == "__main__":
    main()
