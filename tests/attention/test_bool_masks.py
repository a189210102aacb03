"""Bool masks read by the attention kernels (True keeps a score, False makes it -inf, as a -inf fill
does): every kernel (pointer and TMA forward and backward, split-KV decode) against float64 autograd of
the same scores filled with -inf, and the graph of a -inf fill or an SDPA bool attn_mask handing the
kernel the bool tensor itself instead of an additive float mask built from it (one select per score
instead of the rounding-faithful sum: a padded SDPA forward was 0.86x SDPA on an H100 that way).
CPU tests run the kernels in the Triton interpreter (fp32 and fp16); the `gpu` test runs bf16 on Hopper."""
import pytest
import torch
import torch.nn.functional as F

import fxopt
from fxopt.attention.flash_decode import flash_decode
from fxopt.attention.flash_forward import flash_forward
from tests.helpers import compile_fxopt

from .test_flash_kernels import OUT_TOL, assert_close, check_backward, make_qkv, reference
from .test_flash_forward_tma import TMA, TMA_BACKWARD


def keep_masks(batch, heads, seq_q, seq_k, seed=0):
    """(key padding [B, 1, 1, Tk] keep mask, full [B, H, Tq, Tk] one), each expanded to [B, H, Tq, Tk];
    every query row keeps its first key (rows masked entirely: test_safe_softmax.py)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([seq_k - 3, max(1, seq_k // 3)])[:batch]
    padding = (torch.arange(seq_k)[None, :] < lengths[:, None])[:, None, None, :]
    full = torch.rand(batch, heads, seq_q, seq_k, generator=g) > 0.25
    full[..., 0] = True
    return padding.expand(batch, heads, seq_q, seq_k), full


def additive64(keep):
    return torch.zeros(keep.shape, dtype=torch.float64, device=keep.device).masked_fill(~keep, float("-inf"))


def check_forward_bool(q, k, v, keep, *, causal, config=None):
    scale = q.shape[-1] ** -0.5
    out, lse = flash_forward(q, k, v, scale=scale, causal=causal, mask=keep, config=config)
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), scale=scale, causal=causal,
                                 mask=additive64(keep))
    assert_close(out, ref_out, OUT_TOL[q.dtype])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(64, 64), (40, 56)])
def test_forward_kernels_read_bool_masks(kernel, causal, seq_q, seq_k):
    """Ragged lengths (loads past the end), GQA, a padding mask (one row per key block in the TMA kernel)
    and a full one."""
    q, k, v = make_qkv(2, 4, 2, seq_q, seq_k, 32, torch.float16, transposed=True, seed=seq_q)
    config = TMA if kernel == "tma" else dict(TMA=False)
    for keep in keep_masks(2, 4, seq_q, seq_k, seed=seq_k):
        check_forward_bool(q, k, v, keep, causal=causal, config=config)


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_kernels_read_bool_masks(kernel, causal):
    q, k, v = make_qkv(2, 4, 2, 40, 56, 32, torch.float16, transposed=True, seed=5)
    config = TMA_BACKWARD if kernel == "tma" else dict(TMA=False)
    for keep in keep_masks(2, 4, 40, 56, seed=1):
        check_backward(q, k, v, causal=causal, mask=keep, reference_mask=additive64(keep), config=config)


def test_pointer_kernels_read_bool_masks_in_float32():
    q, k, v = make_qkv(1, 2, 2, 37, 37, 16, torch.float32, seed=2)
    for keep in keep_masks(1, 2, 37, 37, seed=3):
        check_forward_bool(q, k, v, keep, causal=False)
        check_backward(q, k, v, causal=True, mask=keep, reference_mask=additive64(keep))


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_reads_bool_masks(splits):
    q, k, v = make_qkv(2, 4, 2, 2, 300, 32, torch.float32, seed=4)
    for keep in keep_masks(2, 4, 2, 300, seed=5):
        out, lse = flash_decode(q, k, v, scale=0.2, causal=False, mask=keep, num_splits=splits)
        ref_out, ref_lse = reference(q.double(), k.double(), v.double(), scale=0.2, causal=False,
                                     mask=additive64(keep))
        assert_close(out, ref_out, OUT_TOL[q.dtype])
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)


def test_a_masked_score_is_minus_inf_whatever_the_score():
    """A fill replaces the score: an infinite score (an inf in q) at a masked key leaves the row finite, where
    an added -inf mask would make it NaN (inf + -inf)."""
    q, k, v = make_qkv(1, 2, 2, 16, 16, 16, torch.float32, seed=6)
    k[0, :, 5, 0] = float("inf")
    q[..., 0] = q[..., 0].abs() + 0.5  # every score against key 5 is +inf
    keep = torch.ones(1, 2, 16, 16, dtype=torch.bool)
    keep[..., 5] = False
    out, lse = flash_forward(q, k, v, scale=0.25, causal=False, mask=keep)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    k_without = k.clone()
    k_without[0, :, 5] = 0.0
    ref, _ = flash_forward(q, k_without, v, scale=0.25, causal=False, mask=keep)
    torch.testing.assert_close(out, ref)


def _sdpa(q, k, v, keep):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _masked_fill(q, k, v, pad):
    return (q @ k.transpose(-2, -1) * 0.25).masked_fill(pad, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("fn", [_sdpa, _masked_fill], ids=lambda f: f.__name__.strip("_"))
def test_a_minus_inf_fill_hands_the_kernel_its_bool_mask(fn, monkeypatch):
    """The fused op receives the bool mask of the kept scores (the condition, negated for masked_fill's
    'True masks'), not a float where(...) of it, and the compiled result equals float64 eager."""
    from fxopt.attention import op as attention_op
    seen = []
    real = attention_op.flash_attention_impl

    def recording(q, k, v, mask, *args, **kwargs):
        seen.append(None if mask is None else mask.dtype)
        return real(q, k, v, mask, *args, **kwargs)
    monkeypatch.setattr(attention_op, "flash_attention_impl", recording)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 12, 16, generator=g) for _ in range(3))
    keep = keep_masks(2, 2, 12, 12, seed=9)[0][:, :1, :1].clone()  # [B, 1, 1, Tk]
    mask = keep if fn is _sdpa else ~keep
    assert fxopt.explain(fn, q, k, v, mask).attention[0].fused
    torch._dynamo.reset()
    got = compile_fxopt(fn)(q, k, v, mask)
    assert seen and set(seen) == {torch.bool}, seen
    want = fn(q.double(), k.double(), v.double(), mask)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
def test_gpu_bool_masks_bf16_tma_forward_and_backward():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA device of compute capability 9.0 or newer")
    for causal, (seq_q, seq_k) in ((False, (256, 256)), (True, (200, 300))):
        q, k, v = (t.cuda() for t in make_qkv(2, 8, 2, seq_q, seq_k, 128, torch.bfloat16, transposed=True, seed=9))
        for keep in keep_masks(2, 8, seq_q, seq_k, seed=2):
            keep = keep.cuda()
            check_forward_bool(q, k, v, keep, causal=causal)
            check_backward(q, k, v, causal=causal, mask=keep, reference_mask=additive64(keep).cuda())
