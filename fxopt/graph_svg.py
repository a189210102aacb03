"""A graph as an SVG picture without graphviz: nodes in layers (networkx topological generations),
fused groups coloured and linked to their kernel in report.html (`#<kernel name>`)."""
from __future__ import annotations

import html

import networkx as nx
import torch.fx as fx

from .printing import target_name

BOX_W, BOX_H, GAP_X, GAP_Y = 150, 26, 40, 10
COLOURS = {"placeholder": "#e8e8e8", "get_attr": "#e8e8e8", "call_function": "#ffffff", "output": "#e8e8e8"}


def _label(n: fx.Node) -> str:
    if n.op == "call_function":
        return target_name(n.target).replace("aten.", "").replace(".default", "")
    return n.op if n.op != "call_module" else "fused kernel"


def graph_svg(gm: fx.GraphModule, kernel_names: dict[str, str]) -> str:
    g = nx.DiGraph()
    nodes = list(gm.graph.nodes)
    for n in nodes:
        g.add_node(n)
        for a in n.all_input_nodes:
            g.add_edge(a, n)
    layers = list(nx.topological_generations(g))
    pos = {}
    for i, layer in enumerate(layers):
        for j, n in enumerate(sorted(layer, key=nodes.index)):
            pos[n] = (10 + i * (BOX_W + GAP_X), 10 + j * (BOX_H + GAP_Y))
    width = 20 + len(layers) * (BOX_W + GAP_X)
    height = 20 + max(len(layer) for layer in layers) * (BOX_H + GAP_Y) if layers else 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="10">']
    for a, b in g.edges:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        out.append(f'<line x1="{xa + BOX_W}" y1="{ya + BOX_H / 2}" x2="{xb}" y2="{yb + BOX_H / 2}" stroke="#999"/>')
    for n in nodes:
        x, y = pos[n]
        kernel = kernel_names.get(n.target) if n.op == "call_module" else None
        fill = "#ffd27f" if kernel else COLOURS.get(n.op, "#ffffff")
        text = html.escape(f"{n.name}: {kernel or _label(n)}"[:28])
        box = (f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="4" fill="{fill}" stroke="#555"/>'
               f'<text x="{x + 4}" y="{y + 16}">{text}</text><title>{html.escape(n.format_node() or n.name)}</title>')
        out.append(f'<a href="#{kernel}">{box}</a>' if kernel else box)
    out.append("</svg>")
    return "\n".join(out)
