"""benchmarks.attention_fuzz, random hand-written attention against eager: a few programs run clean through
fxopt (some fused, some left unfused), and its judge flags a wrong, NaN-placed or crashing compiled result."""
import random

import pytest
import torch

from benchmarks import attention_fuzz

SEED = 3  # its first programs hold fused sites and unfused near misses


def test_a_few_programs_match_eager_and_fuse_some(device):
    printed = []
    s = attention_fuzz.fuzz(device, 8, SEED, torch.float32, out=printed.append)
    assert not [kind for _, kind in s.bad if kind != "known"], "\n".join(printed)
    assert s.fused >= 1 and s.unfused >= 1 and s.skipped < s.programs, (s.fused, s.unfused, s.skipped)


def test_fp16_programs_match_eager(device):
    printed = []
    s = attention_fuzz.fuzz(device, 3, SEED, torch.float16, out=printed.append)
    assert not [kind for _, kind in s.bad if kind != "known"], "\n".join(printed)


def _perturbing(how):
    """A stand-in for fxopt: the program run eagerly, its first output made wrong in a differentiable way."""
    def compile_fn(fn, report):
        def wrong(*args):
            out = fn(*args)
            out = out[0] if isinstance(out, tuple) else out
            if how == "none":
                return out
            if how == "raise":
                raise RuntimeError("simulated compiler crash")
            if how == "nan":
                return out.index_put((torch.tensor([0]),), torch.tensor(float("nan"), device=out.device))
            return out + 1e-2 * out.detach().abs().amax()
        return wrong
    return compile_fn


@pytest.mark.parametrize("how, expect", [("offset", "beyond eager's"), ("nan", "NaN/inf places differ"),
                                          ("raise", "simulated compiler crash")])
def test_the_judge_flags_a_wrong_compiled_result(device, how, expect):
    source, _, _ = attention_fuzz.program(random.Random(1), torch.float32, near_misses=0.0)
    clean = attention_fuzz.check(source, torch.float32, device, grad=True, compile_fn=_perturbing("none"))
    assert clean.skipped is None and clean.backward
    wrong = attention_fuzz.check(source, torch.float32, device, grad=True, compile_fn=_perturbing(how))
    assert wrong.problems and any(expect in why for _, why in wrong.problems), wrong.problems
    assert wrong.problems[0][0] == ("crash" if how == "raise" else "out0")


def test_clean_stand_in_passes_and_gradient_noise_is_judged_on_the_programs_scale():
    source, _, _ = attention_fuzz.program(random.Random(1), torch.float32, near_misses=0.0)
    unchanged = lambda fn, report: fn  # noqa: E731
    assert attention_fuzz.check(source, torch.float32, "cpu", grad=True, compile_fn=unchanged).problems == []
    ref = torch.zeros(16, dtype=torch.float64)  # dq of rows that keep one key: exactly zero, noise in fxopt
    noisy = ref.float() + 3e-6
    assert "beyond eager's" in attention_fuzz.judge(noisy, ref.float(), ref, 1e-4)
    assert attention_fuzz.judge(noisy, ref.float(), ref, 1e-4, floor=0.3) is None
    assert "beyond eager's" in attention_fuzz.judge(ref.float() + 1e-3, ref.float(), ref, 1e-4, floor=0.3)


def test_bfloat16_is_refused_on_the_cpu(capsys):
    with pytest.raises(SystemExit):
        attention_fuzz.main(["--device", "cpu", "--dtype", "bfloat16"])
    assert "needs --device cuda" in capsys.readouterr().err
