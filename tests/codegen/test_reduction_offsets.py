"""Reduction kernels whose addresses pass 2^31: the row offsets (rindex * stride) must be 64-bit too,
not only the program's row block (a strided sum read wrapped offsets: 2097152 where eager gives 2097552)."""
import os

import pytest
import torch

import fxopt  # noqa: F401  (registers the backend)


def _free_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@pytest.mark.skipif(_free_bytes() < 10 * 2**30, reason="needs a 4 GiB buffer and room to spare")
def test_strided_row_past_2_to_the_31_sums_every_element():
    big = torch.zeros(2**32 + 8192, dtype=torch.uint8)  # the low half stays 0: a wrapped offset reads zeros
    b = big[2**31:]
    b.fill_(1)
    x = b[::1024][: 2**21 + 4]  # stride 1024: the last 4 elements sit past 2^31 from x's start
    x[-4:] = 100
    torch._dynamo.reset()
    out = torch.compile(lambda t: t.float().sum(), backend="fxopt")(x)
    assert out.item() == x.double().sum().item() == 2**21 + 400
