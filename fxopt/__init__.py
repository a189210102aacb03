"""fxopt: a readable graph compiler for PyTorch (torch.fx passes -> Triton kernels + a Python wrapper).

Public API: backend, explain, optimize, Options, Report.
"""
from .backend import backend
from .capture import explain, optimize
from .options import Options
from .report import Report

__all__ = ["backend", "explain", "optimize", "Options", "Report"]
__version__ = "0.1.0"
