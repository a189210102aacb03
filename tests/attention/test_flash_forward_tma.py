"""The TMA-descriptor forward and backward (flash_forward_tma.py, flash_backward_tma.py) against a
float64 reference, in the Triton interpreter (which emulates tensor descriptors) on float16 CPU
tensors; bfloat16 and the real copy engine are checked on the GPU by the tests marked `gpu`. Which
kernel runs is asserted too: TMA where the inputs allow it, the pointer kernel where they do not
(float32, a head dim of 80, a misaligned view); the forward reads additive masks through pointers."""
import pytest
import torch

from fxopt.attention import flash_forward_tma as tma_module
from fxopt.attention.flash_backward import flash_backward
from fxopt.attention.flash_common import backward_config
from fxopt.attention.flash_forward import flash_forward
from fxopt.attention.flash_forward_tma import tma_applies

from .test_flash_kernels import check_backward, check_forward, make_qkv, padding_mask

TMA = dict(TMA=True, BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
TMA_BACKWARD = dict(TMA=True, DKDV_BLOCK_M=16, DKDV_BLOCK_N=32, DQ_BLOCK_M=32, DQ_BLOCK_N=16, num_warps=4,
                    num_stages=1)


def _count_calls(monkeypatch, where: str, real) -> list:
    """Replace `where` (module.name) with a wrapper of `real` that records each call."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(where, counting)
    return calls


@pytest.fixture
def tma_calls(monkeypatch):
    """Calls of the TMA forward."""
    return _count_calls(monkeypatch, "fxopt.attention.flash_forward.flash_forward_tma", tma_module.flash_forward_tma)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(64, 64), (40, 40), (40, 56), (1, 37)])
def test_tma_forward_matches_float64(seq_q, seq_k, causal, tma_calls):
    """Even and ragged lengths (zero-filled tiles past the end, dropped stores), Tq < Tk bottom-right
    causal; GQA 4 query heads on 2 kv heads; [B, T, H, D] views read in place. A single decode row is
    shorter than the query tile: the pointer kernel takes it."""
    q, k, v = make_qkv(2, 4, 2, seq_q, seq_k, 32, torch.float16, transposed=True, seed=seq_q + seq_k)
    check_forward(q, k, v, causal=causal, config=TMA)
    assert len(tma_calls) == (seq_q >= TMA["BLOCK_M"])


def test_tma_forward_head_dim_64_contiguous(tma_calls):
    q, k, v = make_qkv(1, 2, 2, 48, 48, 64, torch.float16, seed=3)
    check_forward(q, k, v, causal=True, config=dict(TMA, BLOCK_N=32))
    assert len(tma_calls) == 1


def test_inputs_tma_cannot_read_take_the_pointer_kernel(tma_calls):
    q, k, v = make_qkv(1, 2, 2, 32, 32, 32, torch.float16, seed=4)
    check_forward(*(t.float() for t in (q, k, v)), causal=True, config=TMA)  # float32
    q80, k80, v80 = make_qkv(1, 2, 2, 32, 32, 80, torch.float16, seed=5)
    check_forward(q80, k80, v80, causal=True, config=TMA)  # head dim not a power of two
    wide = torch.randn(1, 2, 32, 33).to(torch.float16)[..., 1:]  # rows of 66 bytes: strides not 16-byte multiples
    check_forward(wide, k, v, causal=False, config=TMA)
    assert tma_calls == []
    assert not tma_applies(wide, k, v) and tma_applies(q, k, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(64, 64), (40, 56)])
def test_tma_forward_reads_masks(seq_q, seq_k, causal, tma_calls):
    """A key padding mask broadcast over the queries (read as one row per key block) and a full
    [B, H, Tq, Tk] mask with -inf entries (read as tiles), ragged lengths, GQA."""
    q, k, v = make_qkv(2, 4, 2, seq_q, seq_k, 32, torch.float16, transposed=True, seed=seq_q + 7)
    check_forward(q, k, v, causal=causal, mask=padding_mask(2, 4, seq_q, seq_k, [seq_k - 5, 9]), config=TMA)
    g = torch.Generator().manual_seed(seq_k)
    full = torch.randn(2, 4, seq_q, seq_k, generator=g).masked_fill(torch.rand(2, 4, seq_q, seq_k, generator=g) < 0.2,
                                                                    float("-inf"))
    full[..., 0] = full[..., -1] = 0.0  # every row keeps a key (rows masked entirely: test_safe_softmax.py)
    check_forward(q, k, v, causal=causal, mask=full.to(torch.float16), config=TMA)
    assert len(tma_calls) == 2


def test_tma_forward_safe_softmax_zeroes_rows_masked_entirely(tma_calls):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float16, seed=11)
    mask = padding_mask(1, 2, 64, 64, [40]).clone()
    mask[0, :, 5] = float("-inf")
    out, lse = flash_forward(q, k, v, scale=0.2, causal=False, mask=mask, config=TMA, safe_softmax=True)
    assert len(tma_calls) == 1
    assert (out[0, :, 5] == 0).all() and torch.isposinf(lse[0, :, 5]).all()
    keep = torch.ones(64, dtype=torch.bool)
    keep[5] = False
    ref, _ = flash_forward(q.float(), k.float(), v.float(), scale=0.2, causal=False, mask=mask.float())
    torch.testing.assert_close(out[:, :, keep].float(), ref[:, :, keep], rtol=2e-3, atol=2e-3)


def test_negative_scale_takes_the_pointer_kernel(tma_calls):
    """The mask-free loop takes max(s) * scale as the row max, right only for a positive scale."""
    q, k, v = make_qkv(1, 2, 2, 32, 32, 32, torch.float16, seed=6)
    check_forward(q, k, v, causal=False, scale=-0.2, config=TMA)
    assert tma_calls == []


@pytest.fixture
def tma_backward_calls(monkeypatch):
    """Calls of the TMA backward."""
    from fxopt.attention.flash_backward_tma import flash_backward_tma
    return _count_calls(monkeypatch, "fxopt.attention.flash_backward.flash_backward_tma", flash_backward_tma)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(64, 64), (37, 37), (40, 70)])
def test_tma_backward_matches_float64_autograd(seq_q, seq_k, causal, tma_backward_calls):
    """dq, dk, dv through descriptors: ragged lengths on both axes, Tq < Tk, GQA 4 on 2 (dK/dV summed
    over the group), transposed q, k, v and dout."""
    q, k, v = make_qkv(2, 4, 2, seq_q, seq_k, 32, torch.float16, transposed=True, seed=seq_q * seq_k)
    dout = torch.randn(2, seq_q, 4, 32, generator=torch.Generator().manual_seed(5)).to(torch.float16).transpose(1, 2)
    check_backward(q, k, v, causal=causal, dout=dout, config=TMA_BACKWARD)
    assert len(tma_backward_calls) == 1


def test_tma_backward_default_is_16_bit_gpu_inputs_up_to_head_dim_128():
    assert backward_config(128, True, torch.bfloat16, 2048, 2048, "cuda")["TMA"]
    assert backward_config(64, False, torch.float16, 2048, 2048, "cuda")["TMA"]
    assert not backward_config(256, True, torch.bfloat16, 2048, 2048, "cuda")["TMA"]
    assert not backward_config(128, True, torch.float32, 2048, 2048, "cuda")["TMA"]
    assert not backward_config(128, True, torch.float16, 2048, 2048, "cpu")["TMA"]


def test_short_sequences_default_to_the_pointer_kernels():
    """Launch-bound calls (either sequence under TMA_MIN_SEQ) skip the descriptors' host cost."""
    from fxopt.attention.flash_common import TMA_MIN_SEQ, forward_config
    for config in (forward_config, backward_config):
        assert config(64, True, torch.bfloat16, TMA_MIN_SEQ, TMA_MIN_SEQ, "cuda")["TMA"]
        assert not config(64, True, torch.bfloat16, 16, 16, "cuda")["TMA"]
        assert not config(64, False, torch.bfloat16, 4096, TMA_MIN_SEQ - 1, "cuda")["TMA"]


def test_tma_backward_is_off_on_the_cpu_by_default(tma_backward_calls):
    q, k, v = make_qkv(1, 2, 2, 32, 32, 32, torch.float16, seed=8)
    check_backward(q, k, v, causal=True)  # the CPU default config: pointer kernels
    assert tma_backward_calls == []


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(64, 64), (40, 56)])
def test_tma_backward_reads_masks(seq_q, seq_k, causal, tma_backward_calls):
    """As the forward: a key padding mask (one row per key block) and a full [B, H, Tq, Tk] mask with -inf
    entries, ragged lengths on both axes, GQA; until 2026-12-05 a mask sent the backward to the pointer
    kernels."""
    q, k, v = make_qkv(2, 4, 2, seq_q, seq_k, 32, torch.float16, transposed=True, seed=seq_q + 3)
    check_backward(q, k, v, causal=causal, mask=padding_mask(2, 4, seq_q, seq_k, [seq_k - 5, 9]),
                   config=TMA_BACKWARD)
    g = torch.Generator().manual_seed(seq_q)
    full = torch.randn(2, 4, seq_q, seq_k, generator=g).masked_fill(torch.rand(2, 4, seq_q, seq_k, generator=g) < 0.2,
                                                                    float("-inf"))
    full[..., 0] = full[..., -1] = 0.0
    check_backward(q, k, v, causal=causal, mask=full.to(torch.float16), config=TMA_BACKWARD)
    assert len(tma_backward_calls) == 2


