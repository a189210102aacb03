"""fxopt's own ops as generated wrappers call them: the plain implementations behind the
torch.library custom ops (`torch.ops.fxopt.*`), named as the ops are.

The custom ops exist for the graphs: they give aot_autograd a fake implementation and an autograd
formula, so a forward graph holds one `flash_attention` node and the backward one
`flash_attention_backward`. A wrapper runs below autograd (aot_autograd wraps the compiled graph in
its own autograd.Function) on real tensors, so the op's dispatch buys nothing there and costs about
0.3 ms per call on the H200 machine (dispatcher, autograd and backend selection, the output aliasing
check): more than a small kernel takes. The wrapper calls these functions instead.
"""
from ..attention.op import flash_attention_impl
from ..attention.op import run_flash_attention as flash_attention  # noqa: F401
from ..attention.op import run_flash_attention_backward as flash_attention_backward  # noqa: F401
from ..losses.cross_entropy_op import run_cross_entropy as cross_entropy  # noqa: F401
from ..losses.cross_entropy_op import run_cross_entropy_backward as cross_entropy_backward  # noqa: F401
from ..losses.cross_entropy_op import cross_entropy_backward_over_logits  # noqa: F401
from ..losses.linear_cross_entropy import run_linear_cross_entropy as linear_cross_entropy  # noqa: F401


def flash_attention_out_only(*args, **kwargs):
    """flash_attention where the graph never reads the log-sum-exp (inference): (out, None), the
    statistics neither allocated nor stored."""
    return flash_attention_impl(*args, need_lse=False, **kwargs)
