"""The LM head and its loss as one chunked op (losses/linear_cross_entropy.py) and the pass that finds it
(passes/linear_cross_entropy.py). Every value is checked against eager PyTorch in float64: the op on
its own (chunks of a few rows, ignored rows, each reduction and gradient mask, the CPU reference path
and the kernels), and through torch.compile for each spelling of a head. CPU: the cross-entropy kernels
run in the Triton interpreter (conftest sets TRITON_INTERPRET=1); the CUDA tests run on the GPU only."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
import fxopt.losses.linear_cross_entropy as lce
from tests.helpers import compile_fxopt

N, D, V = 23, 8, 70


def inputs(dtype=torch.float32, device="cpu", seed=0, n=N, v=V, ignored=(3, 11)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, D, generator=g)
    w = torch.randn(v, D, generator=g) * 0.5
    t = torch.randint(0, v, (n,), generator=g)
    t[list(ignored)] = -100
    return h.to(device, dtype), w.to(device, dtype), t.to(device)


def float64_reference(h, w, t, reduction="mean", ignore_index=-100):
    """(loss, d/dh, d/dw) of eager F.cross_entropy(h @ w.T) in float64."""
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    loss = F.cross_entropy(h64 @ w64.t(), t, reduction=reduction, ignore_index=ignore_index)
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


def tolerance(dtype):
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)  # bf16, fp16


@pytest.mark.parametrize("interpreter", [True, False], ids=["kernels", "torch_reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows_per_chunk", [1, 5, 0, 100])  # 0: chunk_rows picks (one chunk here)
def test_op_matches_float64_eager(monkeypatch, interpreter, dtype, reduction, rows_per_chunk):
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreter else "0")
    h, w, t = inputs(dtype)
    loss, gh, gw = lce.run_linear_cross_entropy(h, w, t, -100, reduction, dtype, grads=3,
                                                rows_per_chunk=rows_per_chunk)
    ref_loss, ref_h, ref_w = float64_reference(h, w, t, reduction)
    assert loss.dtype == dtype and gh.dtype == dtype and gw.dtype == dtype
    torch.testing.assert_close(loss.double(), ref_loss, **tolerance(dtype))
    torch.testing.assert_close(gh.double(), ref_h, **tolerance(dtype))
    torch.testing.assert_close(gw.double(), ref_w, **tolerance(dtype))


@pytest.mark.parametrize("grads", [0, 1, 2])
def test_only_the_gradients_asked_for_are_made(grads):
    h, w, t = inputs()
    loss, gh, gw = lce.run_linear_cross_entropy(h, w, t, -100, "mean", grads=grads, rows_per_chunk=4)
    ref_loss, ref_h, ref_w = float64_reference(h, w, t)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    assert gh.numel() == (h.numel() if grads & lce.GRAD_HIDDEN else 0)
    assert gw.numel() == (w.numel() if grads & lce.GRAD_WEIGHT else 0)
    if gh.numel():
        torch.testing.assert_close(gh.double(), ref_h, rtol=1e-4, atol=1e-5)
    if gw.numel():
        torch.testing.assert_close(gw.double(), ref_w, rtol=1e-4, atol=1e-5)


def test_ignore_index_and_all_rows_ignored_as_torch_gives():
    h, w, t = inputs(ignored=range(N))
    loss, gh, gw = lce.run_linear_cross_entropy(h, w, t, -100, "mean", grads=3, rows_per_chunk=7)
    ref_loss, ref_h, ref_w = float64_reference(h, w, t)
    assert torch.isnan(loss) and torch.isnan(ref_loss)  # 0 / 0, as torch's mean over no rows
    assert not gh.any() and not gw.any()
    h, w, t = inputs(ignored=())
    t[5] = 7
    loss, gh, gw = lce.run_linear_cross_entropy(h, w, t, 7, "sum", grads=3, rows_per_chunk=6)
    ref_loss, ref_h, ref_w = float64_reference(h, w, t, "sum", ignore_index=7)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw.double(), ref_w, rtol=1e-4, atol=1e-5)


def test_eager_entry_point_backward_scales_by_the_upstream_gradient():
    h, w, t = inputs()
    h.requires_grad_(), w.requires_grad_()
    (lce.linear_cross_entropy(h, w, t) * 3.0).backward()
    _, ref_h, ref_w = float64_reference(h, w, t)
    torch.testing.assert_close(h.grad.double(), 3 * ref_h, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), 3 * ref_w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(reduction="none"), "reduction"),
    (dict(w=torch.zeros(V, D, dtype=torch.float64)), "one dtype"),
    (dict(h=torch.zeros(N, D, dtype=torch.float16), w=torch.zeros(V, D, dtype=torch.float16)), "one dtype"),
    (dict(w=torch.zeros(V, D + 1)), r"\[V, D\]"),
    (dict(t=torch.zeros(N, dtype=torch.int32)), "int64"),
    (dict(grads=4), "bit mask"),
])
def test_bad_inputs_raise_naming_the_problem(bad, message):
    h, w, t = inputs()
    args = dict(h=h, w=w, t=t, reduction="mean", grads=3)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        lce.run_linear_cross_entropy(args["h"], args["w"], args["t"], -100, args["reduction"], grads=args["grads"])


def test_chunk_rows_bounds():
    assert lce.chunk_rows(16384, 131072, 2, "cuda") == 8192  # 2 GiB of bf16 logits
    assert lce.chunk_rows(16384, 32768, 2, "cuda") == lce.GPU_CHUNK_ROWS  # 512 MiB: the row cap decides
    assert lce.chunk_rows(16384, 256000, 2, "cuda") == 4096  # 2 GiB, rounded down to the tile multiple
    assert lce.chunk_rows(100, 131072, 2, "cuda") == 100  # never more than all rows
    assert lce.chunk_rows(1 << 20, 1 << 24, 4, "cuda") == lce.CUDA_ROW_MULTIPLE  # a huge vocabulary: one tile
    assert lce.chunk_rows(50, 1 << 30, 4, "cpu") == 1


# ---- the pass: spellings of a head, through torch.compile ----

class TiedLM(nn.Module):
    """Embedding, a nonlinearity, and a weight-tied head, as GPT-2's is; loss over [B*T, V] in fp32."""

    def __init__(self, vocab=V, d=D):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.emb(idx)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


