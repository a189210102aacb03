"""Recognise a compile-time position bias that is linear in the key index (ALiBi), so the kernel can
compute it from one slope per head instead of reading a [heads, Tq, Tk] tensor.

ALiBi adds slope[h] * (j - i) to head h's scores (BLOOM, MPT and their relatives write it as
`slopes * (j - i)`, `slopes * j`, or `slopes * (j - (T - 1))` kept in a buffer). Softmax does not see a
constant added to a whole row, so every such bias gives the same attention as slope[h] * (j - i), which
is what the kernel computes (flash_common.add_key_slope). Read as a tensor the bias costs a
[1, H, T, T] float32 load per batch entry (2 GiB a call at B8 H16 T2048, more than the attention
itself); as slopes it costs one load per program.

The test is on the bias's values, whatever code built them: each row must equal slope[h] * j plus a row
constant wherever the row keeps its score, to within float32 rounding of the largest value (the
kernel's own float32 arithmetic is as exact as the model's). Entries at or below MASKED_AT_MOST (-inf,
finfo.min) are masked keys, returned as the bias's keep pattern for the caller's causal check.
"""
from __future__ import annotations

import torch

# float32's relative rounding (2^-23) times a margin of 4: the bias's own rounding and the slope's
TOLERANCE = 4 * 2.0 ** -23


def linear_key_slopes(bias: torch.Tensor, masked_at_most: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(slopes [Hb] float64, kept [Bb, Hb, Tq, Tk] bool) when the 4-D `bias` [Bb, Hb, Tq, Tk] (its own
    batch and head sizes; Bb entries must share the slopes) is linear in the key index in every row, over
    the entries it keeps; None otherwise, and None where a row keeps no key."""
    values = bias.detach().to(torch.float64)
    kept = values > masked_at_most
    if values.dim() != 4 or values.shape[-1] < 2 or not bool(kept.any(-1).all()):
        return None
    seq_k = values.shape[-1]
    keys = torch.arange(seq_k, dtype=torch.float64)
    first = kept.to(torch.int8).argmax(-1)  # first and last kept key of each row
    last = seq_k - 1 - kept.flip(-1).to(torch.int8).argmax(-1)
    span = (last - first)[0]  # [Hb, Tq], batch entry 0 sets the slopes
    row = span.argmax(-1)  # per head, the row that keeps the widest span
    heads = torch.arange(values.shape[1])
    widest = span[heads, row]
    if not bool((widest > 0).all()):
        return None  # some head keeps one key per row: no slope to read
    at = values[0, heads, row]  # [Hb, Tk]
    slopes = (at[heads, last[0, heads, row]] - at[heads, first[0, heads, row]]) / widest
    anchor = values.gather(-1, first[..., None])  # each row's value at its first kept key
    predicted = anchor + slopes[None, :, None, None] * (keys - first[..., None])
    scale = values.abs().where(kept, 0.0).max()
    residual = (values - predicted).abs().where(kept, 0.0).max()
    if not bool(residual <= TOLERANCE * scale):
        return None
    return slopes, kept