def test_tma_backward_of_a_fill_masked_empty_row_is_eagers(tma_backward_calls):
    """A -inf fill that masks query row 5 entirely: eager's masked_fill backward gives the row 0 in dq and
    nothing to dk (dv is NaN from the NaN probabilities), as the pointer kernels do (zero_empty_rows)."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float16, seed=12)
    keep = torch.rand(1, 1, 64, 64, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[..., 0] = True
    keep[..., 5, :] = False
    mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).to(torch.float16).expand(1, 2, 64, 64)
    out, lse = flash_forward(q, k, v, scale=0.25, causal=False, mask=mask)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    grads = flash_backward(dout, q, k, v, out, lse, scale=0.25, causal=False, mask=mask, config=TMA_BACKWARD,
                           zero_empty_rows=True)
    assert len(tma_backward_calls) == 1
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = (leaves[0] @ leaves[1].transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")).softmax(-1) @ leaves[2]
    want = torch.autograd.grad(ref, leaves, dout.double())
    assert (grads[0][0, :, 5] == 0).all() and not grads[1].isnan().any()
    for got, ref_grad in zip(grads, want):
        torch.testing.assert_close(got.double(), ref_grad, rtol=1e-2, atol=1e-2, equal_nan=True)


@pytest.mark.gpu
def test_gpu_tma_backward_bf16_matches_float64():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA device of compute capability 9.0 or newer")
    config = dict(TMA=True, DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, DQ_BLOCK_M=64, DQ_BLOCK_N=64, num_warps=4,
                  num_stages=2)
    for causal, (seq_q, seq_k) in ((True, (256, 256)), (True, (200, 300)), (False, (129, 1000))):
        q, k, v = (t.cuda() for t in make_qkv(2, 8, 2, seq_q, seq_k, 128, torch.bfloat16, transposed=True, seed=9))
        check_backward(q, k, v, causal=causal, config=config)


@pytest.mark.gpu
def test_gpu_tma_backward_bf16_reads_masks(tma_backward_calls):
    """The TMA backward with a key padding mask (one row per key block) and a full mask, through the
    default GPU config (TMA for 16-bit inputs up to head dim 128); unmeasured when written (2026-12-05)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA device of compute capability 9.0 or newer")
    for seq_q, seq_k in ((256, 256), (200, 300)):
        q, k, v = (t.cuda() for t in make_qkv(2, 8, 2, seq_q, seq_k, 128, torch.bfloat16, transposed=True, seed=9))
        config = backward_config(128, False, torch.bfloat16, seq_q, seq_k, "cuda")
        assert config["TMA"]
        check_backward(q, k, v, causal=False, mask=padding_mask(2, 8, seq_q, seq_k, [seq_k - 50, 77]).cuda(),
                       config=config)
        g = torch.Generator().manual_seed(1)
        full = torch.randn(2, 8, seq_q, seq_k, generator=g).masked_fill(
            torch.rand(2, 8, seq_q, seq_k, generator=g) < 0.2, float("-inf"))
        full[..., 0] = 0.0
        check_backward(q, k, v, causal=True, mask=full.to(torch.bfloat16).cuda(), config=config)
    assert len(tma_backward_calls) == 4


@pytest.mark.gpu
def test_gpu_tma_forward_bf16_is_the_default_and_matches_float64():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA device of compute capability 9.0 or newer")
    for causal, (seq_q, seq_k) in ((True, (256, 256)), (True, (200, 300)), (False, (129, 1000))):
        q, k, v = (t.cuda() for t in make_qkv(2, 8, 2, seq_q, seq_k, 128, torch.bfloat16, transposed=True, seed=9))
        assert tma_applies(q, k, v)
        check_forward(q, k, v, causal=causal)


def test_descriptor_matches_triton_checked_constructor():
    """descriptor() skips TensorDescriptor's checks (the callers made them): same fields as the checked way."""
    from dataclasses import fields

    from fxopt.attention.flash_forward_tma import TensorDescriptor, descriptor
    q = make_qkv(1, 2, 2, 64, 64, 32, torch.float16, transposed=True, seed=1)[0]
    fast = descriptor(q, 32)
    checked = TensorDescriptor(q, list(q.shape), list(q.stride()), [1, 1, 32, 32])
    for f in fields(TensorDescriptor):
        a, b = getattr(fast, f.name), getattr(checked, f.name)
        assert a is b if f.name == "base" else a == b, f.name
