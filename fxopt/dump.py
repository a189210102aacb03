"""Writing a report to a directory (FXOPT_DUMP=dir, rep.save(dir)): files a person can open and run."""
from __future__ import annotations

import dataclasses
import html
import os

from .memory.plan_report import memory_svg
from .options import Environment


def write_dump(rep, directory: str, all_passes: bool = False) -> None:
    """Every file of the report. passes/ holds the graphs that a pass changed; with all_passes (or
    FXOPT_DUMP_ALL=1) also those it left as they were, so each pass's input can be read next to it."""
    all_passes = all_passes or Environment.read().dump_all_passes
    for sub in ("passes", "kernels"):
        try:
            os.makedirs(os.path.join(directory, sub), exist_ok=True)
        except OSError as e:
            raise OSError(f"fxopt: cannot write the dump to {directory!r} ({e.strerror}); set FXOPT_DUMP or "
                          "dump_dir to a directory this user can create and write") from e
    _clear_earlier_dump(directory)
    written: list[str] = []
    write = lambda rel, text: _write(directory, rel, text, written)  # noqa: E731
    index = 0
    for p in rep.pre_autograd:  # the torch-level graph, before autograd (attention matching)
        index += 1
        if p.changed or all_passes:
            write(f"passes/{index:02d}_torch_{p.name}.txt", p.text)
    for gi, g in enumerate(rep.graphs):
        tag = f"{gi}_{g.name}"
        index += 1
        write(f"passes/{index:02d}_{tag}_captured.txt", g.captured_text)
        for p in g.passes:
            index += 1
            if p.changed or p.name == "codegen" or all_passes:
                write(f"passes/{index:02d}_{tag}_{p.name}.txt", p.text)
        for k in g.kernels:  # (kernel names restart in every graph: later graphs' files carry the tag)
            write(f"kernels/{k.name}.py" if gi == 0 else f"kernels/{tag}_{k.name}.py", k.standalone)
        write("wrapper.py" if gi == 0 else f"wrapper_{tag}.py", g.wrapper_source)
    if rep.memory_plan is not None:
        write("memory.svg", memory_svg(rep.memory_plan))
    write("report.txt", str(rep))
    write("report.html", report_html(rep))
    _write(directory, MANIFEST, "".join(f"{rel}\n" for rel in written), [])


# The files a dump wrote, one relative path per line: the next dump into the directory removes these
# and nothing else (a user's own kernels/*.py beside a dump are never touched)
MANIFEST = ".fxopt-dump-files"


def _clear_earlier_dump(directory: str) -> None:
    """A dump is rewritten whole after every compiled graph (the report grows, so file numbers shift):
    remove the files an earlier write of it listed in its manifest, nothing else."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            earlier = [line.strip() for line in f if line.strip()]
    except FileNotFoundError:
        return
    root = os.path.realpath(directory)
    for rel in earlier:
        path = os.path.realpath(os.path.join(directory, rel))
        if os.path.commonpath([root, path]) == root and os.path.isfile(path):  # (never outside the dump)
            os.remove(path)


def _write(directory: str, rel: str, text: str, written: list) -> None:
    with open(os.path.join(directory, rel), "w") as f:
        f.write(text)
    written.append(rel)


def report_html(rep) -> str:
    """Self-contained HTML (no network, no external assets): the text report, attention sites and casts,
    each graph drawn, kernels and wrappers."""
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>fxopt report</title>",
             "<style>body{font-family:sans-serif;margin:2em}pre{background:#f6f8fa;padding:1em;"
             "overflow:auto}h2{border-bottom:1px solid #ccc}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;font-size:90%}</style></head><body>",
             "<h1>fxopt report</h1>", f"<pre>{html.escape(str(rep))}</pre>"]
    if rep.attention:
        fused = sum(site.fused for site in rep.attention)
        parts.append(_records_section(f"attention sites ({fused} of {len(rep.attention)} fused)", rep.attention))
    if rep.casts:
        parts.append(_records_section(f"casts inserted by the precision pass ({len(rep.casts)})", rep.casts))
    for g in rep.graphs:
        parts.append(f"<h2>{html.escape(g.name)} graph</h2>")
        if g.graph_svg:
            parts.append(f"<details open><summary>graph after the passes (fused kernels in orange link to "
                         f"their source)</summary><div style='overflow:auto'>{g.graph_svg}</div></details>")
        if g.memory_plan is not None:
            parts.append(memory_svg(g.memory_plan))
        for k in g.kernels:
            parts.append(f"<h3 id='{k.name}'>{k.name} <small>[{k.kind}] {html.escape(', '.join(k.ops))}"
                         f"</small></h3><pre>{html.escape(k.source)}</pre>")
        parts.append(f"<details><summary>wrapper</summary><pre>{html.escape(g.wrapper_source)}</pre></details>")
        for p in g.passes:
            parts.append(f"<details><summary>after {html.escape(p.name)}</summary>"
                         f"<pre>{html.escape(p.text)}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _records_section(title: str, records: list) -> str:
    """A table of report records (AttentionSite, CastRecord), one column per field, the source line included."""
    names = [f.name for f in dataclasses.fields(records[0])]
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(getattr(r, n)))}</td>" for n in names) + "</tr>"
                   for r in records)
    return f"<h2>{html.escape(title)}</h2><table><tr>{head}</tr>{rows}</table>"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return "" if value is None else str(value)
