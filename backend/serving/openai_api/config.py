"""The OpenAI server's configuration: one frozen dataclass, parsed once from its command line (server.py)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SEPARATOR = "_lora_"  # `<base>_lora_<adapter>`, the example separator of Triton's OpenAI frontend


@dataclass(frozen=True)
class OpenAIConfig:
    """Where the OpenAI server listens, which Triton it drives, and how it names the models.

    `model` is the checkpoint folder (or `default`, the embedded model): its tokenizer renders chat templates, and
    its folder name is the base model's id unless `served_model_name` is given. `lora_separator` "" turns the
    `<base><separator><adapter>` form off; plain adapter names always work.
    """

    triton_url: str = "127.0.0.1:8001"  # the local Triton's gRPC endpoint
    host: str = "0.0.0.0"
    port: int = 9000
    model: str = "default"
    tokenizer: str | None = None  # tokenizer folder, if not the model's
    served_model_name: str | None = None
    lora_separator: str = DEFAULT_SEPARATOR
    triton_model: str = "slora"  # the engine model, with token-id inputs (the alias takes text only)
    models_ttl_s: float = 2.0  # how long the adapter list behind /v1/models is reused
    retry_after_s: int = 1  # the Retry-After of 429 and 503 answers
    admin_token: str | None = None  # sent with the adapter list command when the server requires one
    owned_by: str = "slora"
    graceful_shutdown_s: float = 5.0  # on SIGTERM, streams still open after this are cut (and their requests aborted)
    workers: int = 1  # server processes sharing the port: each streamed token costs ~50 µs of one process's CPU

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not self.triton_url or ":" not in self.triton_url:
            raise ValueError(f"triton_url must be HOST:PORT, got {self.triton_url!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        if not 0.0 <= self.models_ttl_s <= 3600.0:
            raise ValueError(f"models_ttl_s must be in [0, 3600], got {self.models_ttl_s}")
        if not 0 <= self.retry_after_s <= 3600:
            raise ValueError(f"retry_after_s must be in [0, 3600], got {self.retry_after_s}")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers must be in 1..64, got {self.workers}")
        if self.graceful_shutdown_s < 0:
            raise ValueError(f"graceful_shutdown_s must be >= 0, got {self.graceful_shutdown_s}")
