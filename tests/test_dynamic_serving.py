"""One compilation serves a GPT block at every (batch, length) in the dynamic-shapes issue's range, the
way a server calls it: batch 2..64 and length 16..4096 through one graph (batch 1 is specialised by
dynamo and compiles once more), results equal eager. Fused groups run as eager subgraphs here
(TRITON_INTERPRET=0, the CPU's eager target): what is checked is the compilation count and the
symbolic wrapper's sizes, not kernel numerics (tests/test_dynamic_shapes.py does those).

The block's causal buffer is longer than the longest sequence: a length equal to the buffer's makes
dynamo guard `T != max_len` on the slice `bias[:, :, :T, :T]` and compile once more (dynamo's guard on
the model code, the same under Inductor)."""
import torch

from helpers import CountingBackend
from benchmarks.workloads_attention import GPTBlock

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
