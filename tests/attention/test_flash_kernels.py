"""fxopt's flash-attention forward and backward kernels against a float64 eager reference.

Numerics are checked here in the Triton interpreter on CPU tensors, in float32 and float16 (the
interpreter computes tl.dot on bfloat16 wrongly). The real compiler and bfloat16 are checked
separately, on the GPU, by the test marked `gpu`: run it as `TRITON_INTERPRET=0 pytest -m gpu`
(triton imported with TRITON_INTERPRET=1, conftest's default, builds its own library functions for
the interpreter and cannot compile any kernel).
"""
import math
import os
import subprocess
import sys

import pytest
import torch

from fxopt.attention.flash_backward import flash_backward
from fxopt.attention.flash_common import backward_config, forward_config
from fxopt.attention.flash_forward import flash_forward

# (rtol, atol) against float64, for out / lse and for the gradients
OUT_TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 5e-3), torch.bfloat16: (3e-2, 3e-2)}
GRAD_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}


def reference(q, k, v, *, scale, causal, mask=None):
    """(out, lse) in float64 from the definition: scores, causal -inf, softmax, P @ V."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = scale * q @ k.transpose(-1, -2)
    if mask is not None:
        s = s + mask
    if causal:
        seq_q, seq_k = s.shape[-2:]
        allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=s.device).tril(seq_k - seq_q)
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def make_qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, *, transposed=False, seed=0):
    """q, k, v with standard-normal entries; `transposed`: views [B, T, H, D].transpose(1, 2)."""
    g = torch.Generator().manual_seed(seed)

    def make(h, t):
        if transposed:
            return torch.randn(batch, t, h, head_dim, generator=g).to(dtype).transpose(1, 2)
        return torch.randn(batch, h, t, head_dim, generator=g).to(dtype)
    return make(heads, seq_q), make(kv_heads, seq_k), make(kv_heads, seq_k)


def padding_mask(batch, heads, seq_q, seq_k, lengths, fill=-1e9, dtype=torch.float32):
    """Additive key-padding mask [B, 1, 1, Tk] (keys at and past each batch's length get `fill`),
    expanded to [B, H, Tq, Tk] with stride 0 over heads and queries."""
    keys = torch.arange(seq_k)[None, :]
    mask = torch.where(keys >= torch.tensor(lengths)[:, None], fill, 0.0).to(dtype)
    return mask[:, None, None, :].expand(batch, heads, seq_q, seq_k)


def assert_close(got, want, tol):
    rtol, atol = tol
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


def check_forward(q, k, v, *, causal, mask=None, scale=None, config=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = flash_forward(q, k, v, scale=scale, causal=causal, mask=mask, config=config)
    ref_mask = None if mask is None else mask.double()
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), scale=scale, causal=causal, mask=ref_mask)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride() == torch.empty_like(q).stride()
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and lse.is_contiguous()
    assert_close(out, ref_out, OUT_TOL[q.dtype])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)
    return out, lse


def check_backward(q, k, v, *, causal, mask=None, dout=None, config=None, reference_mask=None):
    """flash_backward's dq, dk, dv against float64 autograd of the reference (given `reference_mask`
    in place of `mask`, where the kernels' meaning of a mask is written differently for eager)."""
    scale = q.shape[-1] ** -0.5
    out, lse = flash_forward(q, k, v, scale=scale, causal=causal, mask=mask)
    if dout is None:
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(q.device, q.dtype)
    dq, dk, dv = flash_backward(dout, q, k, v, out, lse, scale=scale, causal=causal, mask=mask, config=config)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference_mask = mask if reference_mask is None else reference_mask
    ref_out, _ = reference(*leaves, scale=scale, causal=causal,
                           mask=None if reference_mask is None else reference_mask.double())
    ref_out.backward(dout.double())
    for got, leaf, like in zip((dq, dk, dv), leaves, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype and got.stride() == torch.empty_like(like).stride()
        assert_close(got, leaf.grad, GRAD_TOL[q.dtype])


# (batch, heads, kv_heads, seq_q, seq_k, head_dim): one token; ragged lengths (37, 70, 20 are not
# multiples of the blocks); Tq < Tk; GQA (4 / 2) and MQA (4 / 1); head dims 16, 64 and 80 (padded to 128);
# lengths that are multiples of every block (the EVEN_* paths).
SHAPES = [
    (1, 2, 2, 1, 1, 16),
    (2, 2, 2, 37, 37, 64),
    (1, 4, 2, 70, 70, 80),
    (2, 4, 1, 20, 37, 16),
    (1, 2, 2, 1, 37, 64),
    (1, 4, 2, 64, 64, 32),
]
SHAPE_IDS = ["B{}H{}kv{}q{}k{}d{}".format(*s) for s in SHAPES]
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_forward_matches_float64(shape, dtype, causal, transposed):
    check_forward(*make_qkv(*shape, dtype, transposed=transposed), causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], SHAPES[3]], ids=SHAPE_IDS[1:4])
