"""Launcher, server discovery, repository rendering and the text steps, without starting a server (fast)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from slora.backend.engine.detokenizer import IncrementalDetokenizer
from slora.backend.errors import InvalidRequestError
from slora.backend.launcher.cli import (
    LaunchOptions,
    main,
    parse_options,
    repository_parameters,
    run_server,
    server_command,
)
from slora.backend.launcher.model_repository import MODELS, render_repository
from slora.backend.launcher.server_locator import (
    STUB,
    ServerNotFoundError,
    locate_server,
    python_version,
    stub_python_version,
)
from slora.backend.serving.prompt import PromptEncoder, prompt_echo


def _parse(config: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(config.read_text(), model_config_pb2.ModelConfig())


def test_rendered_repository_is_valid_and_carries_the_parameters(tmp_path: Path) -> None:
    options = parse_options(["--adapter-dir", str(tmp_path), "--max-num-seqs", "8", "--chat-template",
                             "--engine-option", "host_budget_bytes=1GiB", "--default-max-tokens", "64"])  # fmt: skip
    repository = render_repository(tmp_path / "repo", repository_parameters(options, Path("/models/m")))
    configs = {model: _parse(repository / model / "config.pbtxt") for model in MODELS}
    slora = {k: v.string_value for k, v in configs["slora"].parameters.items()}
    assert slora["model"] == "/models/m" and slora["adapter_root"] == str(tmp_path.resolve())
    assert (slora["max_num_seqs"], slora["host_budget_bytes"], slora["default_max_tokens"]) == ("8", "1GiB", "64")
    assert configs["slora"].model_transaction_policy.decoupled
    assert slora["apply_chat_template"] == "true"
    alias = configs["ensemble"]
    assert alias.backend == "python" and alias.model_transaction_policy.decoupled and not alias.ensemble_scheduling.step
    assert alias.parameters["engine_model"].string_value == "slora"  # a peer of slora's engine, not a second engine
    assert {o.name for o in alias.output} < {o.name for o in configs["slora"].output}  # slora's outputs, a subset
    assert all((repository / model / "1" / "model.py").is_file() for model in MODELS)


def test_options_are_checked_before_the_server_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ports must differ"):
        parse_options(["--http-port", "9000", "--grpc-port", "9000"])
    with pytest.raises(ValueError, match="adapter_dir: /no/such/dir does not exist"):
        parse_options(["--adapter-dir", "/no/such/dir"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_options(["--engine-option", "oops"])
    with pytest.raises(ValueError, match="unknown engine option 'bogus'"):
        repository_parameters(parse_options(["--engine-option", "bogus=1"]), tmp_path)
    with pytest.raises(ValueError, match="max_num_seqs: cannot parse 'many'"):
        repository_parameters(parse_options(["--max-num-seqs", "many"]), tmp_path)


def test_stub_versions_of_the_wheel() -> None:
    import pytriton

    stubs = Path(pytriton.__file__).parent / "tritonserver" / "python_backend_stubs"
    for folder in stubs.iterdir():
        assert stub_python_version(folder / STUB) == folder.name


def test_locate_server_lays_out_the_stub_for_this_python(tmp_path: Path) -> None:
    install = locate_server(tmp_path)
    assert os.access(install.binary, os.X_OK)
    assert stub_python_version(install.backend_dir / "python" / STUB) == python_version()
    assert (install.backend_dir / "python" / "libtriton_python.so").exists()
    assert install.env["SLORA_SITE_DIRS"] and install.env["PYTHONPATH"].startswith(install.env["SLORA_SITE_DIRS"])
    command = server_command(install, tmp_path, parse_options(["--device", "cpu"]))
    assert f"--backend-directory={install.backend_dir}" in command and "--allow-gpu-metrics=false" in command


def test_server_root_without_a_server_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITONSERVER_ROOT", str(tmp_path))
    with pytest.raises(ServerNotFoundError, match="bin/tritonserver is missing"):
        locate_server(tmp_path / "work")


def test_dry_run(tmp_path: Path, default_model_dir: Path) -> None:
    assert main(["--dry-run", "--device", "cpu", "--workspace", str(tmp_path)]) == 0
    assert (tmp_path / "model_repository" / "ensemble" / "config.pbtxt").is_file()
    assert main(["--max-waiting", "0", "--dry-run", "--workspace", str(tmp_path)]) == 1  # refused, named


# A stand-in for tritonserver: it starts a "stub" that ignores SIGTERM, writes the stub's pid to argv[1], then exits
# on SIGTERM, or ignores it too when argv[2] is "stubborn".
FAKE_SERVER = """
import signal, subprocess, sys, time
stub_code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
stub = subprocess.Popen([sys.executable, "-c", stub_code])
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "stubborn" else lambda *_: sys.exit(0))
open(sys.argv[1], "w").write(str(stub.pid))
time.sleep(300)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _serve_fake(tmp_path: Path, behaviour: str, interrupts: int) -> tuple[int, float, int]:
    """run_server on the fake server, Ctrl-C'd `interrupts` times once its stub runs: (exit status, seconds, stub)."""
    pid_file = tmp_path / "stub.pid"

    def interrupt() -> None:
        while not (pid_file.exists() and pid_file.read_text()):
            time.sleep(0.05)
        for _ in range(interrupts):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)

    with socket.socket() as s:  # a port where no server answers: the fake is never ready
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threading.Thread(target=interrupt, daemon=True).start()
    started = time.monotonic()
    command = [sys.executable, "-c", FAKE_SERVER, str(pid_file), behaviour]
    options = LaunchOptions(http_port=port, grpc_port=port + 1, metrics_port=port + 2)
    code = run_server(command, dict(os.environ), options)
    return code, time.monotonic() - started, int(pid_file.read_text())


