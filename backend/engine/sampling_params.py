"""Sampling parameters of one request: validated once, at the edge, with errors that name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from slora.backend.errors import InvalidRequestError

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits; beyond, it failed with "Overflow when unpacking"

# Keys of vLLM's SamplingParams that clients send with their neutral value; any other value is refused.
_NEUTRAL = {
    "n": 1,
    "best_of": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "logprobs": None,
    "prompt_logprobs": None,
    "use_beam_search": False,
    "min_tokens": 0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's names and defaults).

    temperature 0 is greedy. top_k -1 (or 0) and top_p 1 disable those filters. `seed` makes a sampled request
    reproducible on its own, whatever else shares its batch. Stop strings are cut from the output text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_float("temperature", self.temperature, minimum=0.0)
        _check_float("top_p", self.top_p, minimum=0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"sampling parameter 'top_p' must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, minimum=-1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"sampling parameter 'ignore_eos' must be a boolean, got {self.ignore_eos!r}")
        object.__setattr__(self, "stop", _string_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _int_tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON object (as sent in Triton's `sampling_parameters`); unknown keys are refused."""
        if not isinstance(values, dict):
            raise InvalidRequestError(f"sampling parameters must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key in known:
                kwargs[key] = value
            elif key in _NEUTRAL:
                if value != _NEUTRAL[key] and value is not None:
                    raise InvalidRequestError(
                        f"sampling parameter {key!r}={value!r} is not supported (only {_NEUTRAL[key]!r})"
                    )
            else:
                raise InvalidRequestError(f"unknown sampling parameter {key!r} (supported: {', '.join(sorted(known))})")
        if kwargs.get("top_k") == 0:
            kwargs["top_k"] = -1
        for key in ("temperature", "top_p"):
            if isinstance(kwargs.get(key), int) and not isinstance(kwargs[key], bool):
                kwargs[key] = float(kwargs[key])
        return cls(**kwargs)


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"sampling parameter {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(f"sampling parameter {name!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidRequestError(f"sampling parameter {name!r} must be <= {maximum}, got {value}")


def _check_float(name: str, value: object, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"sampling parameter {name!r} must be a finite number, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(f"sampling parameter {name!r} must be >= {minimum}, got {value}")


def _string_tuple(value: object) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise InvalidRequestError(
            f"sampling parameter 'stop' must be a non-empty string or a list of them, got {value!r}"
        )
    return tuple(items)


def _int_tuple(value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        raise InvalidRequestError(f"sampling parameter 'stop_token_ids' must be a list of token ids, got {value!r}")
    return tuple(value)
