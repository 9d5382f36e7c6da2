"""The engine behind a server: `LocalEngine` (a thread) and `EngineProcess` (a process of its own) must give the
same greedy tokens as the engine called directly, hand every refusal to the request's callback with its error
kind and message, answer adapter commands, abort, and fail requests in flight (not hang) if the process dies."""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.outputs import RequestOutput
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.errors import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    EngineOverloadedError,
    InvalidRequestError,
)
from slora.backend.model.spec import ModelSpec
from slora.backend.runtime.adapter_admin import RuntimeRegistry
from slora.backend.runtime.engine_process import EngineProcess
from slora.backend.runtime.engine_service import EngineService, LocalEngine
from slora.backend.runtime.messages import AdapterCommand, Submission
from tests.model_fixtures import ModelWithAdapters
from tests.runtime.callback_engine import CallbackEngine

GREEDY = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 14, 2, 7], [3] * 30, [11, 12], [8, 1, 4]]


def _config(model: ModelWithAdapters) -> EngineConfig:
    return EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), device="cpu",
                        dtype="float32", page_size=8, pool_bytes=4 << 20, max_num_seqs=8, max_batch_tokens=64,
                        max_model_len=256)  # fmt: skip


class Collector:
    """Callbacks that gather each request's outputs; `wait` returns them once its final output came."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[RequestOutput]] = {}
        self._finished: queue.Queue[str] = queue.Queue()
        self._started = threading.Event()

    def callback(self, output: RequestOutput) -> None:
        self.outputs.setdefault(output.request_id, []).append(output)
        self._started.set()
        if output.finished:
            self._finished.put(output.request_id)

    def wait_started(self, timeout: float = 120.0) -> None:
        assert self._started.wait(timeout), "no output came"

    def wait(self, count: int, timeout: float = 120.0) -> None:
        for _ in range(count):
            self._finished.get(timeout=timeout)

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs[request_id] for t in o.new_token_ids]

    def last(self, request_id: str) -> RequestOutput:
        return self.outputs[request_id][-1]


@pytest.fixture(scope="module", params=["local", "process"])
def service(request: pytest.FixtureRequest, llama: ModelWithAdapters) -> Iterator[EngineService]:
    config = _config(llama)
    started: EngineService = (
        CallbackEngine(lambda sink: LocalEngine(LLMEngine(config), sink))
        if request.param == "local"
        else CallbackEngine(lambda sink: EngineProcess(config, sink))
    )
    yield started
    started.stop()


def test_greedy_tokens_equal_the_engine_called_directly(service: EngineService, llama: ModelWithAdapters) -> None:
    adapters = [llama.adapters[0], None, llama.adapters[4], llama.adapters[2]]
    expected = LLMEngine(_config(llama)).generate(PROMPTS, adapters, GREEDY)
    got = Collector()
    for i, (prompt, adapter) in enumerate(zip(PROMPTS, adapters)):
        service.submit(Submission(f"g{i}", prompt, adapter, GREEDY, detokenize=False), got.callback)
    got.wait(len(PROMPTS))
    for i, completion in enumerate(expected):
        assert got.tokens(f"g{i}") == completion.token_ids
        assert got.last(f"g{i}").finish_reason == "length"
    stats = service.stats()
    assert stats.finished_requests >= len(PROMPTS)
    assert stats.adapter_disk_reads >= 3 and stats.adapter_host_evictions == 0  # three adapters, a roomy budget


def test_the_engine_info_holds_the_resolved_batch_limit(service: EngineService, llama: ModelWithAdapters) -> None:
    """Servers read the engine's batch limit from EngineInfo (the LoRA gauge's max_lora), "auto" resolved."""
    assert service.info.max_num_seqs == 8
    auto = CallbackEngine(lambda sink: LocalEngine(LLMEngine(replace(_config(llama), max_num_seqs=None)), sink))
    try:
        assert auto.info.max_num_seqs == 256  # the CPU rule (engine/defaults.py)
    finally:
        auto.stop()


def test_refusals_reach_the_callback_with_their_kind(service: EngineService) -> None:
    got = Collector()
    service.submit(Submission("bad-adapter", [1, 2], "no-such-adapter", GREEDY), got.callback)
    service.submit(Submission("too-long", [1] * 300, None, GREEDY), got.callback)
    service.submit(Submission("fine", [1, 2, 3], None, GREEDY), got.callback)
    got.wait(3)
    unknown, long = got.last("bad-adapter"), got.last("too-long")
    assert unknown.finish_reason == "rejected" and isinstance(unknown.exception, AdapterNotFoundError)
    assert "'no-such-adapter'" in (unknown.error or "")
    assert long.finish_reason == "rejected" and "exceeds the model context of 256 tokens" in (long.error or "")
    assert isinstance(long.exception, InvalidRequestError)
    assert got.last("fine").finish_reason == "length" and len(got.tokens("fine")) == GREEDY.max_tokens


def test_adapter_commands_are_answered(service: EngineService, llama: ModelWithAdapters) -> None:
    rows = service.command(AdapterCommand("list"))["adapters"]
    assert {row["name"] for row in rows} == set(llama.adapters)
    with pytest.raises(AdapterNotFoundError, match="'ghost'"):
        service.command(AdapterCommand("unload", "ghost"))


def test_abort_ends_a_running_request(service: EngineService) -> None:
    got = Collector()
    service.submit(Submission("long", [4, 5, 6], None, replace(GREEDY, max_tokens=200)), got.callback)
    got.wait_started()  # running: its first token came back
    service.abort("long")
    got.wait(1)
    assert got.last("long").finish_reason == "abort" and len(got.tokens("long")) < 200


def test_a_dead_engine_process_fails_requests_instead_of_hanging(llama: ModelWithAdapters) -> None:
    engine = CallbackEngine(lambda sink: EngineProcess(_config(llama), sink, max_restarts=0))
    got = Collector()
    try:
        _kill_while_running(engine, got, "doomed")
        doomed = got.last("doomed")
        assert doomed.finish_reason == "error" and "exited unexpectedly" in (doomed.error or "")
        engine.submit(Submission("after", [1, 2], None, GREEDY), got.callback)
        got.wait(1)
        assert isinstance(got.last("after").exception, EngineOverloadedError)
        with pytest.raises(EngineOverloadedError, match="exited unexpectedly"):
            engine.command(AdapterCommand("list"))
    finally:
        engine.stop(timeout=5)


def test_a_dead_engine_process_is_started_again(llama: ModelWithAdapters) -> None:
    engine = CallbackEngine(lambda sink: EngineProcess(_config(llama), sink, max_restarts=1))
    got = Collector()
    try:
        _finish_one(engine, "before")
        finished_before = _stats_reach(engine, 1)
        first_pid = engine.pid
        _kill_while_running(engine, got, "doomed")
        assert "restarting it" in (got.last("doomed").error or "")
        deadline = time.monotonic() + 120
        while engine.pid == first_pid or engine.stats().engine_restarts == 0:
            assert time.monotonic() < deadline, "no new engine process"
            time.sleep(0.1)
        expected = LLMEngine(_config(llama)).generate([PROMPTS[0]], [llama.adapters[1]], GREEDY)[0].token_ids
        served = _finish_one(engine, "after", llama.adapters[1])
        assert served.tokens("after") == expected
        assert _stats_reach(engine, finished_before + 1) >= finished_before + 1  # counters continue
        assert engine.stats().engine_restarts == 1
    finally:
        engine.stop(timeout=5)


def _stats_reach(engine: EngineProcess, finished: int) -> int:
    """Finished requests in the statistics, once they count at least `finished` (they follow the outputs)."""
    deadline = time.monotonic() + 30
    while engine.stats().finished_requests < finished:
        assert time.monotonic() < deadline, f"statistics stuck at {engine.stats().finished_requests} finished"
        time.sleep(0.05)
    return engine.stats().finished_requests


def _finish_one(engine: EngineProcess, request_id: str, adapter: str | None = None) -> Collector:
    got = Collector()
    engine.submit(Submission(request_id, PROMPTS[0], adapter, GREEDY, detokenize=False), got.callback)
    got.wait(1)
    assert got.last(request_id).finish_reason == "length"
    return got


def _kill_while_running(engine: EngineProcess, got: Collector, request_id: str) -> None:
    engine.submit(Submission(request_id, [4, 5, 6], None, replace(GREEDY, max_tokens=200)), got.callback)
    got.wait_started()
    assert engine.pid is not None
    os.kill(engine.pid, signal.SIGKILL)
    got.wait(1)


def test_an_engine_that_cannot_start_says_why(tmp_path: os.PathLike) -> None:
    config = EngineConfig(model=str(tmp_path), device="cpu")
    with pytest.raises(RuntimeError, match="the engine failed to start: .*config.json"):
        CallbackEngine(lambda sink: EngineProcess(config, sink))


# ---- issue 25: out-of-vocabulary ids, bad root entries, replace, registrations across restarts ----------------


def test_token_ids_outside_the_vocabulary_are_refused_naming_input_ids(
    service: EngineService, llama: ModelWithAdapters
) -> None:
    vocab = ModelSpec.from_dir(llama.base).vocab_size
    got = Collector()
    service.submit(Submission("too-big", [1, vocab], None, GREEDY), got.callback)
    service.submit(Submission("negative", [-1, 2], None, GREEDY), got.callback)
    got.wait(2)
    for request_id in ("too-big", "negative"):
        refused = got.last(request_id)
        assert refused.finish_reason == "rejected" and isinstance(refused.exception, InvalidRequestError)
        assert "input_ids" in (refused.error or "") and f"[0, {vocab})" in (refused.error or "")


def test_load_of_an_existing_name_needs_replace(service: EngineService, llama: ModelWithAdapters) -> None:
    """A registered name or a folder of the root is not re-pointed to other weights unless the command says so."""
    root = llama.adapter_root
    first = service.command(AdapterCommand("load", "extra", str(root / "r5-ko")))["adapters"]
    assert first[0]["ranks"] == {"k_proj": 5, "o_proj": 5}
    try:
        with pytest.raises(AdapterExistsError, match="'extra' already exists"):
            service.command(AdapterCommand("load", "extra", str(root / "r1-qv")))
        with pytest.raises(AdapterExistsError, match="'r1-qv' already exists"):
            service.command(AdapterCommand("load", "r1-qv", str(root / "r8-mlp")))
        again = service.command(AdapterCommand("load", "extra", str(root / "r1-qv"), replace=True))["adapters"]
        assert again[0]["ranks"] == {"q_proj": 1, "v_proj": 1} and again[0]["path"] == str(root / "r1-qv")
        rows = {row["name"]: row for row in service.command(AdapterCommand("list"))["adapters"]}
        assert rows["r1-qv"]["path"] == str(root / "r1-qv")  # the refused load changed nothing
    finally:
        service.command(AdapterCommand("unload", "extra"))
    assert {row["name"] for row in service.command(AdapterCommand("list"))["adapters"]} == set(llama.adapters)


@pytest.mark.parametrize("name", ["r1-qv\n", "../r1-qv", "a..b"])
def test_admin_commands_refuse_names_clients_cannot_send(service: EngineService, name: str) -> None:
    for op in ("load", "unload"):
        with pytest.raises(AdapterError, match="invalid"):
            service.command(AdapterCommand(op, name))


def _root_with_a_symlink_out(llama: ModelWithAdapters, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(llama.adapter_root, root, symlinks=True)
    shutil.copytree(llama.adapter_root / "r3-all", tmp_path / "outside")
    (root / "link-out").symlink_to(tmp_path / "outside")
    return root


def test_a_symlink_out_of_the_root_breaks_neither_start_up_nor_list_nor_unload(
    llama: ModelWithAdapters, tmp_path: Path
) -> None:
    """Before, the engine failed to start ("resolves outside the adapter root"), and `list` and the unload of an
    unknown name answered that error for everyone."""
    config = replace(_config(llama), adapter_root=str(_root_with_a_symlink_out(llama, tmp_path)), preload_adapters=True)
    service = CallbackEngine(lambda sink: LocalEngine(LLMEngine(config), sink))
    try:
        listed = service.command(AdapterCommand("list"))
        assert {row["name"] for row in listed["adapters"]} == set(llama.adapters)
        assert [row["name"] for row in listed["skipped"]] == ["link-out"]
        assert "outside the adapter root" in listed["skipped"][0]["error"]
        with pytest.raises(AdapterNotFoundError, match="'ghost' is not registered"):
            service.command(AdapterCommand("unload", "ghost"))
        with pytest.raises(AdapterError, match="'link-out'.*outside the adapter root"):
            service.command(AdapterCommand("load", "link-out"))
    finally:
        service.stop()


def test_every_admin_change_is_logged_with_old_and_new_path(
    llama: ModelWithAdapters, caplog: pytest.LogCaptureFixture
) -> None:
    service = CallbackEngine(lambda sink: LocalEngine(LLMEngine(_config(llama)), sink))
    root = llama.adapter_root
    try:
        with caplog.at_level(logging.INFO, logger="slora.backend.runtime.adapter_admin"):
            service.command(AdapterCommand("load", "tenant", str(root / "r5-ko")))
            with pytest.raises(AdapterExistsError):
                service.command(AdapterCommand("load", "tenant", str(root / "r1-qv")))
            service.command(AdapterCommand("load", "tenant", str(root / "r1-qv"), replace=True))
            service.command(AdapterCommand("unload", "tenant"))
    finally:
        service.stop()
    logged = [r.getMessage() for r in caplog.records if r.name == "slora.backend.runtime.adapter_admin"]
    assert logged == [
        f"adapter admin: load 'tenant': (new) → {root / 'r5-ko'}",
        f"adapter admin: load 'tenant' refused: adapter 'tenant' already exists ({root / 'r5-ko'}); registering it "
        f"at {root / 'r1-qv'} would re-point it: load it with replace=true to do that",
        f"adapter admin: load 'tenant': {root / 'r5-ko'} → {root / 'r1-qv'}",
        f"adapter admin: unload 'tenant': {root / 'r1-qv'} → (gone)",
    ]


def test_runtime_registrations_survive_an_engine_restart(llama: ModelWithAdapters, tmp_path: Path) -> None:
    """Adapters registered, re-pointed or unregistered at runtime answer (or not) the same after the engine process
    is killed and started again; before, the new process knew only the adapter root and the multi_lora.json."""
    root = llama.adapter_root
    registry = tmp_path / "multi_lora.json"
    registry.write_text(json.dumps({"boot": str(root / "r12-qkv")}))
    engine = CallbackEngine(
        lambda sink: EngineProcess(replace(_config(llama), adapter_registry=str(registry)), sink, max_restarts=1)
    )
    got = Collector()
    try:
        engine.command(AdapterCommand("load", "tenant-a", str(root / "r5-ko")))
        engine.command(AdapterCommand("load", "r1-qv", str(root / "r8-mlp"), replace=True))  # a root folder
        engine.command(AdapterCommand("load", "gone", str(root / "r3-all")))
        engine.command(AdapterCommand("unload", "gone"))
        engine.command(AdapterCommand("unload", "boot"))  # registered again at start-up by the multi_lora.json
        names = ("tenant-a", "r1-qv")
        before = {name: _finish_one(engine, f"before-{name}", name).tokens(f"before-{name}") for name in names}
        assert before["r1-qv"] == _finish_one(engine, "r8", "r8-mlp").tokens("r8")  # the weights it points at
        first_pid = engine.pid
        _kill_while_running(engine, got, "doomed")
        _wait_restarted(engine, first_pid)
        for name in names:
            assert _finish_one(engine, f"after-{name}", name).tokens(f"after-{name}") == before[name]
        for name in ("gone", "boot"):
            engine.submit(Submission(f"after-{name}", PROMPTS[0], name, GREEDY), got.callback)
            got.wait(1)
            assert isinstance(got.last(f"after-{name}").exception, AdapterNotFoundError)
        rows = {row["name"]: row["path"] for row in engine.command(AdapterCommand("list"))["adapters"]}
        assert rows["tenant-a"] == str(root / "r5-ko") and rows["r1-qv"] == str(root / "r8-mlp")
        assert "gone" not in rows and "boot" not in rows
    finally:
        engine.stop(timeout=5)


def _wait_restarted(engine: EngineProcess, first_pid: int | None) -> None:
    deadline = time.monotonic() + 120
    while engine.pid == first_pid or engine.stats().engine_restarts == 0:
        assert time.monotonic() < deadline, "no new engine process"
        time.sleep(0.1)
    while True:  # serving again once the registrations are given back
        try:
            engine.command(AdapterCommand("list"))
            return
        except EngineOverloadedError:
            assert time.monotonic() < deadline, "the new engine process never served"
            time.sleep(0.1)


def test_runtime_registrations_are_written_back_to_the_multi_lora_json(
    llama: ModelWithAdapters, tmp_path: Path
) -> None:
    """With write_back_registry, a server started again from its multi_lora.json serves what was registered at
    runtime, with the same weights, and not what was unregistered."""
    root = llama.adapter_root
    registry = tmp_path / "multi_lora.json"
    shutil.copytree(root / "r1-qv", tmp_path / "relative" / "kept")
    registry.write_text(json.dumps({"boot": str(root / "r12-qkv"), "kept": "relative/kept"}))
    config = replace(_config(llama), adapter_registry=str(registry))
    engine = CallbackEngine(lambda sink: EngineProcess(config, sink, write_back_registry=True))
    try:
        engine.command(AdapterCommand("load", "tenant-a", str(root / "r5-ko")))
        engine.command(AdapterCommand("load", "tenant-a", str(root / "r3-all"), replace=True))
        engine.command(AdapterCommand("unload", "boot"))
        with pytest.raises(AdapterExistsError):
            engine.command(AdapterCommand("load", "r1-qv", str(root / "r8-mlp")))  # refused: not written
        served = _finish_one(engine, "served", "tenant-a").tokens("served")
    finally:
        engine.stop(timeout=5)
    assert json.loads(registry.read_text()) == {"kept": "relative/kept", "tenant-a": str(root / "r3-all")}
    assert LLMEngine(config).generate([PROMPTS[0]], ["tenant-a"], GREEDY)[0].token_ids == served


def test_write_back_needs_a_registry_file(llama: ModelWithAdapters) -> None:
    with pytest.raises(ValueError, match="adapter_registry"):
        CallbackEngine(lambda sink: EngineProcess(_config(llama), sink, write_back_registry=True))


def test_a_registry_file_that_cannot_be_read_is_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    file = tmp_path / "multi_lora.json"
    file.write_text("{not json")
    registry = RuntimeRegistry(file)
    with caplog.at_level(logging.ERROR, logger="slora.backend.runtime.adapter_admin"):
        registry.record(AdapterCommand("load", "x", str(tmp_path / "x")))
    assert file.read_text() == "{not json" and "cannot be read" in caplog.text
    assert registry.replay() == [AdapterCommand("load", "x", str(tmp_path / "x"), replace=True, read=False)]
    registry.record(AdapterCommand("list"))
    registry.record(AdapterCommand("load", "y"))  # into host memory only: no registration changed
    assert [c.name for c in registry.replay()] == ["x"]


# ---- issue 25: a hung engine process is killed by the watchdog; registrations kept in a journal ----------------


def test_a_hung_engine_process_is_killed_by_the_watchdog(llama: ModelWithAdapters) -> None:
    """SIGSTOP (a hang the process cannot report) past watchdog_s: the in-flight request fails naming the
    watchdog, health says so, and with no restart left the engine is failed, not serving."""
    engine = CallbackEngine(lambda sink: EngineProcess(_config(llama), sink, max_restarts=0, watchdog_s=2.0))
    got = Collector()
    try:
        assert engine.health().serving
        engine.submit(Submission("hung", [4, 5, 6], None, replace(GREEDY, max_tokens=200)), got.callback)
        got.wait_started()
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGSTOP)
        got.wait(1, timeout=30)
        hung = got.last("hung")
        assert hung.finish_reason == "error" and "watchdog_timeout_s=2" in (hung.error or ""), hung
        deadline = time.monotonic() + 10
        while engine.health().state != "failed":
            assert time.monotonic() < deadline, engine.health()
            time.sleep(0.05)
        assert "did not respond" in engine.health().reason
    finally:
        engine.stop(timeout=5)


def test_a_busy_engine_is_not_taken_for_a_hung_one(llama: ModelWithAdapters) -> None:
    """Requests that keep the engine busy for longer than watchdog_s finish: its loop goes round every step."""
    engine = CallbackEngine(lambda sink: EngineProcess(_config(llama), sink, max_restarts=0, watchdog_s=1.0))
    got = Collector()
    try:
        for i in range(3):
            engine.submit(Submission(f"busy-{i}", PROMPTS[0], None, replace(GREEDY, max_tokens=100)), got.callback)
        got.wait(3, timeout=120)
        assert all(got.last(f"busy-{i}").finish_reason == "length" for i in range(3))
        assert engine.health().serving
    finally:
        engine.stop(timeout=5)


def test_registrations_kept_in_a_journal_come_back_in_a_new_engine_process(
    llama: ModelWithAdapters, tmp_path: Path
) -> None:
    """What a model loaded again by slora-serve does: a new EngineProcess with the same journal serves the
    adapters registered at runtime by the one before it."""
    root, journal = llama.adapter_root, tmp_path / "registrations.json"
    first = CallbackEngine(lambda sink: EngineProcess(_config(llama), sink, max_restarts=0, registry_journal=journal))
    try:
        first.command(AdapterCommand("load", "tenant-a", str(root / "r5-ko")))
        before = _finish_one(first, "before", "tenant-a").tokens("before")
    finally:
        first.stop(timeout=5)
    assert json.loads(journal.read_text()) == [{"op": "load", "name": "tenant-a", "path": str(root / "r5-ko")}]
    second = CallbackEngine(lambda sink: EngineProcess(_config(llama), sink, max_restarts=0, registry_journal=journal))
    try:
        assert _finish_one(second, "after", "tenant-a").tokens("after") == before
    finally:
        second.stop(timeout=5)
