"""The kernels' tuning knobs as one frozen value, built once from EngineConfig where the engine builds its ops.

Nothing in kernels/ reads a knob from the environment: the engine passes a KernelSettings to make_ops and to its
decode graphs (backend/engine/startup.py), tests and benchmarks pass their own. Each field has the name and the
meaning of the EngineConfig field it comes from (documented there). The only environment variable read here is
Triton's own TRITON_INTERPRET, which says whether the kernels run in Triton's CPU interpreter.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Environment variables that set these knobs before they were EngineConfig fields; no longer read (a warning says
# which fields replace them, so that an old command line does not silently measure the defaults).
RETIRED_ENVIRONMENT = {
    "SLORA_FEW_ADAPTERS": "few_adapters_min_tokens and few_adapters_max",
    "SLORA_LORA_SPLIT": "lora_split",
    "SLORA_TRITON_GEMM": "triton_gemm",
    "SLORA_LORA_PDL": "lora_pdl",
    "SLORA_SHRINK_PDL": "shrink_pdl",
}


@dataclass(frozen=True)
class KernelSettings:
    """How the Triton kernels run a step (EngineConfig's fields of the same names); invalid values raise ValueError
    naming the field. The torch reference ops ignore them."""

    few_adapters_min_tokens: int = 32  # a step of at least this many adapter tokens ...
    few_adapters_max: int = 8  # ... over at most this many adapters gets the tensor-core LoRA tiles (few_adapters)
    lora_split: bool = True  # an eager step's decodes in LoRA launches apart from its prompts
    graph_lora_split: bool = False  # a graph of steps with prompts' LoRA launched as lora_split launches it
    lora_fused: bool = False  # decodes of many adapters on the fused LoRA kernel (triton/lora_fused.py)
    triton_gemm: bool = True  # base projections of steps of up to 64 rows on the Triton GEMM (triton/projection.py)
    lora_pdl: bool = True  # programmatic dependent launch of the LoRA kernels where the GPU allows (triton/pdl.py)
    shrink_pdl: bool = True  # the LoRA shrink, too, launched with PDL behind the Triton GEMM (needs lora_pdl)

    def __post_init__(self) -> None:
        for name in ("few_adapters_min_tokens", "few_adapters_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("lora_split", "graph_lora_split", "lora_fused", "triton_gemm", "lora_pdl", "shrink_pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def few_adapters(self, num_tokens: int, num_adapters: int) -> bool:
        """Whether num_tokens adapter tokens of num_adapters adapters get the LoRA kernels' 16-token tensor-core
        tiles even when they are all decodes: those tiles read an adapter's rows once per 16 tokens, the GEMV
        kernels once per token (from cache after the first), which pays off once an adapter has many tokens."""
        return num_tokens >= self.few_adapters_min_tokens and num_adapters <= self.few_adapters_max


DEFAULT_SETTINGS = KernelSettings()  # for tests, benchmarks and callers that pass none (the engine always does)


def settings_from(values: object) -> KernelSettings:
    """The KernelSettings of an object with attributes of the same names (EngineConfig)."""
    return KernelSettings(**{f.name: getattr(values, f.name) for f in dataclasses.fields(KernelSettings)})


def triton_interpreted() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (TRITON_INTERPRET=1, read by triton itself)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def warn_retired_environment() -> None:
    """Log a warning for each retired SLORA_* variable that is set: it no longer changes anything."""
    for name, fields in RETIRED_ENVIRONMENT.items():
        if name in os.environ:
            logger.warning("%s is no longer read: set EngineConfig's %s instead (slora-serve --engine-option, "
                           "config.pbtxt parameters)", name, fields)  # fmt: skip
