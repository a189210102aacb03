"""Split-KV decode attention (fxopt.attention.flash_decode) against a float64 eager reference.

Numerics are checked in the Triton interpreter on CPU tensors (float32 and float16: the interpreter
computes tl.dot on bfloat16 wrongly), and on the GPU only by the `gpu` test (bfloat16, real compiler).
"""
import math

import pytest
import torch

from fxopt.attention.flash_decode import decode_applies, default_num_splits, flash_decode

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=3e-3, atol=3e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def reference(q, k, v, *, scale, causal, mask=None):
    """(out, lse) in float64, written independently of the kernel: repeat kv heads, softmax, matmul."""
    heads, kv_heads, seq_q, seq_k = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k64 = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v64 = v.double().repeat_interleave(heads // kv_heads, dim=1)
    s = scale * q.double() @ k64.transpose(-1, -2)
    if mask is not None:
        s = s + mask.double()
    if causal:
        i = torch.arange(seq_q, device=q.device)[:, None]
        j = torch.arange(seq_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + (seq_k - seq_q), float("-inf"))
    return torch.softmax(s, dim=-1) @ v64, torch.logsumexp(s, dim=-1)


def make_qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, seq_k, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, seq_k, head_dim, generator=g)
    return (t.to(device=device, dtype=dtype) for t in (q, k, v))


def check(q, k, v, *, causal, mask=None, **kwargs):
    scale = q.shape[-1] ** -0.5
    out, lse = flash_decode(q, k, v, scale=scale, causal=causal, mask=mask, **kwargs)
    ref_out, ref_lse = reference(q, k, v, scale=scale, causal=causal, mask=mask)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and lse.is_contiguous()
    torch.testing.assert_close(out.double(), ref_out, **TOL[q.dtype])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)