def test_backward_matches_float64_autograd(shape, dtype, causal):
    check_backward(*make_qkv(*shape, dtype), causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_with_transposed_inputs_and_dout(causal):
    q, k, v = make_qkv(2, 4, 2, 37, 70, 64, torch.float32, transposed=True, seed=3)
    dout = torch.randn(2, 37, 4, 64, generator=torch.Generator().manual_seed(4)).transpose(1, 2)
    check_backward(q, k, v, causal=causal, dout=dout)


@pytest.mark.parametrize("fill", ["finite", "inf"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padding_mask_forward_and_backward(dtype, causal, fill):
    """Keys past each sequence's length masked additively (stride-0 broadcast over heads and queries):
    by float32 -1e9 (also under float16 q, k, v), or by -inf in the inputs' dtype. Every row keeps at
    least its first key, so every row is a proper softmax."""
    q, k, v = make_qkv(2, 4, 2, 37, 70, 80, dtype, seed=5)
    value, mask_dtype = (-1e9, torch.float32) if fill == "finite" else (float("-inf"), dtype)
    mask = padding_mask(2, 4, 37, 70, lengths=[70, 45], fill=value, dtype=mask_dtype)
    check_forward(q, k, v, causal=causal, mask=mask)
    check_backward(q, k, v, causal=causal, mask=mask)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_left_padding_masks_whole_leading_key_blocks(causal):
    """-inf on the first 20 keys of batch 1: its rows see only -inf in their first key block, which
    must weigh 0 (not NaN) once later blocks bring visible keys."""
    q, k, v = make_qkv(2, 2, 2, 37, 70, 64, torch.float32, seed=12)
    mask = torch.zeros(2, 1, 1, 70)
    mask[1, ..., :20] = float("-inf")
    mask = mask.expand(2, 2, 37, 70)
    check_forward(q, k, v, causal=causal, mask=mask)
    check_backward(q, k, v, causal=causal, mask=mask)


def test_dense_random_mask_with_causal():
    """A full [B, H, Tq, Tk] mask of arbitrary values read through transposed strides."""
    q, k, v = make_qkv(1, 4, 2, 37, 50, 16, torch.float32, seed=6)
    mask = torch.randn(1, 4, 50, 37, generator=torch.Generator().manual_seed(8)).transpose(2, 3)
    check_forward(q, k, v, causal=True, mask=mask)
    check_backward(q, k, v, causal=True, mask=mask)


def test_row_masked_everywhere_gives_nan_only_in_that_row():
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, torch.float32, seed=9)
    mask = torch.zeros(1, 2, 20, 20)
    mask[:, :, 3, :] = float("-inf")
    out, lse = flash_forward(q, k, v, scale=0.25, causal=False, mask=mask)
    ref_out, _ = reference(q.double(), k.double(), v.double(), scale=0.25, causal=False, mask=mask.double())
    assert out[:, :, 3].isnan().all() and (lse[:, :, 3] == float("-inf")).all()
    keep = torch.arange(20) != 3
    assert_close(out[:, :, keep], ref_out[:, :, keep], OUT_TOL[torch.float32])


@pytest.mark.parametrize("config", [
    dict(BLOCK_M=16, BLOCK_N=32),
    dict(BLOCK_M=64, BLOCK_N=16),
    dict(BLOCK_M=16, BLOCK_N=16),
], ids=["m16n32", "m64n16", "m16n16"])
def test_forward_block_shapes(config):
    """Query blocks narrower, wider or as wide as key blocks split the causal loop differently."""
    q, k, v = make_qkv(1, 4, 2, 45, 70, 64, torch.float32, seed=10)
    check_forward(q, k, v, causal=True, scale=0.3, config=config)


@pytest.mark.parametrize("config", [
    dict(DKDV_BLOCK_M=32, DKDV_BLOCK_N=16, DQ_BLOCK_M=16, DQ_BLOCK_N=32),
    dict(DKDV_BLOCK_M=16, DKDV_BLOCK_N=64, DQ_BLOCK_M=64, DQ_BLOCK_N=16),
], ids=["dkdv-m32n16", "dkdv-m16n64"])
def test_backward_block_shapes(config):
    q, k, v = make_qkv(1, 4, 2, 45, 70, 64, torch.float32, seed=11)
    check_backward(q, k, v, causal=True, config=config)


def bad_inputs():
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    return {
        "mixed dtypes": ((q, k.half(), v), {}, "share one dtype"),
        "int dtype": ((q.int(), k.int(), v.int()), {}, "share one dtype"),
        "head dim mismatch": ((q, torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)), {}, r"D=16"),
        "k v mismatch": ((q, k, torch.randn(1, 2, 9, 16)), {}, r"\[B=1, Hkv, Tk, D=16\]"),
        "heads not a multiple": ((q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16)), {}, "multiple of kv heads"),
        "head dim too small": ((torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)), {},
                               "head_dim"),
        "3-D q": ((q[0], k, v), {}, "4-D"),
        "causal Tq > Tk": ((torch.randn(1, 4, 9, 16), k, v), dict(causal=True), "Tq <= Tk"),
        "mask shape": ((q, k, v), dict(mask=torch.zeros(1, 1, 1, 8)), r"\[1, 4, 8, 8\]"),
        "mask dtype": ((q, k, v), dict(mask=torch.zeros(1, 4, 8, 8, dtype=torch.int32)), "additive float"),
        "device": ((q, k.to("meta"), v), {}, "device"),
        "unknown config key": ((q, k, v), dict(config=dict(BLOCK_K=16)), "unknown config keys"),
        "bad block": ((q, k, v), dict(config=dict(BLOCK_M=48)), "power of two"),
        "bad warps": ((q, k, v), dict(config=dict(num_warps=3)), "num_warps"),
        "bad stages": ((q, k, v), dict(config=dict(num_stages=0)), "num_stages"),
        "float64": ((q.double(), k.double(), v.double()), {}, "share one dtype"),
    }


