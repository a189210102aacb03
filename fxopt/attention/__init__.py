"""fxopt's attention: the fused op, its Triton kernels and the matcher's helpers."""
