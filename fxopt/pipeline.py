"""The passes fxopt runs, stage by stage, in order. One place to read what fxopt does."""
from __future__ import annotations

from .options import Options
from .passes.attention import FuseAttention
from .passes.cleanup import Cleanup
from .passes.fuse import FusePointwise
from .passes.fuse_reductions import FuseReductions
from .passes.recompute import RecomputeForReductions


def pre_autograd_passes(options: Options) -> list:
    """On the torch-level graph dynamo captured, before aot_autograd decomposes it."""
    return [FuseAttention()] if options.attention else []  # (precision casts plug in here: issue 6)


def post_grad_passes(options: Options) -> list:
    """On each ATen graph aot_autograd hands over (forward, backward, or inference)."""
    return [
        Cleanup(),  # drop aliases, no-op views/casts and duplicates first, so groups come out larger
        RecomputeForReductions(),  # column sums (dw, db) get their own copy of cheap row math
        FuseReductions(),  # reductions take their pointwise producers and consumers first (softmax, norms)
        FusePointwise(),  # the remaining elementwise chains -> one submodule (one Triton kernel) per group
        Cleanup(name="cleanup_after_fuse"),  # views that fed a group and are now unused disappear
    ]
