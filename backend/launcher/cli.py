"""`slora-serve`: start Triton with the slora model repository, wait until it is ready, stop it on Ctrl-C.

    slora-serve --model default --adapter-dir adapters/ --device cpu
    slora-serve --model /models/Llama-3.1-8B --adapter-dir /adapters --device cuda --max-num-seqs 128

Steps: find the server and the Python stub for this interpreter (server_locator.py), resolve the model (the
default one is converted once), check the engine options, render the model repository with them
(model_repository.py), run tritonserver with its output shown here, poll readiness, stop it on Ctrl-C / SIGTERM.

Stopping: the slora model and its peers (the ensemble alias) first end every request in flight (drain.py; Triton
alone would wait out its exit timeout for a request still generating and hang), then tritonserver gets SIGTERM; a
second Ctrl-C kills it at once. No process of the server (Python stubs, engine processes) outlives slora-serve.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slora.backend.config import EngineConfig
from slora.backend.launcher.model_repository import render_repository
from slora.backend.launcher.openai_frontend import OpenAIFrontend, OpenAILaunch, check_openai_port
from slora.backend.launcher.processes import (
    answers_ok,
    child_setup,
    kill_group,
    reap_group,
    remove_shm_regions,
    stub_shm_regions,
)
from slora.backend.launcher.server_locator import TritonInstall, locate_server
from slora.backend.launcher.supervisor import MODEL, Supervisor, SupervisorSettings
from slora.backend.model.default_model import resolve_model_path
from slora.backend.runtime.peers import clear_load_failure, load_failure, peer_address
from slora.backend.serving import drain
from slora.backend.serving.admin_guard import read_token
from slora.backend.stub_compat import numpy_problem, stub_numpy_version

logger = logging.getLogger("slora.serve")

# Flags that map one-to-one onto EngineConfig fields (flag dest == field name).
ENGINE_FLAGS = ("device", "dtype", "max_model_len", "max_num_seqs", "max_batch_tokens", "max_waiting",
                "page_size", "pool_bytes", "pool_fraction", "kernel_backend", "max_lora_rank", "seed",
                "tensor_parallel_size")  # fmt: skip
DRAIN_TIMEOUT_S = 10.0  # how long the slora model may take to end its requests before tritonserver is stopped anyway
STOP_TIMEOUT_S = 60.0  # how long tritonserver may take to exit after SIGTERM before it is killed
DRAINED_STOP_S = 8.0  # how long tritonserver may take to exit once every request has ended (open client streams)
LEFTOVER_GRACE_S = 5.0  # how long its stubs and engine processes may take to follow it before they are killed


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
    lora_registry_write_back: bool = False  # runtime adapter loads/unloads written to the --lora-registry file
    admin_token_file: str | None = None  # admin commands need its token (serving/admin_guard.py)
    watchdog_timeout_s: float = 60.0  # an engine that stops going round its loop this long is killed (0: never)
    max_engine_restarts: int = 3  # the slora model is loaded again at most this often (launcher/supervisor.py)
    engine_process: bool = True
    workspace: str | None = None
    log_verbose: int = 0
    ready_timeout_s: float = 900.0
    server_args: tuple[str, ...] = ()
    dry_run: bool = False
    openai_port: int | None = None  # the OpenAI API (serving/openai_api/), off unless given
    openai_args: tuple[str, ...] = ()  # more options of the OpenAI server

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
        if self.watchdog_timeout_s < 0 or self.max_engine_restarts < 0:
            raise ValueError("--watchdog-timeout and --max-engine-restarts must be >= 0")
        if self.openai_port is not None:
            check_openai_port(self.openai_port, ports)
        if self.admin_token_file:
            read_token(Path(self.admin_token_file))  # refuses a missing or empty file before the server starts
        if self.lora_registry_write_back and not (self.lora_registry and self.engine_process):
            raise ValueError("lora_registry_write_back needs --lora-registry and the engine in its own process")


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
                        help="apply the model's chat template to text_input by default")  # fmt: skip
    parser.add_argument("--default-max-tokens", type=int, help="max_tokens of requests that give none")
    parser.add_argument("--lora-info-metric", action="store_true",
                        help="export vllm:lora_requests_info for the Gateway API Inference Extension")  # fmt: skip
    parser.add_argument("--cancel-check-s", type=float,
                        help="seconds between cancellation checks of each in-flight request (0.2)")  # fmt: skip
    parser.add_argument("--no-adapter-admin", action="store_true", help="refuse adapter load/unload/list requests")
    parser.add_argument("--watchdog-timeout", type=float, default=60.0, metavar="S",
                        help="kill an engine whose loop stops for S seconds (0: never; default 60)")  # fmt: skip
    parser.add_argument("--max-engine-restarts", type=int, default=3, metavar="N",
                        help="load slora again at most N times after its engine fails (default 3)")  # fmt: skip
    parser.add_argument("--admin-token-file", metavar="PATH",
                        help="admin commands must carry this file's token (admin_token)")  # fmt: skip
    parser.add_argument("--lora-registry-write-back", action="store_true",
                        help="write adapters loaded/unloaded at runtime back to the --lora-registry file")  # fmt: skip
    parser.add_argument("--engine-in-stub", action="store_true",
                        help="run the engine on a thread of the Python stub, not in a process of its own")  # fmt: skip
    parser.add_argument("--workspace", help="folder for the rendered repository (default: a temporary folder)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the models")
    parser.add_argument("--server-arg", action="append", default=[], help="extra tritonserver argument (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="render the repository, show the command, stop")
    parser.add_argument("--openai-port", type=int, help="also serve the OpenAI API on this port (docs/openai.md)")
    parser.add_argument("--openai-arg", action="append", default=[],
                        help="an OpenAI server option, e.g. --openai-arg=--lora-separator=: (repeatable)")  # fmt: skip
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
        lora_registry_write_back=args.lora_registry_write_back,
        admin_token_file=args.admin_token_file,
        watchdog_timeout_s=args.watchdog_timeout,
        max_engine_restarts=args.max_engine_restarts,
        engine_process=not args.engine_in_stub,
        workspace=args.workspace,
        log_verbose=args.log_verbose,
        ready_timeout_s=args.ready_timeout,
        server_args=tuple(args.server_arg),
        openai_port=args.openai_port,
        openai_args=tuple(args.openai_arg),
        dry_run=args.dry_run,
    )


def repository_parameters(
    options: LaunchOptions, model_path: Path, drain_file: Path | None = None
) -> dict[str, dict[str, str]]:
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
    if drain_file is not None:
        slora["drain_file"] = str(drain_file)
    if options.admin_token_file:
        slora["admin_token_file"] = str(Path(options.admin_token_file).resolve())
    if options.lora_registry_write_back:  # only when asked: a serving layer without it refuses the key
        slora["lora_registry_write_back"] = "true"
    slora["apply_chat_template"] = str(options.chat_template).lower()
    return {"slora": slora}


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
        # Explicit model control: the supervisor loads slora again when its engine fails (launcher/supervisor.py)
        "--model-control-mode=explicit",
        "--load-model=slora",
        "--load-model=ensemble",
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
    drain_file = workspace / "drain"
    drain.clear(drain_file)
    parameters = repository_parameters(options, model_path, drain_file)
    health_file = workspace / "health.json"
    health_file.unlink(missing_ok=True)
    parameters["slora"].update(health_file=str(health_file), registry_journal=str(workspace / "registrations.json"),
                               in_stub_restarts="0", watchdog_timeout_s=str(options.watchdog_timeout_s))  # fmt: skip
    repository = render_repository(workspace / "model_repository", parameters)
    stale_s = max(90.0, 1.5 * options.watchdog_timeout_s)
    supervision = SupervisorSettings(f"127.0.0.1:{options.http_port}", repository, parameters["slora"], health_file,
                                     options.max_engine_restarts, stale_s)  # fmt: skip
    command = server_command(install, repository, options)
    if options.dry_run:
        logger.info("repository: %s", repository)
        for key, value in install.env.items():
            logger.info("env %s=%s", key, value)
        logger.info("command: %s", " ".join(command))
        return 0
    return run_server(command, env, options, drain_file, supervision)


@dataclass
class StopRequests:
    """Ctrl-C / SIGTERM: the first asks for a clean stop, the second for an immediate one."""

    stop: threading.Event = field(default_factory=threading.Event)
    force: threading.Event = field(default_factory=threading.Event)

    def on_signal(self, signum: int, frame: Any) -> None:
        (self.force if self.stop.is_set() else self.stop).set()


def run_server(
    command: list[str],
    env: dict[str, str],
    options: LaunchOptions,
    drain_file: Path | None = None,
    supervision: SupervisorSettings | None = None,
) -> int:
    """Run tritonserver until it exits or we are asked to stop; returns its exit status (0 after a clean stop, 130
    after a second Ctrl-C). `drain_file`: the slora model's, to have it end its requests before SIGTERM;
    `supervision`: where the supervisor finds the model's health, to load it again when its engine fails."""
    requests = StopRequests()
    previous = {signum: signal.signal(signum, requests.on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _run(command, env, options, drain_file, requests, supervision)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if requests.force.is_set():
        return 130
    return 0 if requests.stop.is_set() and code in (0, -signal.SIGTERM) else code


def _run(
    command: list[str],
    env: dict[str, str],
    options: LaunchOptions,
    drain_file: Path | None,
    requests: StopRequests,
    supervision: SupervisorSettings | None = None,
) -> int:
    logger.info("starting: %s", " ".join(command))
    process = subprocess.Popen(command, env=env, preexec_fn=child_setup)
    ready = False
    frontend: OpenAIFrontend | None = None
    supervisor: Supervisor | None = None
    # slora's engine socket, beside which the model says why it failed to load (runtime/peers.py:note_load_failure)
    engine_address = peer_address(supervision.repository, MODEL, process.pid) if supervision is not None else None
    try:
        ready = _wait_ready(process, options, requests.stop, engine_address)
        if ready and supervision is not None:
            supervisor = Supervisor.start(supervision)
        if ready and not requests.stop.is_set():
            frontend = _start_openai(options, requests.stop)
            _announce(options)
            while process.poll() is None and not requests.stop.wait(0.5) and (frontend is None or frontend.alive()):
                pass
            if frontend is not None and not frontend.alive() and not requests.stop.is_set():
                raise RuntimeError(f"the OpenAI API exited with status {frontend.process.returncode}")
    finally:
        if supervisor is not None:
            supervisor.stop()  # before the drain: a model being stopped is not one to load again
        if frontend is not None:
            frontend.stop()  # first: its open streams end, aborting their requests, before Triton drains
        code = _shutdown(process, requests.force, drain_file if ready else None)
        if engine_address is not None:
            clear_load_failure(engine_address)  # its server is gone: nobody will read it
    return code


def _start_openai(options: LaunchOptions, stop: threading.Event) -> OpenAIFrontend | None:
    """The OpenAI API's process, ready (launcher/openai_frontend.py), or None without --openai-port."""
    if options.openai_port is None:
        return None
    launch = OpenAILaunch(options.openai_port, options.host, options.grpc_port, options.model, options.tokenizer,
                          options.admin_token_file, options.openai_args)  # fmt: skip
    return OpenAIFrontend.start(launch, stop)


def _wait_ready(
    process: subprocess.Popen, options: LaunchOptions, stop: threading.Event, engine_address: str | None
) -> bool:
    """Whether the models are ready: True once they are, or if they were ready by the time we were asked to stop
    (clients may have sent requests before we saw it). A failed load of the slora model whose engine listens at
    `engine_address` ends the wait at once, with its reason."""
    url = f"http://127.0.0.1:{options.http_port}/v2/health/ready"
    started = time.monotonic()
    reported = started
    while not stop.is_set():
        failure = load_failure(engine_address) if engine_address is not None else None
        if failure is not None:  # Triton stays up until every model has loaded or failed: the alias would wait
            raise RuntimeError(f"model {MODEL!r} failed to load: {failure}")
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with status {process.returncode} before it was ready")
        if answers_ok(url):
            logger.info("ready after %.1f s", time.monotonic() - started)
            return True
        now = time.monotonic()
        if now - started > options.ready_timeout_s:
            raise RuntimeError(f"the models were not ready after {options.ready_timeout_s:.0f} s")
        if now - reported >= 10.0:
            logger.info("waiting for the models to load (%.0f s)", now - started)
            reported = now
        stop.wait(0.5)
    return process.poll() is None and answers_ok(url)


def _announce(options: LaunchOptions) -> None:
    host = "localhost" if options.host in ("0.0.0.0", "::") else options.host
    logger.info("serving: HTTP http://%s:%d  gRPC %s:%d  metrics http://%s:%d/metrics", host, options.http_port,
                host, options.grpc_port, host, options.metrics_port)  # fmt: skip
    logger.info("try: slora-client --url %s:%d generate 'Tell me a joke'  (Ctrl-C stops the server)",
                host, options.grpc_port)  # fmt: skip


def _shutdown(process: subprocess.Popen, force: threading.Event, drain_file: Path | None) -> int:
    """Stop tritonserver: the slora model ends its requests, then SIGTERM; kill it if it hangs or on a second
    Ctrl-C. Then make sure that none of its processes (Python stubs, engine processes) outlives it, nor their
    shared-memory regions. Returns its exit status, 0 when it was stopped after every request had ended."""
    regions = stub_shm_regions(process.pid)
    drained = process.poll() is None and drain_file is not None and _drain(process, drain_file, force)
    stopped_after_drain = process.poll() is None and _terminate(process, force, drained)
    reap_group(process.pid, force, LEFTOVER_GRACE_S)
    remove_shm_regions(regions)
    logger.info("tritonserver exited with status %s", process.returncode)
    return 0 if stopped_after_drain else int(process.returncode)


def _drain(process: subprocess.Popen, drain_file: Path, force: threading.Event) -> bool:
    """Ask the slora model and its peers to end every request in flight and wait until they have (drain.py); False
    if they did not say so in time."""
    logger.info("stopping: ending the requests in flight (Ctrl-C again to stop at once)")
    drain_file.touch()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while not drain.all_done(drain_file):
        if process.poll() is not None or force.is_set():
            return False
        if time.monotonic() > deadline:
            logger.warning("the requests in flight did not end within %.0f s; stopping anyway", DRAIN_TIMEOUT_S)
            return False
        force.wait(0.05)
    return True


def _terminate(process: subprocess.Popen, force: threading.Event, drained: bool) -> bool:
    """SIGTERM, and wait. Triton 2.51 then waits for every gRPC stream a client holds open, even an idle one, which
    keeps its last model loaded: once every request has ended (`drained`), it gets DRAINED_STOP_S to exit and is then
    stopped, which loses nothing (True). Killed on a second Ctrl-C or after STOP_TIMEOUT_S otherwise (False)."""
    logger.info("stopping tritonserver")
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + (DRAINED_STOP_S if drained else STOP_TIMEOUT_S)
    while process.poll() is None and not force.is_set() and time.monotonic() < deadline:
        force.wait(0.1)
    if process.poll() is not None:
        return False
    if drained and not force.is_set():
        logger.info("every request has ended, but tritonserver still waits for clients' open gRPC streams; "
                    "stopping it")  # fmt: skip
    else:
        reason = "interrupted again" if force.is_set() else f"tritonserver did not stop within {STOP_TIMEOUT_S:.0f} s"
        logger.warning("%s: killing it", reason)
    kill_group(process.pid)
    process.wait()
    return drained and not force.is_set()


if __name__ == "__main__":
    sys.exit(main())
