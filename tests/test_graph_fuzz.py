"""benchmarks.graph_fuzz, the random-program search for wrong results: its judge flags what it should, its
layouts keep the values, and a few programs of every op family run clean through fxopt in the interpreter."""
import pytest
import torch

from benchmarks import graph_fuzz


@pytest.mark.parametrize("how", ["contiguous", "transposed", "strided", "offset"])
def test_layouts_keep_values_and_change_strides(how):
    t = torch.randn(5, 7)
    got = graph_fuzz.laid_out(t, how)
    assert torch.equal(got, t)
    layout = (got.stride(), got.storage_offset())
    assert layout == {"contiguous": ((7, 1), 0), "transposed": ((1, 5), 0), "strided": ((14, 2), 0),
                      "offset": ((7, 1), 3)}[how]


def test_judge_accepts_eager_like_results_and_flags_wrong_ones():
    ref = torch.linspace(-2, 2, 64, dtype=torch.float64)
    eager = ref.float()
    assert graph_fuzz.differs(eager.clone(), eager, ref, 1e-4) is None
    wrong = eager.clone()
    wrong[5] += 1e-2
    assert "beyond eager's" in graph_fuzz.differs(wrong, eager, ref, 1e-4)
    nan = eager.clone()
    nan[3] = float("nan")
    assert graph_fuzz.differs(nan, eager, ref, 1e-4) == "NaN/inf places differ"
    assert "shape/dtype" in graph_fuzz.differs(eager.double(), eager, ref, 1e-4)


def test_programs_with_every_op_family_and_layout_match_eager(capsys):
    assert graph_fuzz.main(["--device", "cpu", "--programs", "3", "--more", "6", "--layouts", "--seed", "40"]) == 0
    assert "3 programs, 0 mismatches" in capsys.readouterr().out
