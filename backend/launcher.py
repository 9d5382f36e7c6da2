"""`slora-serve`: start Triton with the slora model repository, wait until it is ready, stop it on Ctrl-C.

    slora-serve --model default --adapter-dir adapters/ --device cpu
    slora-serve --model /models/Llama-3.1-8B --adapter-dir /adapters --device cuda --max-num-seqs 128

Steps: find the server and the Python stub for this interpreter (server_locator.py), resolve the model (the
default one is converted once), check the engine options, render the model repository with them
(model_repository.py), run tritonserver with its output shown here, poll readiness, forward Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from slora.backend.config import EngineConfig
from slora.backend.default_model import resolve_model_path
from slora.backend.model_repository import render_repository
from slora.backend.server_locator import TritonInstall, locate_server
from slora.backend.stub_compat import numpy_problem, stub_numpy_version

logger = logging.getLogger("slora.serve")

# Flags that map one-to-one onto EngineConfig fields (flag dest == field name).
ENGINE_FLAGS = ("device", "dtype", "max_model_len", "max_num_seqs", "max_batch_tokens", "max_waiting",
                "page_size", "pool_bytes", "pool_fraction", "kernel_backend", "max_lora_rank", "seed")  # fmt: skip


@dataclass(frozen=True)
class LaunchOptions:
    model: str = "default"
    tokenizer: str | None = None
    adapter_dir: str | None = None
    lora_registry: str | None = None
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "0.0.0.0"
    engine: dict[str, str] = field(default_factory=dict)  # EngineConfig fields as strings
    chat_template: bool = False
    default_max_tokens: int | None = None
    lora_info_metric: bool = False
    cancel_check_s: float | None = None
    adapter_admin: bool = True
    engine_process: bool = True
    workspace: str | None = None
    log_verbose: int = 0
    ready_timeout_s: float = 900.0
    server_args: tuple[str, ...] = ()
    dry_run: bool = False

    def __post_init__(self) -> None:
        ports = {"http_port": self.http_port, "grpc_port": self.grpc_port, "metrics_port": self.metrics_port}
        for name, port in ports.items():
            if not 1 <= port <= 65535:
                raise ValueError(f"{name} must be in 1..65535, got {port}")
        if len(set(ports.values())) != 3:
            raise ValueError(f"the HTTP, gRPC and metrics ports must differ, got {ports}")
        for name in ("adapter_dir", "lora_registry"):
            path = getattr(self, name)
            if path and not Path(path).exists():
                raise ValueError(f"{name}: {path} does not exist")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slora-serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="checkpoint folder, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the model's)")
    parser.add_argument("--adapter-dir", help="adapter root: <dir>/<name>/adapter_config.json")
    parser.add_argument("--lora-registry", help='multi_lora.json: {"name": "path", ...}')
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--host", default="0.0.0.0", help="address the three endpoints listen on")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    for flag in ENGINE_FLAGS[2:]:
        parser.add_argument(f"--{flag.replace('_', '-')}", help=f"engine option {flag} (see EngineConfig)")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="any EngineConfig field, e.g. host_budget_bytes=4GiB (repeatable)")  # fmt: skip
    parser.add_argument("--chat-template", action="store_true",
                        help="apply the model's chat template to text_input by default (ensemble)")  # fmt: skip
    parser.add_argument("--default-max-tokens", type=int, help="max_tokens of requests that give none")
    parser.add_argument("--lora-info-metric", action="store_true",
                        help="export vllm:lora_requests_info for the Gateway API Inference Extension")  # fmt: skip
    parser.add_argument("--cancel-check-s", type=float,
                        help="seconds between cancellation checks of each in-flight request (0.2)")  # fmt: skip
    parser.add_argument("--no-adapter-admin", action="store_true", help="refuse adapter load/unload/list requests")
    parser.add_argument("--engine-in-stub", action="store_true",
                        help="run the engine on a thread of the Python stub, not in a process of its own")  # fmt: skip
    parser.add_argument("--workspace", help="folder for the rendered repository (default: a temporary folder)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the models")
    parser.add_argument("--server-arg", action="append", default=[], help="extra tritonserver argument (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="render the repository, show the command, stop")
    return parser


def parse_options(argv: Sequence[str] | None = None) -> LaunchOptions:
    args = build_parser().parse_args(argv)
    engine = {flag: str(getattr(args, flag)) for flag in ENGINE_FLAGS if getattr(args, flag) is not None}
    for item in args.engine_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option expects KEY=VALUE, got {item!r}")
        engine[key.strip()] = value.strip()
    return LaunchOptions(
        model=args.model,
        tokenizer=args.tokenizer,
        adapter_dir=args.adapter_dir,
        lora_registry=args.lora_registry,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        engine=engine,
        chat_template=args.chat_template,
        default_max_tokens=args.default_max_tokens,
        lora_info_metric=args.lora_info_metric,
        cancel_check_s=args.cancel_check_s,
        adapter_admin=not args.no_adapter_admin,
        engine_process=not args.engine_in_stub,
        workspace=args.workspace,
        log_verbose=args.log_verbose,
        ready_timeout_s=args.ready_timeout,
        server_args=tuple(args.server_arg),
        dry_run=args.dry_run,
    )


def repository_parameters(options: LaunchOptions, model_path: Path) -> dict[str, dict[str, str]]:
    """Each model's config.pbtxt parameters; the engine's are checked here, before the server starts."""
    engine = dict(options.engine)
    engine["model"] = str(model_path)
    if options.tokenizer:
        engine["tokenizer"] = str(Path(options.tokenizer).resolve())
    if options.adapter_dir:
        engine["adapter_root"] = str(Path(options.adapter_dir).resolve())
    if options.lora_registry:
        engine["adapter_registry"] = str(Path(options.lora_registry).resolve())
    EngineConfig.from_dict(engine)  # refuses unknown keys and bad values, naming them
    slora = {
        **engine,
        "adapter_admin": str(options.adapter_admin).lower(),
        "lora_info_metric": str(options.lora_info_metric).lower(),
        "engine_process": str(options.engine_process).lower(),
    }
    if options.default_max_tokens is not None:
        slora["default_max_tokens"] = str(options.default_max_tokens)
    if options.cancel_check_s is not None:
        slora["cancel_check_s"] = str(options.cancel_check_s)
    text = {"tokenizer": engine.get("tokenizer", str(model_path))}
    return {
        "slora": slora,
        "preprocessing": {**text, "apply_chat_template": str(options.chat_template).lower()},
        "postprocessing": text,
    }


def server_command(install: TritonInstall, repository: Path, options: LaunchOptions) -> list[str]:
    command = [
        str(install.binary),
        f"--model-repository={repository}",
        f"--backend-directory={install.backend_dir}",
        f"--http-port={options.http_port}",
        f"--grpc-port={options.grpc_port}",
        f"--metrics-port={options.metrics_port}",
        f"--http-address={options.host}",
        f"--grpc-address={options.host}",
        f"--metrics-address={options.host}",
        "--allow-metrics=true",
        "--disable-auto-complete-config",
        "--exit-on-error=true",
        "--strict-readiness=true",
        f"--log-verbose={options.log_verbose}",
    ]
    if _cpu_only(options.engine.get("device", "auto")):
        command += ["--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0"]
    return command + list(options.server_args)


def _cpu_only(device: str) -> bool:
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s slora-serve %(levelname)s %(message)s")
    try:
        options = parse_options(argv)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    workspace = Path(options.workspace) if options.workspace else Path(tempfile.mkdtemp(prefix="slora-serve-"))
    workspace.mkdir(parents=True, exist_ok=True)
    try:
        return _serve(options, workspace.resolve())
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        logger.info("interrupted before the server started")
        return 130
    finally:
        if not options.workspace:
            shutil.rmtree(workspace, ignore_errors=True)


def _serve(options: LaunchOptions, workspace: Path) -> int:
    install = locate_server(workspace)
    env = {**os.environ, **install.env}
    problem = numpy_problem(stub_numpy_version(env))
    if problem:
        raise RuntimeError(problem)
    logger.info("model: %s", options.model)
    model_path = resolve_model_path(options.model)  # the default model is converted here, once
    repository = render_repository(workspace / "model_repository", repository_parameters(options, model_path))
    command = server_command(install, repository, options)
    if options.dry_run:
        logger.info("repository: %s", repository)
        for key, value in install.env.items():
            logger.info("env %s=%s", key, value)
        logger.info("command: %s", " ".join(command))
        return 0
    return run_server(command, env, options)


def run_server(command: list[str], env: dict[str, str], options: LaunchOptions) -> int:
    """Run tritonserver until it exits or we are asked to stop; returns its exit status (0 after a clean stop)."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    logger.info("starting: %s", " ".join(command))
    process = subprocess.Popen(command, env=env, preexec_fn=_child_setup)
    try:
        if _wait_ready(process, options, stop):
            _announce(options)
            while process.poll() is None and not stop.wait(0.5):
                pass
    finally:
        code = _shutdown(process)
    return 0 if stop.is_set() and code in (0, -signal.SIGTERM) else code


