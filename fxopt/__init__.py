"""fxopt: a readable graph compiler for PyTorch (torch.fx passes -> Triton kernels + a Python wrapper).

Public API: backend, explain, optimize, profile, Options, Report, ProfileReport.
"""
from .backend import backend
from .capture import explain, optimize
from .options import Options
from .profile import ProfileReport, profile
from .report import Report

__all__ = ["backend", "explain", "optimize", "profile", "Options", "Report", "ProfileReport"]
__version__ = "0.1.0"