SPELLINGS = {
    "matmul_t": lambda h, w, t: F.cross_entropy(h @ w.t(), t),
    "torch_matmul_T": lambda h, w, t: F.cross_entropy(torch.matmul(h, w.T), t, reduction="sum"),
    "transpose": lambda h, w, t: F.cross_entropy(h @ w.transpose(0, 1), t, ignore_index=5),
    "linear_3d_view": lambda h, w, t: F.cross_entropy(F.linear(h.view(1, N, D), w).view(-1, V), t),
    "nll_log_softmax": lambda h, w, t: F.nll_loss(F.log_softmax(F.linear(h, w), dim=-1), t),
    "permute_dims_keyword": lambda h, w, t: F.cross_entropy(h @ w.permute(dims=(1, 0)), t),
    "keywords": lambda h, w, t: F.cross_entropy(input=F.linear(h, weight=w), target=t),
    "matmul_other_keyword": lambda h, w, t: F.cross_entropy(torch.matmul(h, other=w.T), t),
}


def fused_ops(fn, *args, **options) -> tuple[list[str], list]:
    rep = fxopt.explain(fn, *args, **options)
    stats = [r.stats for r in rep.pre_autograd if r.name == "fuse_linear_cross_entropy"]
    return stats, rep.fallbacks


def assert_compiled_step_matches_float64(fn, h, w, t):
    """fn(h, w, t).backward() compiled: the loss and the gradients of h and w (None where eager's is)
    equal float64 eager's."""
    h, w = h.requires_grad_(), w.requires_grad_()
    loss = compile_fxopt(fn)(h, w, t)
    loss.backward()
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    ref = fn(h64, w64, t)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_each_spelling_is_fused_and_matches_float64_eager(spelling):
    fn = SPELLINGS[spelling]
    h, w, t = inputs()
    t[t == -100] = 5  # rows 3 and 11: class 5, ignored by the spelling with ignore_index=5
    assert_compiled_step_matches_float64(fn, h, w, t)
    h, w, t = inputs()
    stats, _ = fused_ops(fn, h.requires_grad_(), w.requires_grad_(), t)
    assert stats == [{"fused": 1}]


