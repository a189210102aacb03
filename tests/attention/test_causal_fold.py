"""flash_forward's `causal_fold`: a causal step with a finite fill beside a padding mask
(attention_masks.fold_finite_causal), folded into the mask by the kernel ("replaces", "adds") or held by
the mask already ("in_mask"); a query block skips the key blocks above its diagonal unless one of its rows
sees no real score below it (a left-padded row, which eager averages over the keys at the fill, future
ones included). Against float64 softmax over the same mask, in the
Triton interpreter: the pointer kernel in float32 and float16, the TMA kernel in float16 (the interpreter
emulates its descriptors); bfloat16 and the real compiler on the GPU (`-k cuda` has nothing here: the
kernels run through the fused op in tests/attention/test_folded_causal_fill.py there)."""
from __future__ import annotations

import pytest
import torch

from fxopt.analysis.attention_masks import FOLDED_FILL
from fxopt.attention.flash_backward import flash_backward
from fxopt.attention.flash_forward import flash_forward
from fxopt.attention.reference import with_causal_fold

from .test_flash_kernels import GRAD_TOL, OUT_TOL, assert_close, make_qkv

POINTER = dict(TMA=False, BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
TMA = dict(TMA=True, BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
BACKWARD = dict(DKDV_BLOCK_M=16, DKDV_BLOCK_N=16, DQ_BLOCK_M=16, DQ_BLOCK_N=16, num_warps=4, num_stages=1)


def padding(batch, seq_k, pad, fill=float("-inf")):
    """[B, 1, 1, Tk] additive: batch 0's first `pad` keys get `fill`."""
    mask = torch.zeros(batch, 1, 1, seq_k)
    mask[0, ..., :pad] = fill
    return mask


def folded_mask(batch, seq_q, seq_k, pad, fold="in_mask"):
    """(the mask the kernel reads, the mask eager's scores get) for `where(tril, s, finfo.min) + padding`
    ("adds", and "in_mask": what the graph builds for an additive causal tensor), or padding then the
    causal where ("replaces", with a padding of finfo.min: a padded row averages its visible keys and the
    future ones; README, Attention, known difference (2) says why not -1e4)."""
    read = padding(batch, seq_k, pad, FOLDED_FILL if fold == "replaces" else float("-inf"))
    full = with_causal_fold(read, "adds" if fold == "in_mask" else fold, FOLDED_FILL, seq_q, seq_k)
    return (full if fold == "in_mask" else read), full


def reference(q, k, v, mask, scale):
    s = scale * q.double() @ k.double().mT + mask.double()
    return torch.softmax(s, -1) @ v.double()


def run(q, k, v, mask, config, fold="in_mask"):
    full = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return flash_forward(q, k, v, scale=0.3, causal=False, mask=full, config=config, causal_fold=fold,
                         causal_fill=FOLDED_FILL)


FOLDS = ["in_mask", "adds", "replaces"]


@pytest.mark.parametrize("seq_q,seq_k", [(64, 64), (77, 77), (40, 64), (48, 61)])
@pytest.mark.parametrize("pad", [0, 5, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fold", FOLDS)
def test_pointer_kernel_matches_float64(seq_q, seq_k, pad, dtype, fold):
    """Even and ragged key ends, Tq < Tk (bottom-right), rows with no real score in the first one or two
    query blocks (pad 5, 20: batch 0's first keys hidden), and none (pad 0)."""
    q, k, v = make_qkv(2, 2, 2, seq_q, seq_k, 16, dtype, seed=seq_q + pad)
    read, full = folded_mask(2, seq_q, seq_k, pad, fold)
    out, lse = run(q, k, v, read, POINTER, fold)
    assert out.isfinite().all()
    assert_close(out, reference(q, k, v, full, 0.3), OUT_TOL[dtype])
    want_lse = torch.logsumexp(0.3 * q.double() @ k.double().mT + full.double(), -1)
    finite = want_lse > -1e30  # (a row averaging the fill has lse near finfo.min: the kernel's is its own level)
    assert_close(lse[finite], want_lse[finite], OUT_TOL[dtype])


@pytest.mark.parametrize("seq_q,seq_k", [(64, 64), (48, 61)])
@pytest.mark.parametrize("pad", [0, 20])
@pytest.mark.parametrize("fold", FOLDS)
def test_tma_kernel_matches_float64(seq_q, seq_k, pad, fold, monkeypatch):
    from fxopt.attention import flash_forward_tma as tma_module
    calls = []
    monkeypatch.setattr("fxopt.attention.flash_forward.flash_forward_tma",
                        lambda *a, **kw: calls.append(1) or tma_module.flash_forward_tma(*a, **kw))
    q, k, v = make_qkv(2, 2, 2, seq_q, seq_k, 16, torch.float16, transposed=True, seed=seq_k + pad)
    read, full = folded_mask(2, seq_q, seq_k, pad, fold)
    out, _ = run(q, k, v, read, TMA, fold)
    assert calls, "the TMA kernel did not run"
    assert out.isfinite().all()
    assert_close(out, reference(q, k, v, full, 0.3), OUT_TOL[torch.float16])


@pytest.mark.parametrize("config", [POINTER, TMA], ids=["pointer", "tma"])
@pytest.mark.parametrize("fold", FOLDS)
def test_blocks_above_the_diagonal_are_skipped_where_every_row_sees_a_real_score(config, fold, monkeypatch):
    """Values NaN from key 32 on: with the skip, the query blocks ending before key 32 never read them
    (their rows are finite and right); without it, every row visits every key and is NaN (0 * NaN). Batch
    0's left-padded rows (query block 0) must visit the future keys: NaN there, as in eager (whose weights
    for those keys are not 0 in these rows alone). The materialized mask without the fold skips the same
    blocks through its key ranges (mask_blocks.py), and without those it visits them."""
    q, k, v = make_qkv(2, 2, 2, 64, 64, 16, torch.float16, seed=7)
    read, full = folded_mask(2, 64, 64, 4, fold)
    want = reference(q, k, v, full, 0.3)  # before the NaN: keys 32 on weigh 0 in rows before 32 but 0-3
    v[:, :, 32:] = float("nan")
    out, _ = run(q, k, v, read, config, fold)
    assert_close(out[1, :, :32], want[1, :, :32], OUT_TOL[torch.float16])
    assert_close(out[0, :, 16:32], want[0, :, 16:32], OUT_TOL[torch.float16])
    assert out[0, :, :4].isnan().all()  # rows 0-3 see only padding: they average every key, as eager
    ranged, _ = flash_forward(q, k, v, scale=0.3, causal=False, mask=full.expand(2, 2, 64, 64), config=config)
    assert_close(ranged[1, :, :32], want[1, :, :32], OUT_TOL[torch.float16])
    monkeypatch.setattr("fxopt.attention.mask_blocks.MIN_KEY_BLOCKS", 1000)
    unskipped, _ = flash_forward(q, k, v, scale=0.3, causal=False, mask=full.expand(2, 2, 64, 64), config=config)
    assert unskipped[1, :, :32].isnan().all()


def fold_backward(dout, q, k, v, read, fold, tma):
    out, lse = run(q, k, v, read, POINTER, fold)
    return flash_backward(dout, q, k, v, out, lse, scale=0.3, causal=False, mask=read.expand(*q.shape[:3], k.shape[2]),
                          config=dict(BACKWARD, TMA=tma), causal_fold=fold, causal_fill=FOLDED_FILL)


def reference_grads(q, k, v, full, dout):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, full, 0.3).backward(dout.double())
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("seq_q,seq_k", [(48, 61), (64, 64)])
@pytest.mark.parametrize("pad", [0, 20])
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("fold", FOLDS)
def test_backward_folds_the_fill_as_the_forward(fold, tma, pad, seq_q, seq_k):
    """dq, dk, dv with the fold applied by the backward kernels against float64 autograd over the mask it
    stands for. Batch 0's first `pad` keys hidden: its rows with no real score (the first 20 or 33 queries,
    in two or three query blocks) make both backward kernels visit their blocks above the diagonal; their dq
    and dk are README, Attention, known difference (1), so there only dv and batch 1's gradients are compared."""
    dtype = torch.float16 if tma else torch.float32
    q, k, v = make_qkv(2, 2, 2, seq_q, seq_k, 16, dtype, transposed=tma, seed=3 + pad)
    read, full = folded_mask(2, seq_q, seq_k, pad, fold)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    dq, dk, dv = fold_backward(dout, q, k, v, read, fold, tma)
    want_dq, want_dk, want_dv = reference_grads(q, k, v, full, dout)
    assert_close(dv, want_dv, GRAD_TOL[dtype])
    checked = slice(None) if pad == 0 else slice(1, 2)
    assert_close(dq[checked], want_dq[checked], GRAD_TOL[dtype])
    assert_close(dk[checked], want_dk[checked], GRAD_TOL[dtype])


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("fold", FOLDS)
def test_backward_skips_the_future_tiles_where_every_row_sees_a_real_score(fold, tma):
    """The backward's skip, proved by NaN the skipped tiles would read. dK/dV: dout NaN in rows 0-31 reaches
    the keys from 32 on only through the tiles above the diagonal (exact zeros in eager), so those keys' dk and
    dv stay finite and right in the batch without padding; batch 0's left-padded rows (0-3) need those tiles:
    NaN reaches its keys. dQ: keys from 32 on NaN reach rows 0-31 only through those tiles (the forward skips
    them too), so those rows' dq stays finite and right; batch 0's padded rows are NaN, as in eager."""
    dtype = torch.float16 if tma else torch.float32
    q, k, v = make_qkv(2, 2, 2, 64, 64, 16, dtype, transposed=tma, seed=11)
    read, full = folded_mask(2, 64, 64, 4, fold)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    quiet = dout.clone()
    quiet[:, :, :32] = 0  # (changes no gradient of the keys from 32 on: their tiles with rows 0-31 weigh 0)
    _, want_dk, want_dv = reference_grads(q, k, v, full, quiet)
    dout[:, :, :32] = float("nan")
    _, dk, dv = fold_backward(dout, q, k, v, read, fold, tma)
    assert_close(dk[1, :, 32:], want_dk[1, :, 32:], GRAD_TOL[dtype])
    assert_close(dv[1, :, 32:], want_dv[1, :, 32:], GRAD_TOL[dtype])
    assert dv[0, :, 32:].isnan().all()

    want_dq, _, _ = reference_grads(q, k, v, full, dout.nan_to_num())
    k[:, :, 32:] = float("nan")
    dq, _, _ = fold_backward(dout.nan_to_num(), q, k, v, read, fold, tma)
    assert_close(dq[1, :, :32], want_dq[1, :, :32], GRAD_TOL[dtype])
    assert_close(dq[0, :, 16:32], want_dq[0, :, 16:32], GRAD_TOL[dtype])
    assert dq[0, :, :4].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [0, 40])
@pytest.mark.parametrize("fold", FOLDS)
def test_gpu_bf16_hd128_default_config(pad, fold):
    """The real compiler (TMA where the GPU has it), bfloat16, head dim 128, the default blocks: right
    against float64, and keys 128 on (NaN values) never read by the query blocks before row 128 of the
    batch without padding (every default block divides 128)."""
    q, k, v = (t.cuda() for t in make_qkv(2, 4, 4, 256, 256, 128, torch.bfloat16, transposed=True, seed=pad))
    read, full = (t.cuda() for t in folded_mask(2, 256, 256, pad, fold))
    want = reference(q, k, v, full, 0.3)
    out, _ = run(q, k, v, read, None, fold)
    assert_close(out, want, OUT_TOL[torch.bfloat16])
    v[:, :, 128:] = float("nan")
    out, _ = run(q, k, v, read, None, fold)
    assert_close(out[1, :, :128], want[1, :, :128], OUT_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("fold", FOLDS)
def test_gpu_bf16_hd128_backward(fold):
    """The real compiler's backward (TMA where the GPU has it) with the fold, bfloat16, head dim 128."""
    q, k, v = (t.cuda() for t in make_qkv(2, 4, 4, 256, 256, 128, torch.bfloat16, transposed=True, seed=9))
    read, full = (t.cuda() for t in folded_mask(2, 256, 256, 0, fold))
    out, lse = run(q, k, v, read, None, fold)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).cuda()
    grads = flash_backward(dout, q, k, v, out, lse, scale=0.3, causal=False, mask=read.expand(2, 4, 256, 256),
                           causal_fold=fold, causal_fill=FOLDED_FILL)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, full, 0.3).backward(dout.double())
    for got, leaf in zip(grads, leaves):
        assert_close(got, leaf.grad, GRAD_TOL[torch.bfloat16])
