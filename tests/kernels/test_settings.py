"""The kernels' knobs: EngineConfig fields, validated, carried to the kernels as one KernelSettings (no triton)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from slora.backend.config import EngineConfig
from slora.kernels.settings import RETIRED_ENVIRONMENT, KernelSettings, warn_retired_environment

FIELDS = (
    "few_adapters_min_tokens", "few_adapters_max", "lora_split", "graph_lora_split", "lora_fused", "triton_gemm",
    "lora_pdl", "shrink_pdl",
)  # fmt: skip


def test_defaults_are_the_engines() -> None:
    """Few adapters: 32 tokens over at most 8 adapters; lora_split on, graph_lora_split and lora_fused off; the
    Triton GEMM and PDL on."""
    settings = EngineConfig().kernel_settings()
    assert settings == KernelSettings()
    assert dataclasses.astuple(settings) == (32, 8, True, False, False, True, True, True)
    assert tuple(f.name for f in dataclasses.fields(KernelSettings)) == FIELDS


def test_every_field_is_an_engine_option() -> None:
    """Strings as slora-serve --engine-option and config.pbtxt parameters give them."""
    values = {"few_adapters_min_tokens": "64", "few_adapters_max": "4", "lora_split": "false",
              "graph_lora_split": "true", "lora_fused": "1", "triton_gemm": "false", "lora_pdl": "0",
              "shrink_pdl": "False"}  # fmt: skip
    assert EngineConfig.from_dict(values).kernel_settings() == KernelSettings(64, 4, False, True, True, False, False,
                                                                              False)  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [("few_adapters_min_tokens", -1), ("few_adapters_max", 2.5), ("few_adapters_max", True), ("lora_split", "yes"),
     ("graph_lora_split", "no"), ("lora_fused", 1), ("triton_gemm", 1), ("lora_pdl", None), ("shrink_pdl", "true")],
)  # fmt: skip
def test_invalid_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        KernelSettings(**{field: value})  # type: ignore[arg-type]


def test_unparsable_option_strings_are_refused_naming_the_field() -> None:
    for field, value in (("few_adapters_max", "eight"), ("lora_pdl", "maybe")):
        with pytest.raises(ValueError, match=field):
            EngineConfig.from_dict({field: value})


def test_the_rule_for_few_adapters() -> None:
    rule = KernelSettings(few_adapters_min_tokens=64, few_adapters_max=8)
    assert rule.few_adapters(64, 8) and rule.few_adapters(500, 1)
    assert not rule.few_adapters(63, 8) and not rule.few_adapters(64, 9)
    assert not KernelSettings(few_adapters_max=0).few_adapters(1000, 1), "few_adapters_max=0: never"


def test_retired_environment_variables_are_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in RETIRED_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="slora.kernels.settings"):
        warn_retired_environment()
    assert not caplog.records
    monkeypatch.setenv("SLORA_TRITON_GEMM", "0")
    with caplog.at_level(logging.WARNING, logger="slora.kernels.settings"):
        warn_retired_environment()
    assert [r.getMessage() for r in caplog.records] == [
        "SLORA_TRITON_GEMM is no longer read: set EngineConfig's triton_gemm instead (slora-serve --engine-option, "
        "config.pbtxt parameters)"
    ]
