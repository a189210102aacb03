"""One kernel for several independent casts (passes/combine_casts.py): each member owns a range of
program ids and copies its tensor through in blocks, so N parameter casts cost one launch.

    @triton.jit
    def cast_inputs_0(in0, in1, out0, out1, XBLOCK: tl.constexpr):
        pid = tl.program_id(0)
        x = tl.arange(0, XBLOCK)
        if pid < 48:                              # in0: 49152 elements, 48 blocks
            offs = pid * XBLOCK + x
            tl.store(out0 + offs, tl.load(in0 + offs).to(tl.bfloat16))
        if (pid >= 48) & (pid < 49):              # in1: 384 elements, one ragged block
            offs = (pid - 48) * XBLOCK + x
            mask = offs < 384
            tl.store(out1 + offs, tl.load(in1 + offs, mask=mask).to(tl.bfloat16), mask=mask)

The ranges are flat tests, not an if/else chain, so a kernel of 64 members is 64 shallow branches.
Members are contiguous and of static size (the pass checks), so offsets are element indices.
"""
from __future__ import annotations

import torch.fx as fx

from .dtypes import TL_DTYPE
from .kernel import Kernel

XBLOCK = 1024
NUM_WARPS = 4


def generate_combined_casts_kernel(sub: fx.GraphModule, name: str) -> Kernel:
    """The Kernel for a `fusedcasts_*` subgraph: inputs in placeholder order, outputs in its order."""
    inputs = [n.meta["val"] for n in sub.graph.nodes if n.op == "placeholder"]
    casts = list(next(n for n in sub.graph.nodes if n.op == "output").args[0])
    outputs = [c.meta["val"] for c in casts]
    k = len(inputs)
    params = ", ".join([f"in{i}" for i in range(k)] + [f"out{i}" for i in range(k)])
    lines = ["@triton.jit", f"def {name}({params}, XBLOCK: tl.constexpr):",
             f'    """{k} casts of graph inputs, one range of programs each."""',
             "    pid = tl.program_id(0)", "    x = tl.arange(0, XBLOCK)"]
    first = 0
    for i, (src, dst) in enumerate(zip(inputs, outputs)):
        numel = src.numel()
        blocks = -(-numel // XBLOCK)
        test = f"pid < {first + blocks}" if first == 0 else f"(pid >= {first}) & (pid < {first + blocks})"
        lines += [f"    if {test}:  # in{i}: {numel} elements {src.dtype} -> {dst.dtype}",
                  f"        offs = {'pid' if first == 0 else f'(pid - {first})'} * XBLOCK + x"]
        to = TL_DTYPE[dst.dtype]
        if numel % XBLOCK:
            lines += [f"        mask = offs < {numel}",
                      f"        tl.store(out{i} + offs, tl.load(in{i} + offs, mask=mask).to({to}), mask=mask)"]
        else:
            lines.append(f"        tl.store(out{i} + offs, tl.load(in{i} + offs).to({to}))")
        first += blocks
    ops = [str(c.target) for c in casts]
    return Kernel(name=name, kind="pointwise", source="\n".join(lines) + "\n", ops=ops, grid=first, int_args=[],
                  constexprs={"XBLOCK": XBLOCK}, num_warps=NUM_WARPS, outputs=outputs,
                  input_dtypes=[t.dtype for t in inputs], inputs=inputs,
                  notes={"combined": f"{k} casts of graph inputs in one launch"})
