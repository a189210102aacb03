"""benchmarks/ddp_scaling.py, the two-GPU benchmark of issue 10, kept runnable without GPUs: its
overlap arithmetic on synthetic profiler events, and its loss comparison on two gloo ranks; and
benchmarks/fsdp_scaling.py (FSDP2, each block compiled on its own) on two gloo ranks."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from benchmarks import ddp_report, ddp_scaling


def _kernel(name, start, end):
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                           time_range=SimpleNamespace(start=start, end=end))


def test_overlap_counts_nccl_time_that_runs_beside_compute():
    events = [_kernel("gemm", 0, 100), _kernel("softmax", 50, 150),  # compute busy [0, 150)
              _kernel("ncclDevKernel_AllReduce", 120, 220),            # 30 of 100 us beside compute
              _kernel("ncclDevKernel_AllReduce", 300, 320),            # alone
              SimpleNamespace(name="aten::mm", device_type=torch.autograd.DeviceType.CPU,
                              time_range=SimpleNamespace(start=0, end=1000))]
    got = ddp_report.overlap_of(events)
    assert got["nccl_kernels"] == 2
    assert got["nccl_ms"] == pytest.approx(0.120)
    assert got["overlapped_ms"] == pytest.approx(0.030)
    assert got["overlap_pct"] == pytest.approx(25.0)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_losses_part_on_two_cpu_ranks(capsys):
    code = ddp_scaling.main(["--device", "cpu", "--quick", "--parts", "losses", "--loss-steps", "2",
                             "--timeout", "240"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("max relative difference"))
    losses, params = (float(part.split()[-1]) for part in line.split(",")[-2:])
    assert losses < 1e-5 and params < 1e-3, line


def test_scaling_table_takes_the_median_of_per_round_ratios(capsys):
    ranks = {0: {"fxopt": {"single_ms": [10.0, 12.0, 11.0], "ddp_ms": [10.0, 15.0, 11.0]}},
             1: {"fxopt": {"single_ms": [20.0, 30.0, 25.0], "ddp_ms": [40.0, 45.0, 41.0]}}}
    ddp_report.print_table({"scaling/2": ranks}, 2)
    out = capsys.readouterr().out.splitlines()
    row = next(ln for ln in out if ln.startswith("| fxopt"))
    # per-round ratios 2.0, 1.6, 2.0: median 2.0, range 1.6-2.0; medians of the times 11.0 and 11.0
    assert row == "| fxopt | 11.00 | 11.00 | 2.00x | 1.60-2.00x | 3 |"
    assert "rank 1: fxopt 25.00 / 41.00 ms" in out  # a slower rank shows


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_scaling_part_times_plain_and_ddp_models_in_turn(capsys):
    code = ddp_scaling.main(["--device", "cpu", "--quick", "--parts", "scaling", "--rounds", "2", "--steps", "1",
                             "--backends", "eager", "--precision", "none", "--timeout", "240"])
    out = capsys.readouterr().out
    assert code == 0, out
    row = next(ln for ln in out.splitlines() if ln.startswith("| eager"))
    assert row.endswith("| 2 |"), row  # two rounds, each a plain and a DDP timing


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_fsdp_scaling_times_plain_and_per_block_sharded_models_in_turn(capsys):
    from benchmarks import fsdp_scaling
    code = fsdp_scaling.main(["--device", "cpu", "--quick", "--backends", "eager", "--precision", "none",
                              "--rounds", "2", "--steps", "1", "--timeout", "240"])
    out = capsys.readouterr().out
    assert code == 0, out
    row = next(ln for ln in out.splitlines() if ln.startswith("| eager"))
    assert row.endswith("| 2 |"), row  # two rounds, each a plain and an FSDP2 timing
