"""One compilation serves a GPT block at every (batch, length) in the dynamic-shapes issue's range, the
way a server calls it: batch 2..64 and length 16..4096 through one graph (batch 1 is specialised by
dynamo and compiles once more), results equal eager. Fused groups run as eager subgraphs here
(TRITON_INTERPRET=0, the CPU's eager target): what is checked is the compilation count and the
symbolic wrapper's sizes, not kernel numerics (tests/test_dynamic_shapes.py does those, and the HF-style
Llama below, whose kernels run in the interpreter).

The block's causal buffer is longer than the longest sequence: a length equal to the buffer's makes
dynamo guard `T != max_len` on the slice `bias[:, :, :T, :T]` and compile once more (dynamo's guard on
the model code, the same under Inductor)."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import fxopt
from helpers import CountingBackend, assert_close_to_reference
from benchmarks.workloads_attention import GPTBlock

sys.path.insert(0, str(Path(__file__).parent / "models"))
from hf_llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

PAIRS = [(2, 16), (64, 16), (17, 333), (4, 1024), (2, 4096), (33, 50)]


def test_gpt_block_serves_batch_2_to_64_and_length_16_to_4096_with_one_compilation(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    block = GPTBlock(32, 2, max_len=8192).eval()
    backend = CountingBackend()
    compiled = torch.compile(block, backend=backend, dynamic=True)
    with torch.no_grad():
        compiled(torch.randn(*PAIRS[0], 32))
        first = backend.calls  # dynamo may call the backend twice for the very first graph
        for b, t in PAIRS:
            x = torch.randn(b, t, 32)
            torch.testing.assert_close(compiled(x), block(x), rtol=1e-4, atol=1e-5)
        assert backend.calls == first, f"recompiled: {backend.calls - first} more compilations"
        compiled(torch.randn(1, 16, 32))  # batch 1: dynamo specialises sizes 0 and 1
    assert backend.calls == first + 1
    symbolic = [g for g in backend.report.graphs if g.symbols]
    assert symbolic and all(site.fused for site in backend.report.attention[:1])


def test_hf_llama_under_dynamic_shapes_fuses_its_rotary_cat_and_equals_float64():
    """An HF-style Llama (RMSNorm, rotary `cat`, grouped-query attention, additive mask) compiled with
    dynamic=True: the kernels run in the interpreter; one compilation serves three (batch, length)
    pairs, logits equal float64 eager, and the rotary cat (symbolic batch and length, fixed head dim)
    is fused into its multiply-add kernel instead of an ATen cat."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig()).eval()
    reference = LlamaForCausalLM(LlamaConfig()).double().eval()
    reference.load_state_dict(model.state_dict())
    be = CountingBackend()
    compiled = torch.compile(model, backend=be, dynamic=True)
    calls = None
    with torch.no_grad():
        for batch, length in ((2, 8), (3, 5), (2, 11)):
            ids = torch.randint(0, 80, (batch, length))
            mask = torch.ones(batch, length, dtype=torch.long)
            assert_close_to_reference(compiled(ids, mask), reference(ids, mask), torch.float32)
            calls = be.calls if calls is None else calls
    assert be.calls == calls  # dynamo's graph breaks compile together, on the first call only
    calls_made = "\n".join(g.wrapper_source.split("def call")[-1] for g in be.report.graphs)
    assert "torch.cat(" not in calls_made and "aten.cat" not in calls_made
    assert sum("aten.cat.default" in k.ops for k in be.report.kernels) >= 3  # the embedding's, q's and k's


def test_size_oblivious_sizes_serve_batch_1_from_the_same_compilation_and_length_1_compiles():
    """Under torch.fx.experimental._config.backed_size_oblivious dynamo does not specialise sizes of 1:
    batch 1 runs through the graph compiled for batch 2 (kernels in the interpreter, equal float64).
    A length of 1 still recompiles (dynamo's guard in matmul's decomposition), and that graph mixes
    a size symbol with the constant 1 it is guarded to equal (LayerNorm's [s, s, 1] statistics next
    to a [1, 1, 1] rstd): fxopt reads the symbol as 1 there instead of failing in codegen."""
    torch.manual_seed(0)
    block = GPTBlock(32, 2, max_len=64).eval()
    reference = GPTBlock(32, 2, max_len=64).double().eval()
    reference.load_state_dict(block.state_dict())
    backend = CountingBackend()
    compiled = torch.compile(block, backend=backend, dynamic=True)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True), torch.no_grad():
        calls = None
        for b, t in ((2, 16), (1, 16), (3, 9), (1, 5)):
            x = torch.randn(b, t, 32)
            assert_close_to_reference(compiled(x), reference(x.double()), torch.float32)
            calls = backend.calls if calls is None else calls
        assert backend.calls == calls, "batch 1 recompiled under backed_size_oblivious"
        for b in (1, 3):  # one token: a second graph, then served for other batches
            x = torch.randn(b, 1, 32)
            assert_close_to_reference(compiled(x), reference(x.double()), torch.float32)
    assert backend.calls >= calls + 1


class _CachedAttention(torch.nn.Module):
    """A decode step over a static KV cache written by slice at a Python-int position, its causal mask
    sliced from a buffer at that position (how GPT-2 serving code is often written)."""

    def __init__(self, d: int = 32, heads: int = 2, max_len: int = 24):
        super().__init__()
        self.heads, self.qkv = heads, torch.nn.Linear(d, 3 * d)
        self.register_buffer("kc", torch.zeros(1, heads, max_len, d // heads))
        self.register_buffer("vc", torch.zeros(1, heads, max_len, d // heads))
        self.register_buffer("bias", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))

    def forward(self, x, pos: int):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        self.kc[:, :, pos:pos + T] = k
        self.vc[:, :, pos:pos + T] = v
        att = (q @ self.kc[:, :, :pos + T].transpose(-2, -1)) * (C // self.heads) ** -0.5
        att = att.masked_fill(self.bias[:, :, pos:pos + T, :pos + T] == 0, float("-inf"))
        return (att.softmax(-1) @ self.vc[:, :, :pos + T]).transpose(1, 2).reshape(B, T, C)


@pytest.mark.parametrize("options", [{}, {"precision": "bf16"}], ids=["fp32", "bf16"])
def test_size_oblivious_decode_after_prefill_compiles(options):
    """Found by a sweep: the decode step (recompiled with symbolic position and length) failed with
    "PendingUnbackedSymbolNotFound": filling example values for the fused attention op (and the
    precision pass's casts) re-ran slices at symbolic offsets, which under backed_size_oblivious make
    unbacked size symbols that aot_autograd's trace then refused."""
    torch.manual_seed(0)
    model = _CachedAttention()
    reference = copy.deepcopy(model).double()
    compiled = torch.compile(copy.deepcopy(model), backend=fxopt.backend(**options))
    tol = torch.bfloat16 if options else torch.float32
    with torch.fx.experimental._config.patch(backed_size_oblivious=True), torch.no_grad():
        for pos, length in ((0, 5), (5, 1), (6, 1)):
            x = torch.randn(1, length, 32)
            assert_close_to_reference(compiled(x, pos), reference(x.double(), pos), tol)
