"""benchmarks/compile_seconds.py measures what it says: one compiled training step of a block stack, whose
report holds a forward and a backward graph with their passes."""
from benchmarks import compile_seconds


def test_compile_seconds_reports_both_graphs_of_a_small_stack(capsys):
    report, wall = compile_seconds.measure(layers=2, d_model=32, tokens=8, device="cpu")
    names = [g.name for g in report.graphs]
    assert names == ["forward", "backward"] and wall > 0
    for g in report.graphs:
        assert 0 < sum(p.seconds for p in g.passes) <= g.compile_seconds
        assert {"fuse", "fuse_reductions"} <= {p.name for p in g.passes}
    compile_seconds.main(["--layers", "1", "--d-model", "32", "--tokens", "8"])
    out = capsys.readouterr().out
    assert "1 GPT-2 blocks" in out and "backward: compile" in out
