"""Options of the served `slora` model: parsed once from its config.pbtxt parameters (rendered by slora-serve).

Every parameter is a string. The serving keys below are read here; every other key is an EngineConfig field and
goes to `EngineConfig.from_dict`, which refuses unknown names. A `multi_lora.json` in the model's version folder
(where Triton's vLLM backend reads it) is the adapter registry unless `adapter_registry` names another file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slora.backend.config import EngineConfig

MULTI_LORA_FILE = "multi_lora.json"


@dataclass(frozen=True)
class ServingOptions:
    engine: EngineConfig
    default_max_tokens: int | None = None  # when a request names none (else SamplingParams' default)
    adapter_admin: bool = True  # accept adapter_command requests (load/unload/list)
    lora_info_metric: bool = False  # export vllm:lora_requests_info (Gateway API Inference Extension)
    cancel_check_s: float = 0.2  # how often in-flight requests are checked for client cancellation
    engine_process: bool = True  # run the engine in a process of its own (else on a thread of the stub)
    drain_file: str | None = None  # slora-serve writes it before it stops Triton (drain.py)
    apply_chat_template: bool = False  # text requests that do not say are rendered with the chat template
    lora_registry_write_back: bool = False  # runtime loads/unloads written to the adapter_registry file
    admin_token_file: str | None = None  # admin commands need the token this file holds (admin_guard.py)
    health_file: str | None = None  # where the engine's health is written for slora-serve (health.py)
    registry_journal: str | None = None  # runtime adapter registrations kept for the model loaded again
    watchdog_timeout_s: float = 60.0  # an engine whose loop stops going round this long is killed (0: never)
    in_stub_restarts: int = 3  # engine processes started again by the model itself (slora-serve: 0, it reloads)
    engine_restarts: int = 0  # restarts before this model was loaded (slora-serve counts them across reloads)
    failed_reason: str | None = None  # set by slora-serve for an engine that will not serve again: refuse to load

    def __post_init__(self) -> None:
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if not 0.0 < self.cancel_check_s <= 60.0:
            raise ValueError(f"cancel_check_s must be in (0, 60], got {self.cancel_check_s}")
        if not 0.0 <= self.watchdog_timeout_s < float("inf"):
            raise ValueError(f"watchdog_timeout_s must be >= 0 (0: off), got {self.watchdog_timeout_s}")
        for name in ("in_stub_restarts", "engine_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def watchdog_s(self) -> float | None:
        return self.watchdog_timeout_s or None

    @classmethod
    def from_parameters(cls, parameters: dict[str, str], version_dir: Path | None = None) -> ServingOptions:
        values = dict(parameters)
        serving: dict[str, Any] = {}
        if "default_max_tokens" in values:
            text = values.pop("default_max_tokens")
            serving["default_max_tokens"] = _int(text, "default_max_tokens") if text else None
        for key in (
            "adapter_admin",
            "lora_info_metric",
            "engine_process",
            "apply_chat_template",
            "lora_registry_write_back",
        ):
            if key in values:
                serving[key] = _bool(values.pop(key), key)
        for key in ("cancel_check_s", "watchdog_timeout_s"):
            if key in values:
                serving[key] = _float(values.pop(key), key)
        for key in ("in_stub_restarts", "engine_restarts"):
            if key in values:
                serving[key] = _int(values.pop(key), key)
        for key in ("drain_file", "admin_token_file", "health_file", "registry_journal", "failed_reason"):
            if key in values:
                serving[key] = values.pop(key) or None
        registry = version_dir / MULTI_LORA_FILE if version_dir is not None else None
        if not values.get("adapter_registry") and registry is not None and registry.is_file():
            values["adapter_registry"] = str(registry)
        return cls(engine=EngineConfig.from_dict({k: v for k, v in values.items() if v != ""}), **serving)


def model_config_parameters(model_config: dict[str, Any]) -> dict[str, str]:
    """config.pbtxt `parameters { key: ... value: { string_value: ... } }` as a plain dict."""
    return {key: value.get("string_value", "") for key, value in (model_config.get("parameters") or {}).items()}


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer, got {text!r}") from exc


def _float(text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError as exc:
        raise ValueError(f"{name} must be a number, got {text!r}") from exc


def _bool(text: str, name: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"{name} must be true or false, got {text!r}")
    return lowered in ("true", "1", "yes")