def test_no_process_of_the_server_outlives_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("slora.backend.launcher.cli.LEFTOVER_GRACE_S", 0.5)
    code, _, stub = _serve_fake(tmp_path, "clean", interrupts=1)
    assert code == 0 and not _running(stub)


def test_a_second_ctrl_c_kills_the_server_at_once(tmp_path: Path) -> None:
    code, seconds, stub = _serve_fake(tmp_path, "stubborn", interrupts=2)
    assert code == 130 and seconds < 10 and not _running(stub)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the launcher's handlers are gone


def test_streamed_deltas_are_the_detokenizer_text_exactly(tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer.encode("Say it:", add_special_tokens=True)
    target = " 👍 Привет, мир! 你好. The end. More."
    for stop in ((), ("end.",)):
        detok = IncrementalDetokenizer(tokenizer, prompt, stop)
        ids = list(prompt)
        deltas = []
        for token in tokenizer.encode(target, add_special_tokens=False):
            ids.append(token)
            detok.update(ids)
            deltas.append(detok.take(final=False))
            if detok.stopped:
                break
        deltas.append(detok.take(final=True))
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == detok.text == (" 👍 Привет, мир! 你好. The " if stop else target)


def test_prompt_echo_follows_the_vllm_backend() -> None:
    assert prompt_echo("p", stream=False, exclude_input_in_output=None) == "p"
    assert prompt_echo("p", stream=True, exclude_input_in_output=None) == ""
    assert prompt_echo("p", stream=False, exclude_input_in_output=True) == ""
    with pytest.raises(InvalidRequestError, match="not supported with stream=true"):
        prompt_echo("p", stream=True, exclude_input_in_output=False)


def test_encode_prompt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    encoder = PromptEncoder(tokenizer)
    assert encoder.encode("Hi", False) == tokenizer.encode("Hi", add_special_tokens=True)
    chat = encoder.encode("Hi", True)
    assert tokenizer.decode(chat).rstrip().endswith("assistant")
    with pytest.raises(InvalidRequestError, match="empty"):
        encoder.encode("", False)