@pytest.mark.parametrize("case", list(bad_inputs()))
def test_bad_inputs_raise_value_error(case):
    (q, k, v), kwargs, message = bad_inputs()[case]
    kwargs = dict(scale=0.25, causal=False) | kwargs
    with pytest.raises(ValueError, match=message):
        flash_forward(q, k, v, **kwargs)


def test_backward_checks_saved_tensors_and_config():
    q, k, v = make_qkv(1, 4, 2, 8, 8, 16, torch.float32)
    out, lse = flash_forward(q, k, v, scale=0.25, causal=False)
    with pytest.raises(ValueError, match="dout must be"):
        flash_backward(out[:, :, :4], q, k, v, out, lse, scale=0.25, causal=False)
    with pytest.raises(ValueError, match="lse must be float32"):
        flash_backward(out, q, k, v, out, lse.half(), scale=0.25, causal=False)
    with pytest.raises(ValueError, match="unknown config keys"):
        flash_backward(out, q, k, v, out, lse, scale=0.25, causal=False, config=dict(BLOCK_M=16))
    q9 = torch.randn(1, 4, 9, 16)
    with pytest.raises(ValueError, match="Tq <= Tk"):
        flash_backward(q9, q9, k, v, q9, torch.zeros(1, 4, 9), scale=0.25, causal=True)


