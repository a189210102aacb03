"""fxopt under DistributedDataParallel on several GPUs (issue 10): same losses as eager DDP, throughput
scaling from one GPU to N, and whether the gradient all-reduce overlaps the backward kernels.

    python -m benchmarks.ddp_scaling                      # every visible GPU (2 on nvidia-h200-x2), NCCL
    python -m benchmarks.ddp_scaling --device cpu --quick # two gloo ranks on the CPU, interpreter: a smoke test
    python -m benchmarks.ddp_scaling --share-gpu --parts losses   # two gloo ranks on one GPU: the
                                                          # compiled kernels checked under DDP, no scaling

The model is a stack of GPT-2 blocks (benchmarks.workloads_attention.GPTBlock, hand-written causal
attention) trained with AdamW on a regression loss; each rank draws its own batch, so the gradient
all-reduce matters. The parts, each in processes of their own (one per rank):

  losses      fp32 (TF32 off): eager DDP and fxopt DDP from the same initial weights on the same data,
              loss by loss; the largest relative difference is printed.
  throughput  fp32 parameters with bf16 compute (autocast for eager and Inductor, precision="bf16" for
              fxopt) at a fixed per-GPU batch: step time (forward, backward, all-reduce, optimizer) on one
              GPU without DDP and on N GPUs with DDP; scaling = N-GPU tokens/s over one-GPU tokens/s.
  scaling     the same at a fixed per-GPU batch, but one-GPU and N-GPU steps timed in turn for --rounds
              rounds in the same processes (median and range of the per-round ratio): the host's speed
              drifts too much between separate runs for their ratio to mean much. With --world 1, DDP
              on a single rank: what DDP (and dynamo's graph splitting) costs without communication.
  overlap     a torch.profiler trace of fxopt DDP steps on one rank (--profile-rank): the share of NCCL kernel time that
              runs while a compute kernel runs on another stream (0% = fully exposed communication).

Dynamo's DDP optimizer splits each model's graph at DDP's bucket boundaries (torch._dynamo.config.
optimize_ddp), so the all-reduce of a bucket can start while the backward of the next graph runs.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from . import scaling_cli
from .ddp_report import overlap_of, print_table
from .workloads_attention import GPTBlock

BACKENDS = ("eager", "inductor", "fxopt")


class GPTStack(nn.Module):
    def __init__(self, n_blocks: int, d_model: int, n_head: int, max_len: int):
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_head, max_len) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


class PlainStack(GPTStack):
    """The same model with a forward code object of its own, so that dynamo's cache entry for the plain
    model (no DDP) is never the one the DDP-wrapped model runs, or the other way round."""

    def forward(self, x):
        return GPTStack.forward(self, x)


def _shapes(args) -> dict:
    if args.quick:
        return dict(n_blocks=2, d_model=64, n_head=2, B=2, T=32)
    return dict(n_blocks=args.blocks, d_model=1024, n_head=16, B=args.batch, T=1024)


def _model(cfg, device, cls=GPTStack) -> GPTStack:
    torch.manual_seed(0)
    return cls(cfg["n_blocks"], cfg["d_model"], cfg["n_head"], cfg["T"]).to(device)


def _batch(cfg, device, step: int, rank: int):
    g = torch.Generator(device="cpu").manual_seed(1000 * step + rank)
    x = torch.randn(cfg["B"], cfg["T"], cfg["d_model"], generator=g).to(device)
    return x, torch.randn(x.shape, generator=g).to(device)


def _compiled(backend: str, model, precision: str | None, device: str, reset: bool = True, graphs: bool = False):
    """The training callable `backend` runs: model(x) -> loss, compiled and in mixed precision as asked
    (`reset`: forget dynamo's earlier compiles first; False where an earlier model is still in use;
    `graphs`: CUDA graphs, fxopt's cudagraphs=True and Inductor's mode="reduce-overhead")."""
    import fxopt

    def loss_fn(m, x, target):
        return (m(x) - target).square().mean()

    if reset:
        torch._dynamo.reset()
    # DDP's python reducer puts the all-reduces into the backward graph that compiled autograd compiles
    # (with the same compiler as the forward); the other modes keep autograd's own engine
    reducer = torch._dynamo.config.optimize_ddp == "python_reducer" and backend != "eager"
    if backend == "fxopt":
        compile_ = functools.partial(torch.compile, backend=fxopt.backend(precision=precision, cudagraphs=graphs))
    else:
        compile_ = functools.partial(torch.compile, mode="reduce-overhead" if graphs else None)
    fn = model if backend == "eager" else compile_(model)
    if precision is None or backend == "fxopt":
        step = lambda x, t: loss_fn(fn, x, t)  # noqa: E731
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]

        def step(x, t):
            with torch.autocast(device, dtype=dtype):
                out = fn(x)
            return (out.float() - t).square().mean()
    step.backward_compiler = compile_() if reducer else None
    return step


def _backward(step_fn, loss):
    """loss.backward(), under compiled autograd with the step's own compiler where DDP's python reducer
    was asked for (`--optimize-ddp python_reducer`)."""
    compiler = getattr(step_fn, "backward_compiler", None)
    if compiler is None:
        loss.backward()
        return
    from torch._dynamo import compiled_autograd
    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    with enable(compiler):
        loss.backward()


def _train(step_fn, params, cfg, device, rank, steps: int, first: int = 0) -> list[float]:
    opt = torch.optim.AdamW(params, lr=1e-4)
    losses = []
    for i in range(first, first + steps):
        x, target = _batch(cfg, device, i, rank)
        opt.zero_grad(set_to_none=True)
        loss = step_fn(x, target)
        _backward(step_fn, loss)
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in losses]


def _wrap(model, world: int, device: str, args, always: bool = False):
    """DDP around `model` on more than one rank, or `always` (buckets of --bucket-mb, gradients
    all-reduced in bf16 with --comm-hook bf16: DDP's own bf16_compress_hook, a user's choice fxopt
    leaves alone)."""
    if world == 1 and not always:
        return model
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None,
              bucket_cap_mb=args.bucket_mb)
    if args.comm_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return ddp


# ---------------------------------------------------------------- the three parts, run on every rank

def job_losses(rank, world, cfg, device, args) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    out, params = {}, {}
    for backend in ("eager", "fxopt"):
        model = _wrap(_model(cfg, device), world, device, args)
        step = _compiled(backend, model, None, device, graphs=args.cudagraphs)
        out[backend] = _train(step, model.parameters(), cfg, device, rank, args.loss_steps)
        params[backend] = [p.detach().clone() for p in model.parameters()]
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(out["fxopt"], out["eager"]))
    worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                for a, b in zip(params["fxopt"], params["eager"]))
    return {**out, "max_rel_diff": rel, "param_rel_diff": worst}


def job_allreduce(rank, world, cfg, device, args) -> dict:
    """The interconnect's share of a step: all-reducing one gradient's worth of bytes (every fp32
    parameter of the model, as DDP's buckets do), with nothing else running."""
    n = sum(p.numel() for p in _model(cfg, "meta").parameters())
    grads = torch.ones(n, device=device)
    for _ in range(3):
        dist.all_reduce(grads)
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        dist.all_reduce(grads)
    _sync(device)
    ms = (time.perf_counter() - start) / args.steps * 1e3
    return {"bytes": 4 * n, "ms": ms, "bus_gbs": 4 * n * 2 * (world - 1) / world / ms / 1e6}


def _stepper(step_fn, params, cfg, device, rank):
    """One training step (zero_grad, forward, backward, AdamW) over 4 batches made up front, after 3
    warm-up (compilation) steps."""
    opt = torch.optim.AdamW(params, lr=1e-4)
    batches = [_batch(cfg, device, i, rank) for i in range(4)]

    def one(i):
        x, target = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        _backward(step_fn, step_fn(x, target))
        opt.step()
    for i in range(3):
        one(i)
    _sync(device)
    return one


def _timed(one, device, steps: int, profiler=None) -> float:
    """Mean seconds per step over `steps` steps, all ranks starting together; with `profiler`, the
    timed steps run inside it (so the trace holds training steps only)."""
    _sync(device)
    if dist.is_initialized():
        dist.barrier()
    with profiler if profiler is not None else contextlib.nullcontext():
        start = time.perf_counter()
        for i in range(steps):
            one(i)
        _sync(device)
        return (time.perf_counter() - start) / steps


def _time_steps(step_fn, params, cfg, device, rank, steps: int, profiler=None) -> float:
    return _timed(_stepper(step_fn, params, cfg, device, rank), device, steps, profiler)


def job_throughput(rank, world, cfg, device, args) -> dict:
    out = {}
    for backend in args.backends:
        model = _wrap(_model(cfg, device), world, device, args)
        step = _compiled(backend, model, args.precision, device, graphs=args.cudagraphs)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = _time_steps(step, model.parameters(), cfg, device, rank, args.steps)
        peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
        out[backend] = {"ms": seconds * 1e3, "tokens_per_s": world * cfg["B"] * cfg["T"] / seconds,
                        "peak_mib": peak}
        del model, step
        _empty(device)
    return out


def job_scaling(rank, world, cfg, device, args) -> dict:
    """Per backend, a plain model and a DDP model on every rank, timed in turn for --rounds rounds:
    the host's speed drifts by 15-25% within minutes on the lent machines, so one-GPU and N-GPU times
    taken minutes apart (separate processes) do not give a trustworthy ratio. In the one-GPU phase
    every rank trains its own plain model at once, no communication, so both phases share the host
    the same way."""
    out = {}
    for backend in args.backends:
        single_model = _model(cfg, device, PlainStack)
        ddp_model = _wrap(_model(cfg, device), world, device, args, always=True)
        single = _stepper(_compiled(backend, single_model, args.precision, device, graphs=args.cudagraphs),
                          single_model.parameters(), cfg, device, rank)
        ddp = _stepper(_compiled(backend, ddp_model, args.precision, device, reset=False, graphs=args.cudagraphs),
                       ddp_model.parameters(), cfg, device, rank)
        rounds = [(_timed(single, device, args.steps), _timed(ddp, device, args.steps))
                  for _ in range(args.rounds)]
        out[backend] = {"single_ms": [1e3 * a for a, _ in rounds], "ddp_ms": [1e3 * b for _, b in rounds]}
        del single_model, ddp_model, single, ddp
        _empty(device)
    return out


def job_overlap(rank, world, cfg, device, args) -> dict:
    """Profile 3 fxopt DDP steps; on --profile-rank (0): how much NCCL kernel time overlaps compute
    kernels, and the busiest GPU kernels and host operations."""
    from torch.profiler import ProfilerActivity, profile
    model = _wrap(_model(cfg, device), world, device, args)
    step = _compiled("fxopt", model, args.precision, device, graphs=args.cudagraphs)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=activities)
    ms = 1e3 * _time_steps(step, model.parameters(), cfg, device, rank, 3, profiler=prof)
    if rank != args.profile_rank or device != "cuda":
        return {}
    if args.trace:
        prof.export_chrome_trace(args.trace)
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60), flush=True)
    return {"ms_per_step_profiled": ms, **overlap_of(prof.events())}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _empty(device):
    if device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- processes

