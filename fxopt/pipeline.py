"""The passes fxopt runs, stage by stage, in order. One place to read what fxopt does."""
from __future__ import annotations

from .options import Options
from .passes.attention import FuseAttention
from .passes.bucket_all_reduces import BucketAllReduces
from .passes.cleanup import Cleanup
from .passes.combine_casts import CombineInputCasts
from .passes.collective_waits import SinkCollectiveWaits
from .passes.cpu_scalars import ScalarsToDevice
from .passes.cross_entropy import FuseCrossEntropy
from .passes.fuse import FusePointwise
from .passes.fuse_reductions import FuseReductions
from .passes.grad_over_logits import GradientOverLogits
from .passes.linear_cross_entropy import FuseLinearCrossEntropy
from .passes.logsumexp_upcast import UpcastLogsumexp
from .passes.matmul_casts import FoldMatmulCasts
from .passes.precision import LOW_DTYPES, MixedPrecision
from .passes.recompute import RecomputeForReductions
from .passes.sum_views import SumsThroughViews


def pre_autograd_passes(options: Options) -> list:
    """On the torch-level graph dynamo captured, before aot_autograd decomposes it."""
    passes = []
    if options.attention:
        passes.append(FuseAttention())  # hand-written attention -> one fused op, so precision casts q, k, v once
    if options.precision in LOW_DTYPES:
        passes.append(MixedPrecision.from_options(options))  # casts by policy; autograd derives the backward ones
    # cross_entropy(hidden @ weight.T): the LM head and its loss as one chunked op, never the whole logits
    if "fuse_linear_cross_entropy" not in options.skip_passes:
        passes.append(FuseLinearCrossEntropy())
    # F.cross_entropy / nll_loss(log_softmax) -> one fused op; after precision, so the fp32 up-cast of the
    # logits it inserts is folded into the kernel instead of materialising an fp32 copy
    passes.append(FuseCrossEntropy())
    # a 16-bit logsumexp on its fp32 up-cast: its backward subtracts an unrounded saved result
    if "upcast_logsumexp" not in options.skip_passes:
        passes.append(UpcastLogsumexp())
    return passes


def post_grad_passes(options: Options) -> list:
    """On each ATen graph aot_autograd hands over (forward, backward, or inference)."""
    passes = [
        Cleanup(),  # drop aliases, no-op views/casts and duplicates first, so groups come out larger
        ScalarsToDevice(),  # (CUDA) a 0-d CPU input (dynamo's float attributes) read once: its math fuses on the GPU
        SumsThroughViews(),  # sum(view(dy, [B*T, C]), 0) -> sum(dy, (0, 1)): a bias gradient the row kernel can sum
        FoldMatmulCasts(),  # (CUDA) mm(bf16) -> cast to fp32 becomes mm(..., out_dtype=fp32): no cast kernel
        RecomputeForReductions(),  # column sums (dw, db) get their own copy of cheap row math
        FuseReductions(),  # reductions take their pointwise producers and consumers first (softmax, norms)
        FusePointwise(),  # the remaining elementwise chains -> one submodule (one Triton kernel) per group
        CombineInputCasts(),  # groups that only cast a graph input (training's parameter casts) -> one launch
        Cleanup(name="cleanup_after_fuse"),  # views that fed a group and are now unused disappear
        SinkCollectiveWaits(),  # a collective's wait moves to its result's first use: the compute between overlaps
        # one all-reduce per gradient (DDP's python reducer) -> one coalesced call per bucket (after the
        # waits moved: a bucket is issued where its last member was, before any wait on its members)
        BucketAllReduces(),
        GradientOverLogits(),  # (backward) the cross-entropy gradient written over the logits it alone reads last
    ]
    return [p for p in passes if p.name not in options.skip_passes]  # Options.skip_passes: see one pass's effect
