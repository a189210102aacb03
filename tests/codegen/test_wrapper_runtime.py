"""The wrappers' own grid arithmetic (plain Python, cheaper per call than Triton's constexpr functions)
gives Triton's answers."""
import triton

from fxopt.codegen.wrapper_runtime import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_agree_with_triton():
    for n in [0, 1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 4095, 4096, 4097, 131072, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 2, 3, 16, 128, 1000, 1024):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
