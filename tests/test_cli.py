"""The CLI (python -m fxopt explain|profile) and the dumps it writes: options passed through, every
file there and working, report.html well formed with attention and casts, graphviz used when present.
(The first CLI test, bad paths and factories of explain, is in test_api.py.)"""
import dataclasses
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch

import fxopt
from fxopt import graph_svg
from fxopt.__main__ import main
from fxopt.dump import report_html
from fxopt.report import CastRecord, Report

MODEL = """import torch
def make():
    def f(x, w):
        y = torch.relu(x @ w) * 2 + 1
        return torch.softmax(y, -1)
    return f, (torch.randn(8, 16), torch.randn(16, 4))
"""


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return path


class WellFormed(HTMLParser):
    """html.parser with a stack: every element that is opened is closed, in order."""

    VOID = {"meta", "br", "hr", "img", "input", "link"}

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1:]}>"
        self.stack.pop()


def assert_well_formed(html: str) -> None:
    parser = WellFormed()
    parser.feed(html)
    parser.close()
    assert parser.stack == [], f"never closed: {parser.stack}"


def test_explain_end_to_end_with_options(model_file, tmp_path):
    dump = tmp_path / "dump"
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "fxopt", "explain", f"{model_file}:make", "--dump", str(dump),
                          "--dump-all-passes", "--precision", "fp32", "--verify", "--no-attention"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "fuse_attention" not in out.stdout and "codegen" in out.stdout  # no attention pass; verify ran
    files = {str(p.relative_to(dump)) for p in dump.rglob("*") if p.is_file()}
    assert {"report.html", "report.txt", "wrapper.py", "memory.svg"} <= files
    assert any(f.endswith("_recompute_for_reductions.txt") for f in files)  # changed nothing, dumped anyway
    assert_well_formed((dump / "report.html").read_text())
    kernel = sorted(dump.glob("kernels/*.py"))[0]
    run = subprocess.run([sys.executable, str(kernel)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_profile_command_prints_the_table(model_file, capsys):
    assert main(["profile", f"{model_file}:make", "--warmup", "1", "--repeat", "1", "--no-fuse"]) == 0
    out = capsys.readouterr().out
    assert "CPU wall clock" in out and "% of roofline" in out and "matmul" in out
    assert "fused_" not in out  # --no-fuse reached the backend: every op is an ATen call


@pytest.mark.parametrize("argv, message", [
    (["explain", "{model}:make", "--bogus"], "unrecognized arguments: --bogus"),
    (["explain", "{model}:make", "--precision", "int4"], "invalid choice: 'int4'"),
    (["explain", "{model}:make", "--dump-all-passes"], "--dump-all-passes needs --dump DIR"),
    (["profile", "{model}:make", "--repeat", "0"], "--repeat >= 1"),
    (["profile"], "the following arguments are required: target"),
    (["inspect", "{model}:make"], "invalid choice: 'inspect'"),
])
def test_bad_arguments_are_usage_errors(model_file, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main([a.replace("{model}", str(model_file)) for a in argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("target, message", [
    ("missing.py:make", "no such file: missing.py"),
    ("{model}:nope", "has no function 'nope'"),
    ("{model}", "expected FILE.py:FACTORY"),
])
def test_bad_targets_name_the_problem(model_file, target, message):
    with pytest.raises(SystemExit, match=message):
        main(["profile", target.replace("{model}", str(model_file))])


@pytest.mark.parametrize("returns, message", [
    ("f", "must return \\(model, example_inputs\\), got function"),
    ("f, (torch.randn(3),), 1", "got tuple of length 3"),
    ("f, 5", "must be a tensor or a tuple"),
])
def test_factories_returning_something_else_are_named(tmp_path, returns, message):
    path = tmp_path / "odd.py"
    path.write_text(f"import torch\ndef make():\n    f = lambda x: x * 2\n    return {returns}\n")
    with pytest.raises(SystemExit, match=message):
        main(["explain", f"{path}:make"])


def test_a_single_tensor_input_is_one_input_not_its_rows(tmp_path, capsys):
    """(model, tensor) was unpacked along the tensor's first dim: each row a separate argument."""
    path = tmp_path / "one.py"
    path.write_text("import torch\ndef make():\n    return (lambda x: (x * 2).softmax(-1)), torch.randn(3, 5)\n")
    main(["explain", f"{path}:make"])  # (three [5] rows would be three arguments: a TypeError)
    assert "fused_mul_amax_sub_exp_0" in capsys.readouterr().out


def test_fxopt_dump_all_writes_passes_that_changed_nothing(tmp_path, monkeypatch):
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    rep = fxopt.explain(lambda x, w: torch.relu(x @ w), x, w)
    unchanged = [p.name for p in rep.passes if not p.changed]
    assert "recompute_for_reductions" in unchanged
    rep.save(str(tmp_path / "default"))
    monkeypatch.setenv("FXOPT_DUMP_ALL", "1")
    rep.save(str(tmp_path / "all"))
    default = {p.name for p in (tmp_path / "default" / "passes").iterdir()}
    every = {p.name for p in (tmp_path / "all" / "passes").iterdir()}
    assert default < every
    assert all(any(f.endswith(f"_{name}.txt") for f in every - default) for name in unchanged)


def attention(q, k, v):
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return torch.softmax(scores, dim=-1) @ v


def test_report_html_lists_attention_sites_and_casts():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    rep = fxopt.explain(attention, q, k, v)
    assert rep.attention
    rep.casts = [CastRecord(*[f"{f.name}-value" for f in dataclasses.fields(CastRecord)])]
    html = report_html(rep)
    assert_well_formed(html)
    assert "attention sites (1 of 1 fused)" in html and "casts inserted by the precision pass (1)" in html
    assert "torch.softmax(scores, dim=-1) @ v" in html  # the model's source line
    assert all(f"{f.name}-value" in html for f in dataclasses.fields(CastRecord))
    assert_well_formed(report_html(Report()))


def _final_graph():
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    rep = fxopt.explain(lambda x, w: torch.softmax(torch.relu(x @ w) * 2, -1), x, w)
    return rep, rep.graph(after="cleanup_after_fuse")


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz (dot) is not installed")
def test_graphviz_lays_out_the_graph_with_kernels_still_linked():
    rep, gm = _final_graph()
    nodes = list(gm.graph.nodes)
    layout = graph_svg.dot_layout(nodes, [(a, n) for n in nodes for a in n.all_input_nodes])
    assert layout is not None and set(layout.boxes) == set(nodes)
    svg = rep.graphs[0].graph_svg
    assert " C" in svg  # dot's routed edges are curves; the built-in layers draw straight lines
    assert all(f'<a href="#{k.name}">' in svg for k in rep.kernels)
    assert svg.count("<rect") == len(nodes)


@pytest.mark.parametrize("script", ["exit 1", "echo not a layout", "exec sleep 5"])
def test_a_failing_dot_falls_back_to_the_layered_drawing(tmp_path, monkeypatch, script):
    fake = tmp_path / "dot"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(graph_svg, "DOT_TIMEOUT_S", 0.5)
    _, gm = _final_graph()
    nodes = list(gm.graph.nodes)
    assert graph_svg.dot_layout(nodes, []) is None
    svg = graph_svg.graph_svg(gm, {})
    assert svg.count("<rect") == len(nodes) and " C" not in svg


def test_model_file_with_a_dataclass_loads(tmp_path, capsys):
    """dataclasses look their module up in sys.modules: the CLI must register the file it loads."""
    path = tmp_path / "dc_model.py"
    path.write_text("import dataclasses, torch\n"
                    "@dataclasses.dataclass\nclass Config:\n    width: int = 8\n"
                    "def make():\n    c = Config()\n    return (lambda x: torch.relu(x) * 2), (torch.randn(4, c.width),)\n")
    assert main(["explain", f"{path}:make"]) in (0, None)
    assert "fuse" in capsys.readouterr().out
