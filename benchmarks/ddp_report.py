"""What benchmarks.ddp_scaling prints: its tables, and how much of the NCCL time a profile shows running
beside compute kernels."""
from __future__ import annotations

import statistics

import torch


def overlap_of(events) -> dict:
    """NCCL kernel time, and how much of it runs while some other (compute) kernel runs."""
    kernels = [(e.time_range.start, e.time_range.end, "nccl" in e.name.lower()) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    comm = [(s, e) for s, e, is_nccl in kernels if is_nccl]
    compute = _union([(s, e) for s, e, is_nccl in kernels if not is_nccl])
    total = sum(e - s for s, e in comm)
    hidden = sum(max(0, min(e, ce) - max(s, cs)) for s, e in comm for cs, ce in compute)
    return {"nccl_kernels": len(comm), "nccl_ms": total / 1e3, "overlapped_ms": hidden / 1e3,
            "overlap_pct": 100 * hidden / total if total else None}


def _union(intervals):
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def print_table(results, world):
    """Losses side by side; the interconnect alone; per backend the step time on one GPU and on N,
    the scaling, and how much of the all-reduce the backward hid: 1 - (t_N - t_1) / t_allreduce."""
    if f"losses/{world}" in results:
        ranks = results[f"losses/{world}"]
        r = ranks[0]
        print(f"\nlosses (rank 0) eager {['%.6f' % v for v in r['eager']]}\n"
              f"losses (rank 0) fxopt {['%.6f' % v for v in r['fxopt']]}\n"
              f"max relative difference over ranks: losses {max(v['max_rel_diff'] for v in ranks.values()):.2e}, "
              f"parameters after the steps {max(v['param_rel_diff'] for v in ranks.values()):.2e}")
    comm = results.get(f"allreduce/{world}", {}).get(0)
    if comm:
        print(f"\nall-reduce of the fp32 gradients alone: {comm['bytes'] / 2**20:.0f} MiB in {comm['ms']:.2f} ms "
              f"(bus {comm['bus_gbs']:.0f} GB/s)")
    one = results.get("throughput/1", {}).get(0, {})
    many = results.get(f"throughput/{world}", {}).get(0) or results.get(f"throughput_n/{world}", {}).get(0)
    if many:
        print(f"\n| backend | 1 GPU ms/step | {world} GPUs ms/step | tokens/s {world} GPUs | scaling "
              f"| all-reduce hidden | peak MiB (1 / {world}) |\n|---|---|---|---|---|---|---|")
        for b, c in many.items():
            a = one.get(b)
            scaling = f"{c['tokens_per_s'] / a['tokens_per_s']:.2f}x" if a else "-"
            hidden = f"{100 * (1 - (c['ms'] - a['ms']) / comm['ms']):.0f}%" if a and comm else "-"
            peak = f"{a['peak_mib'] if a else float('nan'):.0f} / {c['peak_mib']:.0f}" if c["peak_mib"] else "-"
            print(f"| {b} | {a['ms'] if a else float('nan'):.2f} | {c['ms']:.2f} | {c['tokens_per_s']:.0f} "
                  f"| {scaling} | {hidden} | {peak} |")
    _print_scaling(results.get(f"scaling/{world}", {}), world)
    for rank, found in results.get(f"overlap/{world}", {}).items():
        if found:  # the profiled rank's
            print(f"\nNCCL kernels vs compute kernels on rank {rank} (3 fxopt DDP steps; an NCCL kernel's time "
                  f"includes waiting for the other rank): {found}")



def _print_scaling(ranks: dict, world: int):
    """Rank 0's rounds: median ms per step alone and under DDP, and the median of the per-round scaling
    (each round's two timings are minutes closer than separate runs), with its range; then the other
    ranks' medians."""
    if not ranks.get(0):
        return
    print(f"\n| backend | 1 GPU ms/step | {world} GPUs ms/step | scaling | scaling range | rounds |\n"
          "|---|---|---|---|---|---|")
    for b, r in ranks[0].items():
        ratios = [world * a / c for a, c in zip(r["single_ms"], r["ddp_ms"])]
        print(f"| {b} | {statistics.median(r['single_ms']):.2f} | {statistics.median(r['ddp_ms']):.2f} "
              f"| {statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x | {len(ratios)} |")
    # every rank's medians: a rank slower than the others (rank 1 under the python reducer on the H200
    # host, 2026-12-04-h200-c.md) makes the rest wait in their all-reduces
    for rank, found in sorted(ranks.items()):
        if rank == 0 or not found:
            continue
        print(f"rank {rank}: " + ", ".join(
            f"{b} {statistics.median(r['single_ms']):.2f} / {statistics.median(r['ddp_ms']):.2f} ms"
            for b, r in found.items()))