def test_cpu_tensors_without_the_interpreter_raise_value_error():
    """triton imported without TRITON_INTERPRET=1 cannot run kernels on CPU tensors: a clear error."""
    code = ("import torch\nfrom fxopt.attention.flash_forward import flash_forward\n"
            "try:\n    flash_forward(*(torch.randn(1, 2, 8, 16) for _ in range(3)), scale=0.25, causal=False)\n"
            "except ValueError as e:\n    print(e)\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True, timeout=120)
    assert "needs TRITON_INTERPRET=1" in run.stdout, run.stdout + run.stderr


def test_bf16_cpu_attention_through_the_op_is_right_despite_the_interpreter():
    """The interpreter's bf16 tl.dot is wrong, so the op sends bf16 CPU tensors to the torch reference
    (with a warning): forward and gradients match float64, instead of the garbage the kernels give there."""
    from fxopt.attention.op import flash_attention
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 24, 24, 32, torch.bfloat16, seed=3))
    out = flash_attention(q, k, v, None, 0.2, True)[0]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference(q64, k64, v64, scale=0.2, causal=True)[0]
    assert_close(out, want, OUT_TOL[torch.bfloat16])
    dout = torch.randn_like(want)
    got_grads = torch.autograd.grad(out, (q, k, v), dout.to(torch.bfloat16))
    for got, want_grad in zip(got_grads, torch.autograd.grad(want, (q64, k64, v64), dout)):
        assert_close(got, want_grad, GRAD_TOL[torch.bfloat16])


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
def test_default_configs_are_valid_and_fit_short_sequences(head_dim, dtype, device_type):
    for config_fn in (forward_config, backward_config):
        long = config_fn(head_dim, True, dtype, 4096, 4096, device_type)
        short = config_fn(head_dim, True, dtype, 1, 8, device_type)
        assert {"num_warps", "num_stages"} <= set(long)
        for key, block in long.items():
            if "BLOCK" in key:
                assert block >= 16 and block & (block - 1) == 0, (key, block)
                assert short[key] == 16, (key, short[key])
    masked = forward_config(head_dim, True, dtype, 4096, 4096, device_type, has_mask=True)
    assert masked["BLOCK_N"] <= 64  # the mask tile shares shared memory with K and V


@pytest.mark.gpu
def test_gpu_bf16_causal_hd128_forward_backward():
    """The real compiler: bfloat16, causal, head dim 128, T = 256, GQA, against float64."""
    q, k, v = (t.cuda() for t in make_qkv(2, 8, 2, 256, 256, 128, torch.bfloat16, transposed=True, seed=12))
    scale = 128 ** -0.5
    out, lse = flash_forward(q, k, v, scale=scale, causal=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16).cuda()
    dq, dk, dv = flash_backward(dout, q, k, v, out, lse, scale=scale, causal=True)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, scale=scale, causal=True)
    ref_out.backward(dout.double())
    assert_close(out, ref_out, OUT_TOL[torch.bfloat16])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-3)
    for got, leaf in zip((dq, dk, dv), leaves):
        assert_close(got, leaf.grad, GRAD_TOL[torch.bfloat16])


def _finfo_min_rows_mask():
    """Rows 3 and 4 masked everywhere with finfo(float32).min (HF's padding value), row 5 partly."""
    mask = torch.zeros(1, 2, 20, 20)
    mask[:, :, 3:5, :] = torch.finfo(torch.float32).min
    mask[:, :, 5, :7] = torch.finfo(torch.float32).min
    return mask


