"""Codegen: fused groups to Triton source, the graph to a Python wrapper, and the on-disk cache."""