# (batch, heads, kv_heads, seq_q, seq_k, head_dim, causal): every Tq, Tk, D, GQA / MQA / MHA, both causal
SHAPES = [
    (1, 8, 2, 1, 1, 16, True),
    (2, 4, 4, 3, 1, 64, False),
    (1, 8, 2, 3, 37, 80, True),
    (1, 8, 1, 16, 37, 16, False),
    (2, 2, 2, 1, 300, 64, True),
    (1, 8, 2, 16, 300, 80, True),
    (1, 8, 1, 3, 1000, 64, False),
    (1, 4, 4, 16, 1000, 16, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}kv{}q{}k{}d{}{}".format(*s[:6], "c" * s[6]))
def test_matches_float64_reference(shape, dtype):
    *dims, causal = shape
    check(*make_qkv(*dims, dtype), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_q_k_v(causal):
    """k and v as the transpose of [B, T, Hkv, D] (a KV cache layout), q likewise: strides pass through."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 8, 80, generator=g).transpose(1, 2)
    k = torch.randn(2, 300, 2, 80, generator=g).transpose(1, 2)
    v = torch.randn(2, 300, 2, 80, generator=g).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_mask_with_minus_1e9_and_minus_inf(causal, mask_dtype):
    batch, heads, seq_q, seq_k = 2, 8, 3, 300
    q, k, v = make_qkv(batch, heads, 2, seq_q, seq_k, 64, torch.float16, seed=2)
    pad = torch.zeros(batch, 1, 1, seq_k)
    pad[0, ..., 250:] = float("-inf")  # padded tail of sequence 0 (its later split is masked entirely)
    pad[1, ..., :40] = -1e9  # left padding of sequence 1
    pad[1, ..., 100:110] = float("-inf")
    mask = pad.to(mask_dtype).expand(batch, heads, seq_q, seq_k)
    assert mask.stride()[1:3] == (0, 0)
    check(q, k, v, causal=causal, mask=mask, num_splits=2)


def test_dense_additive_mask_per_head_and_query():
    """Finite bias values (an ALiBi-like bias, a different one per head and query) scale with the scores."""
    q, k, v = make_qkv(1, 8, 2, 3, 300, 64, torch.float32, seed=6)
    bias = torch.randn(1, 8, 3, 300, generator=torch.Generator().manual_seed(7)) * 3
    check(q, k, v, causal=True, mask=bias, num_splits=3)


def test_leading_splits_fully_masked():
    """Left padding of -inf over the first 16 of 20 splits: the combine's first block of splits is all
    -inf for every row, so its rescaling must not turn into exp2(-inf - (-inf)) = NaN."""
    q, k, v = make_qkv(1, 4, 4, 1, 320, 16, torch.float32, seed=8)
    pad = torch.zeros(1, 1, 1, 320)
    pad[..., :256] = float("-inf")
    check(q, k, v, causal=False, mask=pad.expand(1, 4, 1, 320), num_splits=20, config={"BLOCK_N": 16})


def test_one_split_stores_out_and_lse_itself(monkeypatch):
    """With one chunk of keys the partial state is the final one: no workspaces and no combine launch."""
    from fxopt.attention import flash_decode as module
    launched = []
    real = module.launcher
    monkeypatch.setattr(module, "launcher",
                        lambda kernel, grid, device: launched.append(kernel) or real(kernel, grid, device))
    q, k, v = make_qkv(2, 4, 2, 3, 90, 32, torch.float32, seed=4)
    check(q, k, v, causal=True, num_splits=1, config={"BLOCK_N": 16})
    assert launched == [module._split_partials_kernel]
    launched.clear()
    check(q, k, v, causal=True, num_splits=3, config={"BLOCK_N": 16})
    assert launched == [module._split_partials_kernel, module._combine_splits_kernel]


@pytest.mark.parametrize("num_splits", [2, 1], ids=["combined", "one-split-stored-directly"])
def test_fully_masked_row_gives_nan_and_minus_inf_lse_like_eager(num_splits):
    q, k, v = make_qkv(1, 2, 2, 2, 40, 16, torch.float32, seed=9)
    mask = torch.zeros(1, 2, 2, 40)
    mask[0, 1, 0] = float("-inf")
    out, lse = flash_decode(q, k, v, scale=0.25, causal=False, mask=mask, num_splits=num_splits,
                            config={"BLOCK_N": 16})
    assert out[0, 1, 0].isnan().all() and lse[0, 1, 0] == float("-inf")
    assert not out[0, 0].isnan().any() and not out[0, 1, 1].isnan().any()


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
@pytest.mark.parametrize("seq_q, seq_k", [(16, 20), (3, 37), (1, 300)])
def test_explicit_num_splits_including_empty_splits(num_splits, seq_q, seq_k):
    """64 splits of 16 keys leave most splits empty; (16, 20) causal leaves splits that early rows
    cannot see at all: both must weigh nothing in the combine rather than give NaN."""
    q, k, v = make_qkv(1, 8, 2, seq_q, seq_k, 16, torch.float32, seed=3)
    check(q, k, v, causal=True, num_splits=num_splits, config={"BLOCK_N": 16})


def test_row_blocks_when_packed_rows_exceed_block_m():
    """8 query heads per kv head x 16 queries = 128 packed rows: 8 row blocks of 16."""
    check(*make_qkv(1, 8, 1, 16, 70, 64, torch.float16, seed=4), causal=True,
          config={"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 2})


def test_default_num_splits_fills_132_sms_and_keeps_256_keys_per_split():
    assert default_num_splits(programs_per_split=8 * 8, seq_k=8192) == 4  # 256 programs >= 1.5 per SM
    assert default_num_splits(programs_per_split=8 * 32, seq_k=8192) == 1  # B8 H32 MHA fills the GPU unsplit
    assert default_num_splits(programs_per_split=8, seq_k=32768) == 25
    assert default_num_splits(programs_per_split=1, seq_k=1000) == 3  # capped: 1000 keys // 256
    assert default_num_splits(programs_per_split=1, seq_k=100) == 1
    assert default_num_splits(programs_per_split=1000, seq_k=8192) == 1


def test_decode_applies_to_short_queries_over_long_keys():
    assert decode_applies(1, 8192) and decode_applies(16, 256)
    assert not decode_applies(17, 8192) and not decode_applies(1, 255)


def _bad_call(case):
    q, k, v = make_qkv(1, 4, 2, 2, 40, 16, torch.float32)
    kw = dict(scale=0.25, causal=False)
    calls = {
        "dtype_mismatch": lambda: flash_decode(q, k.half(), v, **kw),
        "int_dtype": lambda: flash_decode(q.int(), k.int(), v.int(), **kw),
        "float64": lambda: flash_decode(q.double(), k.double(), v.double(), **kw),
        "three_dims": lambda: flash_decode(q[0], k, v, **kw),
        "long_query": lambda: flash_decode(torch.randn(1, 4, 17, 16), k, v, **kw),
        "heads_not_multiple": lambda: flash_decode(torch.randn(1, 3, 2, 16), k, v, **kw),
        "head_dim_mismatch": lambda: flash_decode(q, k, v[..., :8], **kw),
        "head_dim_too_small": lambda: flash_decode(q[..., :8], k[..., :8], v[..., :8], **kw),
        "head_dim_too_large": lambda: flash_decode(*(torch.randn(1, 2, 2, 512) for _ in range(3)), **kw),
        "causal_query_longer_than_keys": lambda: flash_decode(q, k[:, :, :1], v[:, :, :1], scale=1.0, causal=True),
        "mask_not_expanded": lambda: flash_decode(q, k, v, mask=torch.zeros(1, 1, 1, 40), **kw),
        "mask_int": lambda: flash_decode(q, k, v, mask=torch.ones(1, 4, 2, 40, dtype=torch.int32), **kw),
        "meta_device": lambda: flash_decode(q.to("meta"), k.to("meta"), v.to("meta"), **kw),
        "unknown_config_key": lambda: flash_decode(q, k, v, config={"BLOCK_K": 16}, **kw),
        "block_n_not_power_of_two": lambda: flash_decode(q, k, v, config={"BLOCK_N": 24}, **kw),
        "zero_splits": lambda: flash_decode(q, k, v, num_splits=0, **kw),
    }
    return calls[case]


@pytest.mark.parametrize("case", ["dtype_mismatch", "int_dtype", "float64", "three_dims", "long_query",
                                  "heads_not_multiple", "head_dim_mismatch", "head_dim_too_small",
                                  "head_dim_too_large", "causal_query_longer_than_keys", "mask_not_expanded",
                                  "mask_int", "meta_device", "unknown_config_key", "block_n_not_power_of_two",
                                  "zero_splits"])
def test_bad_inputs_raise_value_error(case):
    with pytest.raises(ValueError, match="flash_decode"):
        _bad_call(case)()


@pytest.mark.gpu
def test_bf16_decode_on_gpu_matches_float64():
    """Real compiler: bf16, GQA (8 query heads over 2 kv heads), one query over 4096 keys, head_dim 128."""
    q, k, v = make_qkv(2, 8, 2, 1, 4096, 128, torch.bfloat16, device="cuda", seed=5)
    scale = 1 / math.sqrt(128)
    out, lse = flash_decode(q, k, v, scale=scale, causal=True)
    ref_out, ref_lse = reference(q, k, v, scale=scale, causal=True)
    torch.testing.assert_close(out.double(), ref_out, **TOL[torch.bfloat16])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-3)