JOBS = {"losses": job_losses, "allreduce": job_allreduce, "throughput": job_throughput,
        "throughput_n": job_throughput, "overlap": job_overlap, "scaling": job_scaling}


def _worker(rank, world, port, job_name, cfg, device, args, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch._dynamo.config.optimize_ddp = args.optimize_ddp
        if device == "cuda":
            torch.cuda.set_device(0 if args.share_gpu else rank)
        grouped = world > 1 or job_name == "scaling" or callable(job_name)  # scaling jobs: DDP/FSDP2 on one rank too
        if grouped:
            nccl = device == "cuda" and not args.share_gpu  # NCCL refuses two ranks on one GPU
            dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=world,
                                    device_id=torch.device("cuda", rank) if nccl else None)
        try:
            job = JOBS[job_name] if isinstance(job_name, str) else job_name  # or a module-level function
            queue.put((rank, job(rank, world, cfg, device, args)))
        finally:
            if grouped:
                dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (the parent prints it and goes on with the other parts)
        queue.put((rank, {"error": traceback.format_exc()[-3000:]}))


def run_ranks(job_name: str, world: int, cfg, device, args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, job_name, cfg, device, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=args.timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    scaling_cli.shape_args(p)
    scaling_cli.run_args(p, backends=",".join(BACKENDS))
    p.add_argument("--loss-steps", type=int, default=5)
    p.add_argument("--parts", default="losses,allreduce,throughput,overlap",
                   help="throughput: 1 GPU and N (separate processes, with peak memory); throughput_n: "
                        "N only; scaling: 1 GPU and N in turn in the same processes, medians of --rounds")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--optimize-ddp", default="ddp_optimizer", type=lambda v: False if v == "off" else v,
                   help="torch._dynamo.config.optimize_ddp: ddp_optimizer (split the graph at bucket "
                        "boundaries, the default), off (one graph; buckets all-reduced after the backward) "
                        "or python_reducer (compiled autograd: the all-reduces inside the compiled backward)")
    p.add_argument("--comm-hook", default="none", choices=("none", "bf16"))
    p.add_argument("--cudagraphs", action="store_true",
                   help="compiled steps replayed as CUDA graphs (fxopt cudagraphs=True, Inductor reduce-overhead)")
    p.add_argument("--trace", default="", help="write the profiled rank's chrome trace of the overlap part here")
    p.add_argument("--profile-rank", type=int, default=0, help="the rank the overlap part profiles")
    p.add_argument("--share-gpu", action="store_true",
                   help="every rank on GPU 0 through gloo (checks results where only one GPU is lent)")
    args = scaling_cli.parsed(p, argv)
    on_gpus = args.device == "cuda" and not args.share_gpu
    world = args.world or (torch.cuda.device_count() if on_gpus else 2)
    cfg = _shapes(args)
    if world < 2 and args.parts != "scaling":  # scaling on one rank: DDP's own cost, no communication
        print(f"needs two ranks or more; {world} available", file=sys.stderr)
        return 2
    print(f"# ddp_scaling world={world} device={args.device} {cfg} precision={args.precision} "
          f"torch {torch.__version__} commit {os.environ.get('BENCH_COMMIT', '?')}")
    results, failed = {}, False
    for part in args.parts.split(","):
        worlds = (1, world) if part == "throughput" else (world,)
        for w in worlds:
            got = run_ranks(part, w, cfg, args.device, args)
            errors = [r["error"] for r in got.values() if "error" in r]
            if errors:
                failed = True
                print(f"## {part} world={w} FAILED\n{errors[0]}", file=sys.stderr)
                continue
            results[f"{part}/{w}"] = got
    print(json.dumps(results, indent=1, default=str))
    print_table(results, world)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