def test_rows_masked_everywhere_with_finfo_min_are_uniform_like_eager():
    """eager: s + finfo.min == finfo.min for every key, so the row's softmax is uniform (finite). The
    kernel must not overflow finfo.min * log2(e) to -inf and return NaN, which would poison every later
    layer of a left-padded batch (HF Llama)."""
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, torch.float32, seed=9)
    mask = _finfo_min_rows_mask()
    out, lse = flash_forward(q, k, v, scale=0.25, causal=False, mask=mask)
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), scale=0.25, causal=False, mask=mask.double())
    assert_close(out, ref_out, OUT_TOL[torch.float32])  # rows 3 and 4: the mean of v, as eager
    keep = (torch.arange(20) < 3) | (torch.arange(20) > 4)
    torch.testing.assert_close(lse[:, :, keep].double(), ref_lse[:, :, keep], rtol=1e-5, atol=1e-4)
    # a fully masked row's lse is its stand-in scores' (MASKED_SCORE, base 2) plus log(keys): eager's,
    # finfo.min + log(20), rounds to finfo.min and would lose the log(keys) the backward needs
    torch.testing.assert_close(lse[:, :, 3:5], torch.full_like(lse[:, :, 3:5], -1024 * math.log(2) + math.log(20)))


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min, -1e9])
def test_backward_of_rows_masked_everywhere_is_the_uniform_rows_gradient(fill):
    """A row masked everywhere averages its keys, as eager's does with finfo.min (s + finfo.min rounds
    to finfo.min, even in float64); the kernels treat every finite fill whose fp32 sum with the score
    rounds to the fill so (-1e9 too, in fp32). Its gradients are eager's too (with the fill's scores near
    -1e30 the backward recomputed p = 1 instead of 1/Tk there: every gradient of a left-padded batch whose
    loss reads the padding rows was off)."""
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, torch.float32, seed=9)
    mask = _finfo_min_rows_mask()
    check_backward(q, k, v, causal=False, mask=mask.masked_fill(mask != 0, fill),
                   reference_mask=mask.masked_fill(mask != 0, torch.finfo(torch.float32).min))


def test_rows_masked_everywhere_with_fp16_finfo_min_keep_their_scores():
    """fp16's finfo.min (-65504, HF's padding value in fp16 models) added in fp32 keeps the scores, so eager's
    row masked everywhere with it is softmax(s), not the uniform average (a sweep found the kernels
    dropping every value at or below -65504). Forward and backward against float64; the fp32 sum near
    -65504 rounds each score to 2^-8, so the tolerance is looser than the kernels' usual."""
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, torch.float32, seed=9)
    mask = _finfo_min_rows_mask()
    mask = mask.masked_fill(mask != 0, -65504.0)
    out, lse = flash_forward(q, k, v, scale=0.25, causal=False, mask=mask)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    grads = flash_backward(dout, q, k, v, out, lse, scale=0.25, causal=False, mask=mask)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*leaves, scale=0.25, causal=False, mask=mask.double())
    want = (ref, *torch.autograd.grad(ref, leaves, dout.double()))
    uniform = v.double().mean(2)
    assert (out[:, :, 3].double() - uniform).abs().max() > 0.1  # not the average: the scores count
    for got, r in zip((out, *grads), want):
        torch.testing.assert_close(got.double(), r, rtol=1e-2, atol=1e-2)


def test_outputs_are_laid_out_like_the_inputs_so_model_reshapes_copy_nothing():
    """q = x.view(B, T, H, D).transpose(1, 2): out and dq come back in [B, T, H, D] memory, so
    out.transpose(1, 2) is contiguous and .view(B, T, H * D) works without a copy."""
    q, k, v = make_qkv(2, 4, 2, 24, 24, 32, torch.float16, transposed=True, seed=11)
    out, lse = flash_forward(q, k, v, scale=32 ** -0.5, causal=True)
    assert out.transpose(1, 2).is_contiguous()
    dq, dk, dv = flash_backward(torch.ones_like(out), q, k, v, out, lse, scale=32 ** -0.5, causal=True)
    assert all(g.transpose(1, 2).is_contiguous() for g in (dq, dk, dv))
