"""The host-side cdiv / next_power_of_2 agree with Triton's (which are slow constexpr functions on the host)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from slora.kernels.triton.launch import cdiv, next_power_of_2  # noqa: E402


def test_cdiv_and_next_power_of_2_match_triton() -> None:
    for n in [*range(0, 70), 255, 256, 257, 4095, 4096, 11008, 2**31 - 1, 2**31 + 5]:
        assert next_power_of_2(max(n, 1)) == triton.next_power_of_2(max(n, 1)), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
