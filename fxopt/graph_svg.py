"""A graph as an SVG picture: fused groups coloured and linked to their kernel in report.html (`#<kernel name>`).

The layout comes from graphviz's `dot` when it is on PATH (ranks with fewer crossings, routed edges),
else from networkx topological generations (nodes in layers). dot is asked only for positions
(`-Tplain`) and both layouts are drawn by the code here, so boxes, colours and links are the same
whichever laid the graph out; any dot failure (error, timeout, unreadable output) falls back.
"""
from __future__ import annotations

import html
import logging
import shlex
import shutil
import subprocess
from dataclasses import dataclass

import networkx as nx
import torch.fx as fx

from .printing import target_name

log = logging.getLogger("fxopt")

BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 150, 26, 40, 10, 10
PX_PER_INCH = 72  # dot's unit
DOT_TIMEOUT_S = 10  # a huge graph may take dot minutes; the layered drawing is instant
COLOURS = {"placeholder": "#e8e8e8", "get_attr": "#e8e8e8", "call_function": "#ffffff", "output": "#e8e8e8"}


@dataclass
class Layout:
    boxes: dict[fx.Node, tuple[float, float]]  # top-left corner of each node's box
    edges: list[str]  # SVG path data, one per edge
    width: float
    height: float


def _label(n: fx.Node) -> str:
    if n.op == "call_function":
        return target_name(n.target).replace("aten.", "").replace(".default", "")
    return n.op if n.op != "call_module" else "fused kernel"


def graph_svg(gm: fx.GraphModule, kernel_names: dict[str, str]) -> str:
    nodes = list(gm.graph.nodes)
    edges = [(a, n) for n in nodes for a in n.all_input_nodes]
    layout = dot_layout(nodes, edges) or layered_layout(nodes, edges)
    return _draw(nodes, layout, kernel_names)


def layered_layout(nodes: list[fx.Node], edges: list[tuple[fx.Node, fx.Node]]) -> Layout:
    """Each topological generation is a column, nodes in graph order; edges are straight lines."""
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    layers = list(nx.topological_generations(g))
    order = {n: i for i, n in enumerate(nodes)}
    boxes = {}
    for i, layer in enumerate(layers):
        for j, n in enumerate(sorted(layer, key=order.get)):
            boxes[n] = (MARGIN + i * (BOX_W + GAP_X), MARGIN + j * (BOX_H + GAP_Y))
    lines = [f"M{boxes[a][0] + BOX_W},{boxes[a][1] + BOX_H / 2} L{boxes[b][0]},{boxes[b][1] + BOX_H / 2}"
             for a, b in edges]
    width = 2 * MARGIN + len(layers) * (BOX_W + GAP_X)
    height = 2 * MARGIN + max(len(layer) for layer in layers) * (BOX_H + GAP_Y) if layers else 40
    return Layout(boxes, lines, width, height)


def dot_layout(nodes: list[fx.Node], edges: list[tuple[fx.Node, fx.Node]]) -> Layout | None:
    """Positions from `dot -Tplain`; None when dot is not installed or fails in any way."""
    dot = shutil.which("dot")
    if dot is None:
        return None
    ids = {n: f"n{i}" for i, n in enumerate(nodes)}
    try:
        run = subprocess.run([dot, "-Tplain"], input=_dot_source(ids, edges), capture_output=True, text=True,
                             timeout=DOT_TIMEOUT_S, check=True)
        return _parse_plain(run.stdout, {i: n for n, i in ids.items()})
    except Exception as exc:  # any failure of an external tool means the built-in drawing
        log.debug("fxopt: graphviz layout failed (%s: %s); drawing layers instead", type(exc).__name__, exc)
        return None


def _dot_source(ids: dict[fx.Node, str], edges) -> str:
    """Fixed-size unlabelled boxes (the text is drawn later), left to right like the layered drawing."""
    inch = lambda px: f"{px / PX_PER_INCH:.4f}"  # noqa: E731
    lines = ["digraph G {", f"  rankdir=LR; nodesep={inch(GAP_Y)}; ranksep={inch(GAP_X)};",
             f'  node [shape=box, fixedsize=true, width={inch(BOX_W)}, height={inch(BOX_H)}, label=""];',
             "  edge [arrowhead=none];"]
    lines += [f"  {i};" for i in ids.values()]
    lines += [f"  {ids[a]} -> {ids[b]};" for a, b in edges]
    return "\n".join(lines + ["}"]) + "\n"


def _parse_plain(text: str, nodes: dict[str, fx.Node]) -> Layout:
    """dot's plain format: inches, origin bottom-left; nodes by centre, edges as cubic B-spline points."""
    records = [shlex.split(line) for line in text.splitlines() if line.strip()]
    _, scale, width_in, height_in = records[0][:4]
    scale, height_in = float(scale) * PX_PER_INCH, float(height_in)
    point = lambda x, y: (MARGIN + float(x) * scale, MARGIN + (height_in - float(y)) * scale)  # noqa: E731
    boxes, edges = {}, []
    for r in records:
        if r[0] == "node":
            x, y = point(r[2], r[3])
            boxes[nodes[r[1]]] = (x - BOX_W / 2, y - BOX_H / 2)
        elif r[0] == "edge":
            count = int(r[3])
            pts = [point(r[4 + 2 * k], r[5 + 2 * k]) for k in range(count)]
            curves = " ".join(f"C{' '.join(f'{x:.1f},{y:.1f}' for x, y in pts[k:k + 3])}"
                              for k in range(1, count, 3))
            edges.append(f"M{pts[0][0]:.1f},{pts[0][1]:.1f} {curves}")
    if len(boxes) != len(nodes):
        raise ValueError(f"dot placed {len(boxes)} of {len(nodes)} nodes")
    return Layout(boxes, edges, 2 * MARGIN + float(width_in) * scale, 2 * MARGIN + height_in * scale)


def _draw(nodes: list[fx.Node], layout: Layout, kernel_names: dict[str, str]) -> str:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{layout.width:.0f}" height="{layout.height:.0f}" '
           f'font-family="sans-serif" font-size="10">']
    out += [f'<path d="{d}" fill="none" stroke="#999"/>' for d in layout.edges]
    for n in nodes:
        x, y = layout.boxes[n]
        kernel = kernel_names.get(n.target) if n.op == "call_module" else None
        fill = "#ffd27f" if kernel else COLOURS.get(n.op, "#ffffff")
        text = html.escape(f"{n.name}: {kernel or _label(n)}"[:28])
        box = (f'<rect x="{x:.1f}" y="{y:.1f}" width="{BOX_W}" height="{BOX_H}" rx="4" fill="{fill}" stroke="#555"/>'
               f'<text x="{x + 4:.1f}" y="{y + 16:.1f}">{text}</text>'
               f'<title>{html.escape(n.format_node() or n.name)}</title>')
        out.append(f'<a href="#{kernel}">{box}</a>' if kernel else box)
    out.append("</svg>")
    return "\n".join(out)
