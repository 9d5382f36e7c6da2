"""The OpenAI server's entry point: `python -m slora.backend.serving.openai_api.server --triton-url HOST:PORT ...`.

slora-serve starts it with --openai-port once Triton is ready (launch.py) and stops it, with SIGTERM, before Triton
drains. On SIGTERM uvicorn stops accepting connections and gives open streams `--graceful-shutdown-s` to end; the
rest are cut, and each cut stream aborts its request in slora. `--workers N` runs N server processes on the port
(uvicorn's own supervisor), for more concurrent streams than one process's event loop can carry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slora.backend.model.default_model import resolve_model_path
from slora.backend.serving.admin_guard import read_token
from slora.backend.serving.openai_api.config import DEFAULT_SEPARATOR, OpenAIConfig

logger = logging.getLogger("slora.openai")

CONFIG_ENV = "SLORA_OPENAI_CONFIG"  # the configuration, as JSON, handed from this process to its uvicorn workers
WORKER_MODULE = "slora.backend.serving.openai_api.server"  # this module's import name (not __main__ under -m)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slora-openai", description="OpenAI-compatible API over slora in Triton")
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="the local Triton's gRPC HOST:PORT")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--model", default="default", help="the served checkpoint folder, or 'default'")
    parser.add_argument("--tokenizer", help="tokenizer folder for chat templates (default: the model's)")
    parser.add_argument("--served-model-name", help="the base model's id (default: the model folder's name)")
    parser.add_argument("--lora-separator", default=DEFAULT_SEPARATOR,
                        help="also accept <base><separator><adapter> as a model name ('' turns it off)")  # fmt: skip
    parser.add_argument("--triton-model", default="slora", help="the Triton model to call")
    parser.add_argument("--models-ttl-s", type=float, default=2.0, help="seconds the adapter list is reused")
    parser.add_argument("--retry-after-s", type=int, default=1, help="Retry-After of 429 and 503 answers")
    parser.add_argument("--admin-token-file", help="slora-serve's --admin-token-file, for the adapter list")
    parser.add_argument("--graceful-shutdown-s", type=float, default=5.0,
                        help="on SIGTERM, seconds open streams may take to end before they are cut")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1,
                        help="server processes sharing the port (more for many concurrent streams)")  # fmt: skip
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def config_from(args: argparse.Namespace) -> OpenAIConfig:
    """The validated configuration of parsed arguments; raises ValueError naming a bad option."""
    return OpenAIConfig(
        triton_url=args.triton_url,
        host=args.host,
        port=args.port,
        model=args.model,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        lora_separator=args.lora_separator,
        triton_model=args.triton_model,
        models_ttl_s=args.models_ttl_s,
        retry_after_s=args.retry_after_s,
        admin_token=read_token(Path(args.admin_token_file)) if args.admin_token_file else None,
        graceful_shutdown_s=args.graceful_shutdown_s,
        workers=args.workers,
    )


def base_model_name(config: OpenAIConfig, model_path: Path) -> str:
    """The base model's id: --served-model-name, else the checkpoint folder's name (SmolLM2-135M-Instruct for the
    embedded default model)."""
    return config.served_model_name or model_path.resolve().name


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s slora-openai %(levelname)s %(message)s")
    try:
        config = config_from(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    return serve(config, args.log_level)


def serve(config: OpenAIConfig, log_level: str = "info") -> int:
    """Run the server until SIGTERM / Ctrl-C. With several workers, uvicorn starts each from `worker_app`, which
    reads the configuration from the environment this process passes on."""
    import uvicorn

    options = {"host": config.host, "port": config.port, "log_level": log_level,
               "timeout_graceful_shutdown": config.graceful_shutdown_s}  # fmt: skip
    if config.workers == 1:
        uvicorn.run(build(config), **options)
    else:
        os.environ[CONFIG_ENV] = json.dumps(dataclasses.asdict(config))
        uvicorn.run(f"{WORKER_MODULE}:worker_app", factory=True, workers=config.workers, **options)
    return 0


def worker_app() -> Any:
    """One worker's app (uvicorn --workers), configured like its parent."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s slora-openai %(levelname)s %(message)s")
    return build(OpenAIConfig(**json.loads(os.environ[CONFIG_ENV])))


def build(config: OpenAIConfig) -> Any:
    """The app for `config`: the base model's name and chat template come from the model (or tokenizer) folder."""
    from slora.backend.serving.openai_api.app import build_app
    from slora.backend.serving.openai_api.chat import ChatRenderer

    model_path = resolve_model_path(config.model)
    chat = ChatRenderer.from_folder(config.tokenizer or model_path)
    return build_app(config, base_model_name(config, model_path), chat)


if __name__ == "__main__":
    sys.exit(main())
