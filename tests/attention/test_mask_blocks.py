"""A runtime mask's visible key ranges (fxopt/attention/mask_blocks.py) and the forward that walks only them.

The ranges against a torch computation of the same tiles; the forward against float64 softmax over masks
model code builds at run time (HF Llama's 4-D causal + padding mask from `attention_mask`, a sliding window,
right-padded keys), with NaN values in the keys a skipped block holds to prove the skip, and rows whose
visible keys are all dropped (left padding), which must still average every key as eager does. Kernels in
the Triton interpreter (pointer kernel in float32 and float16, the TMA kernel in float16); on the GPU through
the fused op in the model tests."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxopt.attention.flash_backward import flash_backward
from fxopt.attention.flash_forward import flash_forward
from fxopt.attention.mask_blocks import drop_threshold, visible_ranges

from .test_flash_kernels import GRAD_TOL, OUT_TOL, assert_close, make_qkv

POINTER = dict(TMA=False, BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
TMA = dict(TMA=True, BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
BACKWARD = dict(DKDV_BLOCK_M=16, DKDV_BLOCK_N=16, DQ_BLOCK_M=16, DQ_BLOCK_N=16, num_warps=4, num_stages=1)


def expected_ranges(mask, block_m, block_n, dtype, by_keys, seq_q):
    """(lo, whole_lo, whole_hi, hi) per block from the mask's own tiles, in torch: keys per query block, or
    (by_keys) rows per key block; seq_q: the queries the mask is expanded to."""
    keep = mask if mask.dtype == torch.bool else ~(mask.float() <= drop_threshold(dtype))
    whole = mask if mask.dtype == torch.bool else mask == 0
    b, h, tq, tk = keep.shape
    bm = block_m if tq > 1 else 1
    unit, span = (block_n, tk) if not by_keys else (bm, seq_q)

    def tiles(elements, reduce):
        padded = F.pad(elements, (0, -tk % block_n, 0, -tq % bm), value=False)
        shaped = padded.reshape(b, h, padded.shape[2] // bm, bm, padded.shape[3] // block_n, block_n)
        per_tile = reduce(reduce(shaped, 3), -1)
        return per_tile.transpose(2, 3) if by_keys else per_tile

    seen_tiles, whole_tiles = tiles(keep, torch.any), tiles(whole, torch.all)
    ends = lambda j: span if j == seen_tiles.shape[3] else j * unit  # noqa: E731
    out = torch.zeros(*seen_tiles.shape[:3], 4, dtype=torch.int32)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in seen_tiles.shape[:3])):
        seen = seen_tiles[tuple(idx)].nonzero()
        if not len(seen):
            continue
        lo, hi = seen.min().item() * unit, ends(seen.max().item() + 1)
        runs, start = [], None  # the runs of whole tiles: the longest, the first among equals
        for j, full in enumerate(whole_tiles[tuple(idx)].tolist() + [False]):
            start = (j if start is None else start) if full else None
            if start is not None:
                runs.append((j + 1 - start, -start, j + 1))
        if runs:
            length, neg_start, stop = max(runs)
            out[tuple(idx)] = torch.tensor([lo, -neg_start * unit, ends(stop), hi], dtype=torch.int32)
        else:
            out[tuple(idx)] = torch.tensor([lo, lo, lo, hi], dtype=torch.int32)
    return out


def llama_mask(batch, seq, pad_left, pad_right, dtype=torch.float32, fill=None):
    """transformers' 4-D additive mask [B, 1, T, T]: finfo.min above the diagonal and at padded keys;
    batch 0 padded on the left, batch 1 on the right."""
    fill = torch.finfo(dtype).min if fill is None else fill
    keep = torch.ones(batch, seq, dtype=torch.bool)
    keep[0, :pad_left] = False
    keep[1, seq - pad_right:] = False
    visible = torch.ones(seq, seq, dtype=torch.bool).tril() & keep[:, None, None, :]
    return torch.zeros(batch, 1, seq, seq, dtype=dtype).masked_fill(~visible, fill)


def reference(q, k, v, mask, scale=0.3):
    s = scale * q.double() @ k.double().mT
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, -1) @ v.double()


def run(q, k, v, mask, config, **kw):
    return flash_forward(q, k, v, scale=0.3, causal=False, mask=mask.expand(*q.shape[:3], k.shape[2]),
                         config=config, **kw)[0]


@pytest.mark.parametrize("shape", [(2, 1, 64, 64), (2, 3, 45, 77), (2, 1, 1, 70), (1, 2, 16, 16)])
@pytest.mark.parametrize("kind", ["finfo", "inf", "bool", "fp16_min", "nan"])
def test_ranges_match_the_masks_tiles(shape, kind):
    """Random banded masks (some rows' keys all dropped), broadcast heads and queries, ragged ends; NaN is
    kept; fp16's -65504 drops only beside fp16 inputs. Key ranges per query block and query ranges per key
    block."""
    g = torch.Generator().manual_seed(sum(shape))
    b, h, tq, tk = shape
    first = torch.randint(0, tk, (b, h, tq, 1), generator=g)
    width = torch.randint(0, tk // 2 + 1, (b, h, tq, 1), generator=g)
    cols = torch.arange(tk)
    keep = (cols >= first) & (cols < first + width)
    fill = {"finfo": torch.finfo(torch.float32).min, "inf": float("-inf"), "fp16_min": -65504.0, "nan": -1e9}
    mask = keep if kind == "bool" else torch.zeros(shape).masked_fill(~keep, fill.get(kind, 0.0))
    if kind == "nan":
        mask[..., :, 3] = float("nan")
    expanded = mask.expand(b, 4 if h == 1 else h, tq if tq > 1 else 33, tk)
    for dtype in (torch.float16, torch.bfloat16):
        for by_keys in (False, True):
            got, _ = visible_ranges(expanded, 16, 16, dtype, by_keys)
            assert torch.equal(got, expected_ranges(mask, 16, 16, dtype, by_keys, expanded.shape[2])), (kind, by_keys)
    if kind == "fp16_min":
        got, _ = visible_ranges(mask, 16, 16, torch.bfloat16)
        assert (got[..., 0] == 0).all() and (got[..., 3] == tk).all()  # -65504 kept beside bf16


@pytest.mark.parametrize("seq", [64, 77])
@pytest.mark.parametrize("pads", [(0, 0), (5, 9), (20, 30)])
@pytest.mark.parametrize("dtype,config", [(torch.float32, POINTER), (torch.float16, POINTER), (torch.float16, TMA)],
                         ids=["fp32", "fp16", "fp16-tma"])
def test_llama_mask_matches_float64(seq, pads, dtype, config):
    """HF Llama's mask: the forward walks each query block's visible range (the causal diagonal; from the
    first unpadded key), and rows whose visible keys are all padding (batch 0's first pad_left rows) average
    every key at the fill, future ones included, as eager does."""
    q, k, v = make_qkv(2, 2, 2, seq, seq, 16, dtype, transposed=config["TMA"], seed=seq + pads[0])
    mask = llama_mask(2, seq, *pads, dtype=torch.float32)
    out = run(q, k, v, mask, config)
    assert out.isfinite().all()
    assert_close(out, reference(q, k, v, mask), OUT_TOL[dtype])


@pytest.mark.parametrize("config", [POINTER, TMA], ids=["pointer", "tma"])
def test_blocks_outside_the_range_are_not_read(config, monkeypatch):
    """NaN values in keys a query block's range leaves out: the future keys (from key 32 on, for rows before
    32), and keys before a sliding window of 16: those rows stay finite and right. Batch 0's left-padded rows
    (0-3) need every key: NaN, as in eager."""
    q, k, v = make_qkv(2, 2, 2, 64, 64, 16, torch.float16, seed=5)
    mask = llama_mask(2, 64, 4, 0)
    want = reference(q, k, v, mask)
    poisoned = v.clone()
    poisoned[:, :, 32:] = float("nan")
    out = run(q, k, poisoned, mask, config)
    assert_close(out[1, :, :32], want[1, :, :32], OUT_TOL[torch.float16])
    assert_close(out[0, :, 16:32], want[0, :, 16:32], OUT_TOL[torch.float16])
    assert out[0, :, :4].isnan().all()
    monkeypatch.setenv("FXOPT_MASK_RANGES", "0")  # the escape hatch: every key block walked
    assert run(q, k, poisoned, mask, config)[1, :, :32].isnan().all()
    monkeypatch.delenv("FXOPT_MASK_RANGES")

    rows, cols = torch.arange(64)[:, None], torch.arange(64)
    window = (cols <= rows) & (cols > rows - 16)
    mask = torch.zeros(1, 1, 64, 64).masked_fill(~window, float("-inf"))
    want = reference(q, k, v, mask)
    poisoned = v.clone()
    poisoned[:, :, :16] = float("nan")
    out = run(q, k, poisoned, mask, config)
    assert_close(out[:, :, 32:], want[:, :, 32:], OUT_TOL[torch.float16])  # (rows 32 on see keys from 17)


def test_the_environment_turns_ranges_off_or_on_at_any_length(monkeypatch):
    """FXOPT_MASK_RANGES: 0 never, all at any number of key blocks, else from MIN_KEY_BLOCKS; never without a
    mask or beside a causal site."""
    from fxopt.attention.mask_blocks import MIN_KEY_BLOCKS, mask_ranges

    q = torch.zeros(1, 1, 32, 16)
    short, long = llama_mask(2, 32, 0, 3), llama_mask(2, 16 * MIN_KEY_BLOCKS, 0, 3)
    assert mask_ranges(short, False, 16, 16, q) is None and mask_ranges(long, False, 16, 16, q) is not None
    monkeypatch.setenv("FXOPT_MASK_RANGES", "all")
    ranges, _ = mask_ranges(short, False, 16, 16, q)
    assert torch.equal(ranges, expected_ranges(short, 16, 16, q.dtype, False, 32))
    assert mask_ranges(short, True, 16, 16, q) is None and mask_ranges(None, False, 16, 16, q) is None
    monkeypatch.setenv("FXOPT_MASK_RANGES", "0")
    assert mask_ranges(long, False, 16, 16, q) is None


@pytest.mark.parametrize("config", [POINTER, TMA], ids=["pointer", "tma"])
def test_rows_that_see_no_key_keep_their_meaning(config):
    """A bool mask hiding every key of a row: NaN as eager's softmax, 0 with SDPA's safe softmax; a key padding
    row [B, 1, 1, Tk] with right padding skips the padded blocks."""
    q, k, v = make_qkv(2, 2, 2, 64, 64, 16, torch.float16, seed=8)
    keep = torch.ones(2, 1, 64, 64, dtype=torch.bool).tril()
    keep[1, :, 40:] = False
    out = run(q, k, v, keep, config)
    assert out[1, :, 40:].isnan().all()
    assert_close(out[:, :, :40], reference(q, k, v, keep)[:, :, :40], OUT_TOL[torch.float16])
    safe = run(q, k, v, keep, config, safe_softmax=True)
    assert (safe[1, :, 40:] == 0).all()

    padding = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    padding[1, ..., 30:] = False
    poisoned = v.clone()
    poisoned[1, :, 32:] = float("nan")
    out = run(q, k, poisoned, padding, config)
    assert_close(out, reference(q, k, v, padding), OUT_TOL[torch.float16])


@pytest.mark.gpu
@pytest.mark.parametrize("pads", [(0, 0), (40, 100)])
@pytest.mark.parametrize("mask_dtype", [torch.bfloat16, torch.float32, torch.bool])
def test_gpu_bf16_hd128_llama_mask(pads, mask_dtype):
    """The real compiler (TMA where the GPU has it), bfloat16, head dim 128, the default blocks, T 512: right
    against float64 (a bool mask's rows with no key NaN in both), and the values of keys 256 on (NaN) never
    read by the query blocks before row 256 of the batch padded on the right (every default block divides
    256)."""
    q, k, v = (t.cuda() for t in make_qkv(2, 4, 4, 512, 512, 128, torch.bfloat16, transposed=True, seed=pads[0]))
    mask = llama_mask(2, 512, *pads, dtype=torch.bfloat16 if mask_dtype == torch.bool else mask_dtype).cuda()
    if mask_dtype == torch.bool:
        mask = mask == 0
    want = reference(q, k, v, mask)
    got = run(q, k, v, mask, None)
    if mask_dtype == torch.bool:  # batch 0's left-padded rows see no key: NaN, as eager's softmax gives
        assert got.isnan().equal(want.isnan()) and want[0, :, :pads[0]].isnan().all()
        got, want = got.nan_to_num(), want.nan_to_num()
    assert_close(got, want, OUT_TOL[torch.bfloat16])
    v[:, :, 256:] = float("nan")
    assert_close(run(q, k, v, mask, None)[1, :, :256], want[1, :, :256], OUT_TOL[torch.bfloat16])


def backward(dout, q, k, v, mask, tma):
    full = mask.expand(*q.shape[:3], k.shape[2])
    out, lse = flash_forward(q, k, v, scale=0.3, causal=False, mask=full, config=POINTER)
    return flash_backward(dout, q, k, v, out, lse, scale=0.3, causal=False, mask=full, config=dict(BACKWARD, TMA=tma))


def reference_grads(q, k, v, mask, dout):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, mask).backward(dout.double())
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("seq", [64, 77])
@pytest.mark.parametrize("pads", [(0, 0), (20, 30)])
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
def test_backward_with_llama_mask_matches_float64(seq, pads, tma):
    """dq, dk, dv over HF Llama's mask, each kernel walking its blocks' visible ranges; batch 0's left-padded
    rows (no real score: their query blocks visited whole) are README, Attention, known difference (1) in dq
    and dk, so there only dv and batch 1's gradients are compared."""
    dtype = torch.float16 if tma else torch.float32
    q, k, v = make_qkv(2, 2, 2, seq, seq, 16, dtype, transposed=tma, seed=seq + pads[1])
    mask = llama_mask(2, seq, *pads)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    dq, dk, dv = backward(dout, q, k, v, mask, tma)
    want_dq, want_dk, want_dv = reference_grads(q, k, v, mask, dout)
    assert_close(dv, want_dv, GRAD_TOL[dtype])
    checked = slice(None) if pads[0] == 0 else slice(1, 2)
    assert_close(dq[checked], want_dq[checked], GRAD_TOL[dtype])
    assert_close(dk[checked], want_dk[checked], GRAD_TOL[dtype])


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("bool_mask", [False, True], ids=["additive", "bool"])
def test_backward_skips_what_the_ranges_leave_out(tma, bool_mask):
    """As tests/attention/test_causal_fold.py proves the fold's skip: dout NaN in rows 0-31 reaches keys 32 on
    only through tiles the mask drops (dK/dV's query ranges leave them out), keys 32 on NaN reach rows 0-31
    only through those tiles (dQ's key ranges); batch 0's left-padded rows need them all: NaN there."""
    dtype = torch.float16 if tma else torch.float32
    q, k, v = make_qkv(2, 2, 2, 64, 64, 16, dtype, transposed=tma, seed=12)
    mask = llama_mask(2, 64, 4, 0)
    mask = (mask == 0) if bool_mask else mask
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    quiet = dout.clone()
    quiet[:, :, :32] = 0
    _, want_dk, want_dv = reference_grads(q, k, v, mask, quiet)
    dout[:, :, :32] = float("nan")
    _, dk, dv = backward(dout, q, k, v, mask, tma)
    assert_close(dk[1, :, 32:], want_dk[1, :, 32:], GRAD_TOL[dtype])
    assert_close(dv[1, :, 32:], want_dv[1, :, 32:], GRAD_TOL[dtype])
    assert dv[0, :, 32:].isnan().all()  # (the padded rows visit every key)

    want_dq, _, _ = reference_grads(q, k, v, mask, dout.nan_to_num())
    k[:, :, 32:] = float("nan")
    dq, _, _ = backward(dout.nan_to_num(), q, k, v, mask, tma)
    assert_close(dq[1, :, :32], want_dq[1, :, :32], GRAD_TOL[dtype])
    assert_close(dq[0, :, 16:32], want_dq[0, :, 16:32], GRAD_TOL[dtype])


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
def test_tiles_kept_whole_are_walked_without_the_mask(tma, monkeypatch):
    """The ranges read from the clean mask, the kernels given one with NaN values in tiles the clean mask keeps
    whole (batch 1, rows 32-47, keys 0-31: inside the runs before and below the diagonal): out, dQ, dK and dV
    of batch 1 stay right, so neither the forward nor a backward kernel loads them."""
    import fxopt.attention.mask_blocks as mask_blocks

    dtype = torch.float16 if tma else torch.float32
    q, k, v = make_qkv(2, 2, 2, 64, 64, 16, dtype, transposed=tma, seed=13)
    clean = llama_mask(2, 64, 4, 0)
    ranges_of = mask_blocks.visible_ranges
    monkeypatch.setattr(mask_blocks, "visible_ranges", lambda mask, *a, **kw: ranges_of(clean.expand(mask.shape),
                                                                                          *a, **kw))
    poisoned = clean.clone()
    poisoned[1, :, 32:48, :32] = float("nan")
    assert_close(run(q, k, v, poisoned, TMA if tma else POINTER)[1], reference(q, k, v, clean)[1], OUT_TOL[dtype])
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    for got, want in zip(backward(dout, q, k, v, poisoned, tma), reference_grads(q, k, v, clean, dout)):
        assert_close(got[1], want[1], GRAD_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("mask_dtype", [torch.bfloat16, torch.bool])
def test_gpu_bf16_hd128_llama_mask_backward(mask_dtype):
    """The real compiler's backward (TMA where the GPU has it) over HF Llama's mask, bfloat16, head dim 128,
    the default blocks, T 512, batch 1 padded on the right."""
    q, k, v = (t.cuda() for t in make_qkv(2, 4, 4, 512, 512, 128, torch.bfloat16, transposed=True, seed=3))
    mask = llama_mask(2, 512, 0, 100, dtype=torch.bfloat16).cuda()
    mask = (mask == 0) if mask_dtype == torch.bool else mask
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).cuda()
    full = mask.expand(2, 4, 512, 512)
    out, lse = flash_forward(q, k, v, scale=0.3, causal=False, mask=full)
    grads = flash_backward(dout, q, k, v, out, lse, scale=0.3, causal=False, mask=full)
    for got, want in zip(grads, reference_grads(q, k, v, mask, dout)):
        assert_close(got, want, GRAD_TOL[torch.bfloat16])


def test_explain_says_the_mask_is_skipped_by_ranges():
    """rep.attention tells a mask read at run time from the causal facts the graph settles."""
    import fxopt

    def attention(q, k, v, mask):
        s = q @ k.transpose(-1, -2) * 0.25 + mask
        return torch.softmax(s.float(), -1).to(q.dtype) @ v

    q, k, v = make_qkv(2, 2, 2, 32, 32, 16, torch.float32, seed=1)
    site, = fxopt.explain(attention, q, k, v, llama_mask(2, 32, 3, 4)).attention
    assert site.fused and not site.causal and "read by the kernel" in site.mask
    assert "skipped at run time" in site.mask and "keeps whole walked without reading it" in site.mask, site.mask
