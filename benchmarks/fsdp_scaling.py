"""fxopt under FSDP2 on several GPUs (issue 10): `fully_shard` per GPT-2 block and on the whole model, each
block compiled on its own (`block.compile(backend=...)`), against the same model unsharded on one GPU.

    python -m benchmarks.fsdp_scaling                          # every visible GPU (2 on nvidia-h200-x2), NCCL
    python -m benchmarks.fsdp_scaling --device cpu --quick --backends eager --precision none   # gloo smoke test
    python -m benchmarks.fsdp_scaling --world 1                # one GPU: what FSDP2's hooks cost, no communication

The companion of benchmarks/ddp_scaling.py, with its model, data, step and timing (`--parts scaling`
there): per backend a plain model and a sharded one on every rank, 20 steps of each in turn for
--rounds rounds in the same processes; the table gives rank 0's median ms per step alone and sharded,
and the median (range) of the per-round scaling N x t1 / tN. FSDP2 all-gathers each block's
parameters before its forward and backward and reduce-scatters its gradients after, from hooks around
each compiled block: the collectives stay outside fxopt's graphs, which see one block at a time.
Mixed precision as in ddp_scaling: fp32 parameters, bf16 compute (autocast for eager and Inductor,
`precision="bf16"` for fxopt). FSDP2's losses against eager FSDP2 are tests/distributed/test_two_ranks.py's.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from . import ddp_scaling as ds
from . import scaling_cli
from .ddp_report import _print_scaling


def _sharded(cfg, device, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (world,))
    model = ds._model(cfg, device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _per_block(backend: str, model, precision, device: str):
    """The training callable with each block compiled on its own (how FSDP2 is compiled: the hooks
    that gather and scatter stay between the compiled blocks)."""
    import fxopt

    for block in model.blocks:
        if backend == "fxopt":
            block.compile(backend=fxopt.backend(precision=precision))
        elif backend == "inductor":
            block.compile()
    # the blocks carry the backend; the outer step is ds._compiled's eager one (autocast unless fxopt)
    return ds._compiled("eager", model, None if backend == "fxopt" else precision, device, reset=False)


def job_fsdp_scaling(rank, world, cfg, device, args) -> dict:
    """Per backend: the plain model on each rank alone, then the sharded one, timed in turn."""
    out = {}
    for backend in args.backends:
        single_model = ds._model(cfg, device, ds.PlainStack)
        single = ds._stepper(ds._compiled(backend, single_model, args.precision, device),
                             single_model.parameters(), cfg, device, rank)
        sharded = _sharded(cfg, device, world)
        fsdp = ds._stepper(_per_block(backend, sharded, args.precision, device), sharded.parameters(),
                           cfg, device, rank)
        rounds = [(ds._timed(single, device, args.steps), ds._timed(fsdp, device, args.steps))
                  for _ in range(args.rounds)]
        # "ddp_ms": the N-GPU column of ddp_report's scaling table
        out[backend] = {"single_ms": [1e3 * a for a, _ in rounds], "ddp_ms": [1e3 * b for _, b in rounds]}
        del single_model, sharded, single, fsdp
        ds._empty(device)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    scaling_cli.shape_args(p)
    scaling_cli.run_args(p, backends="inductor,fxopt")
    args = scaling_cli.parsed(p, argv)
    args.optimize_ddp, args.share_gpu = False, False  # what ds._worker reads
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 2 and not args.world:  # --world 1: FSDP2's hooks and per-block compiles, no communication
        print(f"needs two ranks or more; {world} available", file=sys.stderr)
        return 2
    cfg = ds._shapes(args)
    print(f"# fsdp_scaling world={world} device={args.device} {cfg} precision={args.precision} "
          f"torch {torch.__version__}")
    got = ds.run_ranks(job_fsdp_scaling, world, cfg, args.device, args)
    errors = [r["error"] for r in got.values() if "error" in r]
    if errors:
        print(f"## fsdp scaling FAILED\n{errors[0]}", file=sys.stderr)
        return 1
    print(json.dumps(got, indent=1, default=str))
    _print_scaling(got, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
