"""fxopt's fused losses: cross-entropy over large vocabularies (Triton kernels behind a custom op)."""
