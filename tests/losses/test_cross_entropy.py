"""fxopt's fused cross-entropy: the kernels against float64 eager (forward, backward, ignore_index,
every reduction, ragged vocabularies, strided rows, the saved statistics, the loss's dtype), the
custom op's registration, and on the GPU a real vocabulary and the allocator requests of a loss step
(the pass through torch.compile: test_cross_entropy_pass.py). On the CPU the kernels run in the
Triton interpreter (conftest sets TRITON_INTERPRET=1), so shapes are tiny."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxopt  # noqa: F401 (backend="fxopt" in the GPU tests)
import fxopt.losses.cross_entropy_kernels as ce_kernels
from fxopt.losses.cross_entropy_kernels import cross_entropy_forward, cross_entropy_grad
from fxopt.losses.cross_entropy_op import cross_entropy, cross_entropy_op, reference_forward, reference_grad

IGNORE = -100
# the op computes in float32 from the logits as given: the loss is float32-accurate for every dtype;
# the gradient is rounded once to the logits' dtype
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.float16: dict(rtol=1e-3, atol=1e-6),
            torch.bfloat16: dict(rtol=8e-3, atol=1e-5)}


def make_logits(n, v, dtype, seed=0, scale=3.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * scale).to(dtype).to(device)


def make_target(n, v, ignored=(), seed=1, device="cpu"):
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    t[list(ignored)] = IGNORE
    return t.to(device)


def float64_loss_and_grad(logits, target, reduction, grad_out=None, **kwargs):
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x, target, reduction=reduction, **kwargs)
    grad_out = torch.ones_like(loss) if grad_out is None else grad_out.double()
    (grad,) = torch.autograd.grad(loss, x, grad_out)
    return loss.detach(), grad


def fused_loss_and_grad(logits, target, reduction, grad_out=None, ignore_index=IGNORE):
    x = logits.detach().requires_grad_()
    loss, _ = cross_entropy_op(x, target, ignore_index, reduction)
    grad_out = torch.ones_like(loss) if grad_out is None else grad_out
    (grad,) = torch.autograd.grad(loss, x, grad_out)
    return loss.detach(), grad


# ------------------------------------------------------------------ kernels vs float64 eager

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [33, 1000, 5000])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_forward_and_backward_match_float64(dtype, vocab, reduction):
    """Vocabularies that are not a multiple of the block (5000 loops over 5 blocks of 1024 in the
    interpreter, with a ragged last one), some rows ignored, a per-row upstream gradient for "none"."""
    logits, target = make_logits(6, vocab, dtype), make_target(6, vocab, ignored=(1, 4))
    grad_out = torch.randn(6) if reduction == "none" else None
    loss, grad = fused_loss_and_grad(logits, target, reduction, grad_out)
    ref_loss, ref_grad = float64_loss_and_grad(logits, target, reduction, grad_out)
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(loss.double(), ref_loss, **LOSS_TOL)
    torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[dtype])
    assert torch.all(grad[[1, 4]] == 0)  # ignored rows: no gradient


def test_stats_are_the_row_logsumexp_then_the_kept_row_count():
    """What the forward saves for the backward: each row's lse (-inf when ignored), then how many rows
    count towards "mean"."""
    logits, target = make_logits(5, 2000, torch.float32), make_target(5, 2000, ignored=(2,))
    for reduction in ("mean", "sum", "none"):
        _, stats = cross_entropy_forward(logits, target, IGNORE, reduction)
        ref = torch.logsumexp(logits.double(), dim=-1)
        keep = target != IGNORE
        assert stats.shape == (6,) and stats.dtype == torch.float32
        torch.testing.assert_close(stats[:5][keep].double(), ref[keep], **LOSS_TOL)
        assert stats[2] == float("-inf") and stats[5] == 4


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_sums_over_more_rows_than_one_block(monkeypatch, reduction):
    """The program that finishes the forward walks the rows in blocks (4 here, 11 rows: a ragged last
    block) and counts the kept ones across blocks."""
    monkeypatch.setattr(ce_kernels, "FINAL_BLOCK_R", 4)
    logits, target = make_logits(11, 90, torch.float16), make_target(11, 90, ignored=(0, 5, 10))
    loss, grad = fused_loss_and_grad(logits, target, reduction)
    ref_loss, ref_grad = float64_loss_and_grad(logits, target, reduction)
    torch.testing.assert_close(loss.double(), ref_loss, **LOSS_TOL)
    torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[torch.float16])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored_is_what_torch_gives(reduction):
    """mean over no rows is NaN (0 / 0) as in torch; the gradient is zero everywhere."""
    logits, target = make_logits(4, 100, torch.float32), torch.full((4,), IGNORE)
    loss, grad = fused_loss_and_grad(logits, target, reduction)
    ref_loss, ref_grad = float64_loss_and_grad(logits, target, reduction)
    torch.testing.assert_close(loss.double(), ref_loss, equal_nan=True)
    assert torch.equal(grad, torch.zeros_like(grad)) and torch.equal(ref_grad, torch.zeros_like(ref_grad))


def test_other_ignore_index_including_a_valid_class():
    """ignore_index may be a real class id (0 here): those rows are ignored, not scored."""
    logits = make_logits(6, 300, torch.float32)
    target = make_target(6, 300)
    target[[0, 3]] = 0
    loss, grad = fused_loss_and_grad(logits, target, "mean", ignore_index=0)
    ref_loss, ref_grad = float64_loss_and_grad(logits, target, "mean", ignore_index=0)
    torch.testing.assert_close(loss.double(), ref_loss, **LOSS_TOL)
    torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[torch.float32])


def test_strided_rows_and_transposed_logits():
    """A row-strided view (a column slice of a wider buffer) is read in place; logits whose last dim is
    not contiguous are copied once by the op and still give the right values."""
    wide = make_logits(6, 1500, torch.float32)
    sliced = wide[:, :1100]
    transposed = make_logits(1100, 6, torch.float32).t()
    target = make_target(6, 1100, ignored=(5,))
    for logits in (sliced, transposed):
        loss, grad = fused_loss_and_grad(logits, target, "mean")
        ref_loss, ref_grad = float64_loss_and_grad(logits, target, "mean")
        torch.testing.assert_close(loss.double(), ref_loss, **LOSS_TOL)
        torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[torch.float32])


def test_strided_target_is_read_at_its_stride():
    """A target column of a 2-D label tensor (`labels[:, 0]`, stride 2 here): the kernels read target[row]
    at stride 1, which gave a wrong loss (3.18 for 2.41) and gradient until the op made it contiguous."""
    logits = make_logits(6, 12, torch.float32)
    target = torch.randint(0, 11, (12,), generator=torch.Generator().manual_seed(5))[::2]
    assert target.stride(0) == 2
    for reduction in ("mean", "none"):
        loss, grad = fused_loss_and_grad(logits, target, reduction)
        ref_loss, ref_grad = float64_loss_and_grad(logits, target, reduction)
        torch.testing.assert_close(loss.double(), ref_loss, **LOSS_TOL)
        torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[torch.float32])


def test_extreme_logits_are_stable():
    """Large magnitudes (no overflow: the max is subtracted online) and -inf logits (a masked
    vocabulary), including a whole first block of -inf, which must not turn the running sum into NaN."""
    logits = make_logits(4, 2500, torch.float32, scale=1e4)
    logits[1, :1500] = float("-inf")
    logits[2, ::3] = float("-inf")
    target = torch.tensor([5, 2000, 4, 7])
    loss, grad = fused_loss_and_grad(logits, target, "none")
    ref_loss, ref_grad = float64_loss_and_grad(logits, target, "none")
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[torch.float32])


def test_target_out_of_range_gives_nan_loss():
    """Eager raises; a kernel cannot without a host sync, so the row's loss is NaN instead."""
    logits, target = make_logits(3, 50, torch.float32), torch.tensor([1, 50, IGNORE])
    rows, _ = cross_entropy_forward(logits, target, IGNORE, "none")
    assert torch.isnan(rows[1]) and torch.isfinite(rows[0]) and rows[2] == 0
    assert torch.isnan(cross_entropy_forward(logits, target, IGNORE, "mean")[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_torch_reference_matches_kernels(dtype, reduction):
    """CPU tensors without TRITON_INTERPRET run reference_forward / reference_grad: the same contract.
    The upstream gradient comes in the logits' dtype (as autograd makes it) and, for "none", as the
    stride-0 expand that loss.sum() gives."""
    logits, target = make_logits(5, 1300, dtype), make_target(5, 1300, ignored=(0,))
    loss, stats = cross_entropy_forward(logits, target, IGNORE, reduction)
    ref_loss, ref_stats = reference_forward(logits, target, IGNORE, reduction)
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)
    torch.testing.assert_close(stats, ref_stats, **LOSS_TOL)
    grad_loss = torch.tensor(0.7, dtype=dtype)
    grad_loss = grad_loss.expand(5) if reduction == "none" else grad_loss
    grad = cross_entropy_grad(logits, target, stats, grad_loss, IGNORE, reduction)
    ref = reference_grad(logits, target, stats, grad_loss, IGNORE, reduction)
    torch.testing.assert_close(grad.float(), ref.float(), **GRAD_TOL[dtype])


def test_public_function_returns_the_logits_dtype():
    logits, target = make_logits(4, 70, torch.bfloat16), make_target(4, 70)
    out = cross_entropy(logits, target)
    assert out.dtype == torch.bfloat16 and out.shape == ()
    torch.testing.assert_close(out.double(), F.cross_entropy(logits.double(), target), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_in_the_logits_dtype_is_the_float32_loss_rounded_once(reduction):
    """loss_dtype: the kernels store the float32 loss rounded to bf16 (what F.cross_entropy returns),
    and the backward takes a bf16 upstream gradient: the same gradient as with a float32 loss."""
    logits, target = make_logits(6, 700, torch.bfloat16), make_target(6, 700, ignored=(2,))
    loss32, _ = cross_entropy_op(logits, target, IGNORE, reduction)
    loss16, _ = cross_entropy_op(logits, target, IGNORE, reduction, torch.bfloat16)
    assert loss16.dtype == torch.bfloat16  # within one bf16 ulp (the interpreter truncates, a GPU rounds)
    torch.testing.assert_close(loss16.float(), loss32, rtol=2 ** -7, atol=0)
    grad_out = torch.randn(6).to(torch.bfloat16) if reduction == "none" else torch.tensor(1.5, dtype=torch.bfloat16)
    grads = []
    for loss_dtype in (None, torch.bfloat16):
        x = logits.clone().requires_grad_()
        loss, _ = cross_entropy_op(x, target, IGNORE, reduction, loss_dtype)
        grads.append(torch.autograd.grad(loss, x, grad_out.to(loss.dtype))[0])
    assert torch.equal(grads[0], grads[1])
    _, ref_grad = float64_loss_and_grad(logits, target, reduction, grad_out.float())
    torch.testing.assert_close(grads[1].double(), ref_grad, **GRAD_TOL[torch.bfloat16])


def test_custom_op_registration_passes_opcheck():
    """Schema, fake implementation, autograd registration and aot_dispatch agree with the real op."""
    logits = make_logits(4, 40, torch.float32).requires_grad_()
    target = make_target(4, 40, ignored=(2,))
    for reduction in ("mean", "none"):
        torch.library.opcheck(cross_entropy_op, (logits, target, IGNORE, reduction))
    torch.library.opcheck(cross_entropy_op, (logits.detach().half().requires_grad_(), target, IGNORE, "sum",
                                             torch.float16))


def test_invalid_reduction_raises():
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy_op(make_logits(2, 8, torch.float32), make_target(2, 8), IGNORE, "avg")


# ------------------------------------------------------------------ the real compiler

@pytest.mark.gpu
def test_gpu_bf16_4096_rows_32000_vocab():
    """bf16 logits at a real vocabulary size on the GPU, forward and backward, against float64."""
    logits = make_logits(4096, 32000, torch.bfloat16, device="cuda")
    target = make_target(4096, 32000, ignored=range(0, 4096, 97), device="cuda")
    loss, grad = fused_loss_and_grad(logits, target, "mean")
    ref_loss, ref_grad = float64_loss_and_grad(logits, target, "mean")
    torch.testing.assert_close(loss.double(), ref_loss, **LOSS_TOL)
    torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[torch.bfloat16])


def _allocator_requests(fn, *args) -> int:
    """Caching-allocator requests of one call of fn (after a warm call: compiled, caches filled)."""
    fn(*args)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    out = fn(*args)
    torch.cuda.synchronize()
    del out
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


def _loss_and_grad(spelling):
    def step(logits, target):
        x = logits.float() if spelling == "fp32" else logits
        loss = F.cross_entropy(x, target)
        return (loss, *_grad_outside_dynamo(loss, logits))
    return step


@torch.compiler.disable
def _grad_outside_dynamo(loss, logits):
    return torch.autograd.grad(loss, (logits,))


@pytest.mark.gpu
@pytest.mark.parametrize("spelling", ["bf16", "fp32"])
def test_gpu_fewer_allocator_requests_than_eager(spelling):
    """Issue 5: a loss step (forward, then the gradient through autograd) asks the caching allocator
    for fewer blocks than eager: the loss, the saved stats and the gradient (and the loss's cast back
    to bf16), no count, division or scale tensors of their own."""
    logits = make_logits(512, 4000, torch.bfloat16, device="cuda").requires_grad_()
    target = make_target(512, 4000, ignored=(3, 7), device="cuda")
    step = _loss_and_grad(spelling)
    eager = _allocator_requests(step, logits, target)
    fused = _allocator_requests(torch.compile(step, backend="fxopt"), logits, target)
    assert fused < eager, (fused, eager)
    loss, grad = torch.compile(step, backend="fxopt")(logits, target)
    ref_loss, ref_grad = float64_loss_and_grad(logits, target, "mean")
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[torch.bfloat16])
