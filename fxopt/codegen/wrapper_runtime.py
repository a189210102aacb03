"""What generated wrappers call on every step besides kernels: buffer allocation and input checks.

A training step's wrappers allocate dozens of buffers and check every input's layout, so each of these
is on the host's critical path once launches are cheap (benchmarks/results/2026-12-01-h200-c.md). They
use torch's own C entry points, the ones Inductor's wrappers use:
  - `empty_strided_<device>(size, stride, dtype)`: `torch._C._dynamo.guards._empty_strided_cpu/cuda`,
    an allocation without the dispatcher (torch.empty_strided goes through it). The CUDA one allocates
    on the current device, so CUDA wrappers run inside `device_guard(index)` (the graph's device),
    which also makes Triton launch on that device whatever device the caller left current.
  - `reinterpret_tensor(base, size, stride, offset)`: `_reinterpret_tensor`, a view of base's storage
    with the given layout, `offset` elements past base's own start, made in C without re-deriving
    the layout (the wrapper uses it only where base's layout is proven: wrapper._known_layouts).
  - `check_layout`: `assert_size_stride` in C (sizes, and strides of dims longer than 1, the only ones
    a kernel's indexing reads), with fxopt's message when it fails.
  - `cdiv`, `next_power_of_2`: grids and block sizes computed per call (symbolic sizes, attention
    launches) in plain Python: Triton's own (3.5 and later) are constexpr functions whose call wrapper
    costs ~8 us each on the CPU host, four of them per symbolic reduction launch.
A torch without these entry points gets the plain torch calls (same results, slower).
"""
from __future__ import annotations

import torch

def batched(t: torch.Tensor) -> bool:
    """A vmap BatchedTensor (functorch's, or the legacy one autograd's is_grads_batched makes): no kernel
    can read its storage."""
    return torch._C._functorch.is_batchedtensor(t) or torch._C._functorch.is_legacy_batchedtensor(t)


_GUARDS = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
_assert_size_stride = getattr(_GUARDS, "assert_size_stride", None)


def _fallback(device: str):
    def empty(size, stride, dtype):
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    return empty


empty_strided_cpu = getattr(_GUARDS, "_empty_strided_cpu", None) or _fallback("cpu")
empty_strided_cuda = getattr(_GUARDS, "_empty_strided_cuda", None) or _fallback("cuda")
def _reinterpret_fallback(base, size, stride, offset):
    return base.as_strided(size, stride, base.storage_offset() + offset)


reinterpret_tensor = getattr(_GUARDS, "_reinterpret_tensor", None) or _reinterpret_fallback
device_guard = torch.cuda._DeviceGuard  # set the current CUDA device for a block, restored after


def _has_layout(t, size, stride) -> bool:
    if _assert_size_stride is not None:
        try:
            _assert_size_stride(t, size, stride)
            return True
        except AssertionError:
            return False
    return tuple(t.shape) == size and all(a == b for a, b, n in zip(t.stride(), stride, size) if n > 1)


def check_layout(t, size, stride, name):
    """Kernels index inputs with the strides seen at compile time; refuse anything else."""
    if _has_layout(t, size, stride):
        return
    raise RuntimeError(f"fxopt: input '{name}' has shape {tuple(t.shape)} stride {tuple(t.stride())}, "
                       f"compiled for shape {size} stride {stride}; recompile for this layout")


def conform_layout(t, size, stride):
    """An ATen call's result laid out as its compile-time (meta) value says, for the kernels and views
    that index it with those strides: an ATen kernel and its meta function can disagree (the CPU batch
    norm of a permuted input returns a row-major tensor where the meta keeps the input's strides, and a
    fused kernel read it transposed). `t` itself when they agree (the usual case: one C check), else a
    copy in the meta layout."""
    if _has_layout(t, size, stride):
        return t
    if tuple(t.shape) != tuple(size):
        raise RuntimeError(f"fxopt: an ATen call returned shape {tuple(t.shape)}, compiled for {tuple(size)}")
    out = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as triton.cdiv."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as triton.next_power_of_2 for the sizes it gets."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


WHOLE_ROW_MAX = 1 << 20  # Triton's largest block (elements): the widest row one program holds whole


def whole_row_block(rnumel: int, kernel: str) -> int:
    """RBLOCK of a kernel that keeps a whole row of a symbolic length in one block (column sums): the
    row's next power of two, with a clear error past Triton's largest block instead of one from deep
    inside Triton."""
    block = next_power_of_2(rnumel)
    if block > WHOLE_ROW_MAX:
        raise RuntimeError(f"fxopt: kernel {kernel} keeps whole rows in registers and was compiled for rows "
                           f"like the example's; this call's rows have {rnumel} elements (more than "
                           f"{WHOLE_ROW_MAX}). Compile with that dim static (torch._dynamo.mark_static) or "
                           "dynamic=False.")
    return block