def test_tied_lm_trains_like_float64_eager():
    """Three SGD steps of a weight-tied LM: the losses and the tied weight follow float64 eager."""
    torch.manual_seed(0)
    model = TiedLM()
    ref = TiedLM().double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    step = compile_fxopt(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    idx, targets = torch.randint(0, V, (2, 9)), torch.randint(0, V, (2, 9))
    targets[0, :3] = -100
    for _ in range(3):
        for m, o, f in ((model, opt, step), (ref, ref_opt, ref)):
            o.zero_grad()
            loss = f(idx, targets)
            loss.backward()
            o.step()
            m.last = loss.item()
        assert model.last == pytest.approx(ref.last, rel=1e-5)
    torch.testing.assert_close(model.emb.weight.double(), ref.emb.weight, rtol=1e-4, atol=1e-5)
    stats, _ = fused_ops(TiedLM(), idx, targets)
    assert stats == [{"fused": 1}]


def grads_made(rep, graph) -> int:
    """The `grads` argument of the graph's fused op (aot_autograd drops it where it is the default, 0)."""
    (node,) = [n for n in rep.graph("captured", graph).graph.nodes if "linear_cross_entropy" in str(n.target)]
    return node.args[6] if len(node.args) > 6 else node.kwargs.get("grads", 0)


def test_no_grad_computes_the_loss_only():
    model, (idx, targets) = TiedLM(), (torch.randint(0, V, (2, 5)), torch.randint(0, V, (2, 5)))
    with torch.no_grad():
        got, want = compile_fxopt(model)(idx, targets), model(idx, targets)
        rep = fxopt.explain(model, idx, targets)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert grads_made(rep, "inference") == 0  # no gradient made


def test_frozen_weight_gets_no_gradient_made():
    h, w, t = inputs()
    h.requires_grad_()
    rep = fxopt.explain(SPELLINGS["matmul_t"], h, w, t)
    assert grads_made(rep, "forward") == lce.GRAD_HIDDEN


@pytest.mark.parametrize("case, reason", [
    ("returned_logits", "read outside the loss"),
    ("returned_upcast", "read outside the loss"),  # the .float() match_loss looks through, returned too
    ("float16", "underflow"),
    ("bias", "bias"),
    ("reduction_none", "reduction='none'"),
])
def test_heads_left_to_the_plain_loss_are_noted_and_exact(case, reason):
    h, w, t = inputs()
    b = torch.randn(V)

    if case == "float16":
        h, w = h.half(), w.half()
    if case == "returned_upcast":
        h, w = h.bfloat16(), w.bfloat16()

    def fn(h, w, t):
        if case == "bias":
            return F.cross_entropy(F.linear(h, w, b.to(h.dtype)), t)
        logits = h @ w.t()
        if case == "reduction_none":
            return F.cross_entropy(logits, t, reduction="none").sum()
        if case == "float16":
            return F.cross_entropy(logits, t)
        if case == "returned_upcast":
            up = logits.float()
            return F.cross_entropy(up, t), up
        return F.cross_entropy(logits, t), logits

    stats, fallbacks = fused_ops(fn, h, w, t)
    assert stats == [{"fused": 0}]
    assert any(reason in why for _, why in fallbacks), fallbacks
    got, want = compile_fxopt(fn)(h, w, t), fn(h.double(), w.double(), t)
    tol = tolerance(h.dtype) if h.dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, check_dtype=False, **tol)


def test_a_dtype_view_of_the_logits_is_not_a_row_view():
    """`logits.view(torch.float16)` of bf16 logits reinterprets their bits: no head or loss fusion may
    read through it (it once passed for a [rows, V] view and the loss saw the bf16 values)."""
    h, w, t = inputs(torch.bfloat16)

    def fn(h, w, t):
        return F.cross_entropy((h @ w.t()).view(torch.float16).float(), t)

    stats, _ = fused_ops(fn, h, w, t)
    assert stats == [{"fused": 0}]
    got, want = compile_fxopt(fn)(h, w, t), fn(h, w, t)
    assert torch.isfinite(want)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_roofline_counts_the_heads_matmuls():
    h, w, t = inputs()
    rep = fxopt.explain(SPELLINGS["matmul_t"], h.requires_grad_(), w.requires_grad_(), t)
    (row,) = [r for r in rep.roofline if r.name == "linear_cross_entropy"]
    assert row.flops == N * V * (2 * D * 3 + 7)  # logits, d hidden, d weight; the loss's 7 per logit


def test_skip_passes_keeps_the_head_a_matmul():
    h, w, t = inputs()
    stats, _ = fused_ops(SPELLINGS["matmul_t"], h, w, t, skip_passes=("fuse_linear_cross_entropy",))
    assert stats == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_head_matches_eager_and_holds_one_chunk(monkeypatch):
    """bf16 on the GPU (cuBLAS chunks, float32 grad_weight sum), 4 chunks: values against float64 eager,
    and the step's peak below the logits' own size (eager holds the logits and their gradient)."""
    monkeypatch.setitem(lce.CHUNK_BYTES, "cuda", 8 << 20)
    h, w, t = inputs(torch.bfloat16, "cuda", n=4096, v=4096)
    h.requires_grad_(), w.requires_grad_()
    fn = SPELLINGS["matmul_t"]
    step = compile_fxopt(fn)
    step(h, w, t).backward()
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step(h, w, t)
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base
    ref_loss, ref_h, ref_w = float64_reference(h, w, t)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-2, atol=1e-2)
    for got, want in ((h.grad, ref_h), (w.grad, ref_w)):  # bf16: 1% of the largest gradient
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item())
    logits_bytes = 4096 * 4096 * 2
    assert peak < logits_bytes, (peak, logits_bytes)

