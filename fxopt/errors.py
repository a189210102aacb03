"""Errors fxopt raises at users: each names the node and says what to do."""
from .printing import target_name


class FxoptError(RuntimeError):
    """A model fxopt cannot compile as given (bad input, not a bug in fxopt)."""


class VerifyError(FxoptError):
    """verify=True found a pass whose output graph disagrees with the captured graph."""


def node_error(node, problem: str, fix: str) -> FxoptError:
    """An error that names the fx node, its op, and the fix."""
    target = target_name(node.target)
    return FxoptError(f"fxopt: node '{node.name}' ({target}): {problem}. Fix: {fix}")
