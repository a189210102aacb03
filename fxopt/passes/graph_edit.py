"""Graph edits the pre-autograd rewrites share."""
from __future__ import annotations

import torch.fx as fx


def erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the nodes a rewrite replaced, once they have no users, and then their inputs that lose
    their last user (mask builders, reshapes); an input that is an in-place method (`x.add_()`) stays."""
    pending = list(dict.fromkeys(nodes))
    changed = True
    while changed:
        changed = False
        for node in list(pending):
            if not node.users and node.op in ("call_function", "call_method"):
                inputs = node.all_input_nodes
                graph.erase_node(node)
                pending.remove(node)
                pending.extend(i for i in inputs if i.op in ("call_function", "call_method") and i not in pending
                               and not str(i.target).endswith("_"))
                changed = True
