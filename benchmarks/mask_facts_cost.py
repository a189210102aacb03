"""What recognising a causal mask costs at compile time (analysis/attention_masks.mask_facts), for the
benchmark blocks' score shapes: a [1, 1, T, T] `triu(1)` fill mask, as a GPT-2 block's tril buffer gives.

    PYTHONPATH=. python -m benchmarks.mask_facts_cost

CPU only, no GPU needed: the check runs on the host while the first call compiles.
"""
from __future__ import annotations

import math
import time

import torch

from fxopt.analysis.attention_masks import MaskStep, mask_facts


class ConstantMasks:
    """ConstantValues' interface for masks given as constant tensors (tests/attention/test_mask_facts.py too)."""

    def is_constant(self, tensor):
        return True

    def value(self, tensor):
        return tensor

    def buffers_used(self, tensor):
        return []


def main() -> None:
    future = torch.ones(1, 1, 1024, 1024, dtype=torch.bool).triu(1)
    print("scores [B, H, T, T] | causal | seconds")
    for shape in [(16, 16, 1024, 1024), (8, 16, 1024, 1024)]:
        start = time.perf_counter()
        facts = mask_facts([MaskStep("fill", future, value=-math.inf)], ConstantMasks(), shape, lambda t: False)
        print(f"{list(shape)} | {facts.causal} | {time.perf_counter() - start:.3f}")


if __name__ == "__main__":
    main()