def _child_setup() -> None:
    # Own session: a terminal's Ctrl-C reaches only us, and we stop the server once, cleanly. If we die, the
    # server gets SIGTERM (PR_SET_PDEATHSIG) instead of lingering.
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _wait_ready(process: subprocess.Popen, options: LaunchOptions, stop: threading.Event) -> bool:
    url = f"http://127.0.0.1:{options.http_port}/v2/health/ready"
    started = time.monotonic()
    reported = started
    while not stop.is_set():
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with status {process.returncode} before it was ready")
        if _is_ready(url):
            logger.info("ready after %.1f s", time.monotonic() - started)
            return True
        now = time.monotonic()
        if now - started > options.ready_timeout_s:
            raise RuntimeError(f"the models were not ready after {options.ready_timeout_s:.0f} s")
        if now - reported >= 10.0:
            logger.info("waiting for the models to load (%.0f s)", now - started)
            reported = now
        stop.wait(0.5)
    return False


def _is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _announce(options: LaunchOptions) -> None:
    host = "localhost" if options.host in ("0.0.0.0", "::") else options.host
    logger.info("serving: HTTP http://%s:%d  gRPC %s:%d  metrics http://%s:%d/metrics", host, options.http_port,
                host, options.grpc_port, host, options.metrics_port)  # fmt: skip
    logger.info("try: slora-client --url %s:%d generate 'Tell me a joke'  (Ctrl-C stops the server)",
                host, options.grpc_port)  # fmt: skip


def _shutdown(process: subprocess.Popen, timeout_s: float = 60.0) -> int:
    if process.poll() is None:
        logger.info("stopping tritonserver")
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("tritonserver did not stop within %.0f s; killing it", timeout_s)
            process.kill()
            process.wait()
    logger.info("tritonserver exited with status %s", process.returncode)
    return int(process.returncode)


if __name__ == "__main__":
    sys.exit(main())
