"""A peer model's requests served by another model's engine (runtime/peers.py, engine_peer.py), without Triton:
the same tokens as the engine called directly, outputs routed to whoever submitted, a vanished peer's requests
aborted (pages freed), an engine process that dies fails the peer's requests and the peer serves again after the
restart, and the peer's metrics reach the engine's side."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.errors import EngineOverloadedError
from slora.backend.memory.page_pool import PageKind
from slora.backend.runtime.engine_peer import EnginePeer
from slora.backend.runtime.engine_process import EngineProcess
from slora.backend.runtime.engine_service import LocalEngine
from slora.backend.runtime.messages import PeerWelcomeMsg, Submission
from slora.backend.runtime.output_sink import RequestCallbacks
from slora.backend.runtime.peers import (
    PeerHub,
    PeerSettings,
    RoutingSink,
    clear_load_failure,
    load_failure,
    note_load_failure,
    peer_address,
)
from tests.model_fixtures import ModelWithAdapters
from tests.runtime.callback_engine import CallbackEngine
from tests.runtime.test_engine_service import GREEDY, PROMPTS, Collector, _config

SERVING = {"tokenizer": "from the welcome"}  # stands for the engine model's ServingOptions


class Peer:
    """An EnginePeer with one callback per request, and the welcomes it got."""

    def __init__(self, address: str) -> None:
        self.sink = RequestCallbacks()
        self.welcomes: list[PeerWelcomeMsg] = []
        self.service = EnginePeer(address, "alias", "slora", self.sink, self.welcomes.append)

    def submit(self, job: Submission, callback) -> None:  # type: ignore[no-untyped-def]
        self.sink.add(job.request_id, callback)
        self.service.submit(job)


@pytest.fixture
def address(tmp_path: Path) -> str:
    return peer_address(tmp_path, "slora")


@pytest.fixture
def process(llama: ModelWithAdapters, address: str) -> Iterator[CallbackEngine]:
    engine = CallbackEngine(lambda sink: EngineProcess(_config(llama), sink, max_restarts=1,
                                                       peer=PeerSettings(address, SERVING)))  # fmt: skip
    yield engine
    engine.stop(timeout=5)


def _connected(address: str) -> Peer:
    peer = Peer(address)
    assert peer.service.wait_connected(30), "the peer did not connect"
    return peer


def test_the_address_is_private_to_the_user_and_per_server_repository_and_model(tmp_path: Path) -> None:
    address = Path(peer_address(tmp_path, "slora"))
    assert address.parent.stat().st_mode & 0o777 == 0o700 and len(str(address)) < 100  # sun_path holds 108 bytes
    assert peer_address(tmp_path / ".", "slora") == str(address) == peer_address(tmp_path, "slora", os.getppid())
    others = {peer_address(tmp_path, "other"), peer_address(tmp_path / "x", "slora"),
              peer_address(tmp_path, "slora", server_pid=os.getppid() + 1)}  # fmt: skip
    assert len(others | {str(address)}) == 4


def test_a_peer_gets_the_engine_tokens_and_the_engine_model_its_own(
    process: CallbackEngine, address: str, llama: ModelWithAdapters
) -> None:
    peer = _connected(address)
    try:
        assert peer.welcomes[0].serving == SERVING and peer.welcomes[0].info.num_pages == process.info.num_pages
        adapters = [llama.adapters[0], None, llama.adapters[3], llama.adapters[2]]
        expected = LLMEngine(_config(llama)).generate(PROMPTS, adapters, GREEDY)
        mine, theirs = Collector(), Collector()
        for i, (prompt, adapter) in enumerate(zip(PROMPTS, adapters)):  # interleaved, same ids on both sides
            peer.submit(Submission(f"r{i}~alias", prompt, adapter, GREEDY, detokenize=False), theirs.callback)
            process.submit(Submission(f"r{i}", prompt, adapter, GREEDY, detokenize=False), mine.callback)
        mine.wait(len(PROMPTS))
        theirs.wait(len(PROMPTS))
        for i, completion in enumerate(expected):
            assert mine.tokens(f"r{i}") == completion.token_ids
            assert theirs.tokens(f"r{i}~alias") == completion.token_ids
        assert set(mine.outputs) == {f"r{i}" for i in range(len(PROMPTS))}  # nothing crossed over
    finally:
        peer.service.stop()


def test_a_refusal_reaches_the_peer(process: CallbackEngine, address: str) -> None:
    peer = _connected(address)
    try:
        got = Collector()
        peer.submit(Submission("bad~alias", [1, 2], "no-such-adapter", GREEDY), got.callback)
        got.wait(1)
        assert got.last("bad~alias").finish_reason == "rejected" and "no-such-adapter" in (got.last("bad~alias").error
                                                                                            or "")  # fmt: skip
    finally:
        peer.service.stop()


def test_a_peer_that_goes_away_has_its_requests_aborted(llama: ModelWithAdapters, address: str) -> None:
    """In this process, to read the engine's page pool: the vanished peer's request frees its pages."""
    router = RoutingSink(RequestCallbacks())
    local = LocalEngine(LLMEngine(_config(llama)), router)
    hub = PeerHub(PeerSettings(address, SERVING), local, router)
    peer = _connected(address)
    try:
        got = Collector()
        peer.submit(Submission("long~alias", [4, 5, 6], None, replace(GREEDY, max_tokens=200)), got.callback)
        got.wait_started()
        peer.service.stop()
        engine = local.loop.engine
        deadline = time.monotonic() + 30
        while engine.requests or engine.pool.count(PageKind.KV):
            assert time.monotonic() < deadline, "the vanished peer's request still holds the engine"
            time.sleep(0.05)
        assert len(got.tokens("long~alias")) < 200
    finally:
        hub.close()
        local.stop()


def test_the_peer_fails_its_requests_when_the_engine_dies_and_serves_after_the_restart(
    process: CallbackEngine, address: str, llama: ModelWithAdapters
) -> None:
    peer = _connected(address)
    try:
        got = Collector()
        peer.submit(Submission("doomed~alias", [4, 5, 6], None, replace(GREEDY, max_tokens=200)), got.callback)
        got.wait_started()
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        got.wait(1)
        doomed = got.last("doomed~alias")
        assert doomed.finish_reason == "error" and "engine of model 'slora' stopped" in (doomed.error or "")
        refused = Collector()
        peer.submit(Submission("meanwhile~alias", [1, 2], None, GREEDY), refused.callback)
        refused.wait(1)
        last = refused.last("meanwhile~alias")
        assert last.finish_reason == "error" or isinstance(last.exception, EngineOverloadedError)
        deadline = time.monotonic() + 120
        while len(peer.welcomes) < 2:
            assert time.monotonic() < deadline, "the peer did not connect to the new engine process"
            time.sleep(0.1)
        expected = LLMEngine(_config(llama)).generate([PROMPTS[0]], [llama.adapters[1]], GREEDY)[0].token_ids
        after = Collector()
        peer.submit(Submission("after~alias", PROMPTS[0], llama.adapters[1], GREEDY, detokenize=False), after.callback)
        after.wait(1)
        assert after.tokens("after~alias") == expected
    finally:
        peer.service.stop()


def test_the_peers_metrics_reach_the_engine_side(process: CallbackEngine, address: str) -> None:
    heard: list[tuple[str, object]] = []
    arrived = threading.Event()
    process.on_peer_events(lambda events: (heard.extend(events), arrived.set()))
    peer = _connected(address)
    try:
        peer.service.report("ttft", 0.25)
        peer.service.report("finished", "length")
        assert arrived.wait(10), "no metrics came from the peer"
        deadline = time.monotonic() + 5
        while len(heard) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert heard == [("ttft", 0.25), ("finished", "length")]
    finally:
        peer.service.stop()


def test_a_peer_without_an_engine_is_refused_with_the_reason(address: str) -> None:
    peer = Peer(address)
    try:
        assert not peer.service.wait_connected(0.5)
        got = Collector()
        peer.submit(Submission("early~alias", [1, 2], None, GREEDY), got.callback)
        got.wait(1)
        early = got.last("early~alias")
        assert isinstance(early.exception, EngineOverloadedError) and "not serving yet" in str(early.exception)
    finally:
        peer.service.stop()


def test_a_stranger_on_the_socket_is_turned_away(llama: ModelWithAdapters, address: str) -> None:
    router = RoutingSink(RequestCallbacks())
    local = LocalEngine(LLMEngine(_config(llama)), router)
    hub = PeerHub(PeerSettings(address, SERVING), local, router)
    try:
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.connect(address)
        stranger.sendall(b"\x00\x00\x00\x05hello")  # a framed message that does not unpickle to a hello
        stranger.settimeout(15)
        assert stranger.recv(1) == b""  # closed on us
        stranger.close()
        peer = _connected(address)  # the hub still takes peers
        peer.service.stop()
    finally:
        hub.close()
        local.stop()


def test_a_peer_that_cannot_take_the_welcome_fails_at_once_with_the_reason(
    process: CallbackEngine, address: str
) -> None:
    def refuse(welcome: PeerWelcomeMsg) -> None:
        raise OSError("no tokenizer files in /models/m")

    peer = EnginePeer(address, "alias", "slora", RequestCallbacks(), refuse)
    try:
        started = time.monotonic()
        assert not peer.wait_connected(60)
        assert time.monotonic() - started < 30 and peer.failure == "OSError: no tokenizer files in /models/m"
    finally:
        peer.stop()


def test_a_peer_of_an_engine_whose_model_failed_to_load_fails_at_once_with_the_reason(address: str) -> None:
    note_load_failure(address, "RuntimeError: the engine failed to start: ValueError: page_size=1")
    peer = Peer(address)
    try:
        started = time.monotonic()
        assert not peer.service.wait_connected(60)
        assert time.monotonic() - started < 5
        assert peer.service.failure == (
            "model 'slora' failed to load: RuntimeError: the engine failed to start: ValueError: page_size=1"
        )
    finally:
        peer.service.stop()
        clear_load_failure(address)


def test_a_new_load_clears_the_failure_and_the_peer_then_waits(address: str) -> None:
    note_load_failure(address, "an earlier attempt")
    assert load_failure(address) == "an earlier attempt"
    clear_load_failure(address)
    assert load_failure(address) is None
    peer = Peer(address)
    try:
        assert not peer.service.wait_connected(0.5)
        assert peer.service.failure is None  # still waiting for the engine, not failed
    finally:
        peer.service.stop()
