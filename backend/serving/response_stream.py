"""One request's way back from the engine: which outputs to send, when, and the latency marks on the way.

Streaming requests get one response per engine output; the others one response with everything, at the end.
`text_output` is the engine's own text (its incremental detokenizer's deltas, decoded once in the engine): a
streamed response carries the delta of its tokens, the last one of an unstreamed request the whole text, after
the echo (the prompt, when the request asked for it). Only the outputs the client asked for are built (Triton
passes all of them when it names none): each output is one Triton tensor per response, and a token client that
names output_ids alone skips the string tensors. Plain numpy: the glue wraps the arrays into Triton tensors.
Owned by one thread (the responder's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slora.backend.engine.outputs import RequestOutput

OUTPUT_NAMES = ("output_ids", "text_output", "finish_reason", "num_input_tokens", "num_output_tokens")


@dataclass(frozen=True)
class Reply:
    arrays: dict[str, np.ndarray]  # output name → array, for each requested name of OUTPUT_NAMES
    final: bool


@dataclass
class ResponseStream:
    stream: bool
    arrival: float  # time.monotonic() when the request arrived
    echo: str = ""  # text before the first text_output (the prompt, when the request asked for it)
    outputs: frozenset[str] = frozenset(OUTPUT_NAMES)  # the outputs to send
    tenant: str | None = None  # whose latencies these are (the metrics' per-tenant first tokens)
    first_token_at: float | None = None
    last_token_at: float | None = None
    latencies: list[tuple[str, float]] = field(default_factory=list)  # ("ttft" | "itl", seconds), drained by the caller
    _pending: list[RequestOutput] = field(default_factory=list)
    _echo_sent: bool = False

    def add(self, output: RequestOutput, at: float) -> Reply | None:
        """Fold in one engine output produced at `at`; returns what to send now, if anything."""
        return self.add_many([(output, at)])

    def add_many(self, outputs: list[tuple[RequestOutput, float]]) -> Reply | None:
        """Fold in consecutive engine outputs (with the time each was produced); a streaming request gets one
        response for all of them (the responder merges outputs that queued up while it was busy)."""
        for output, at in outputs:
            if output.new_token_ids:
                self._mark(at)
        self._pending.extend(output for output, _ in outputs)
        if not self._pending or not (self.stream or self._pending[-1].finished):
            return None
        reply = Reply(self._arrays(self._pending), self._pending[-1].finished)
        self._pending = []
        return reply

    def _mark(self, at: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = at
            self.latencies.append(("ttft", at - self.arrival))
        elif self.last_token_at is not None:
            self.latencies.append(("itl", at - self.last_token_at))
        self.last_token_at = at

    def _arrays(self, outputs: list[RequestOutput]) -> dict[str, np.ndarray]:
        ids = [t for o in outputs for t in o.new_token_ids]
        last = outputs[-1]
        arrays: dict[str, np.ndarray] = {}
        wanted = self.outputs
        if "output_ids" in wanted:
            arrays["output_ids"] = np.asarray(ids, dtype=np.int32)
        if "finish_reason" in wanted:
            arrays["finish_reason"] = np.asarray([(last.finish_reason or "").encode()], dtype=np.object_)
        if "text_output" in wanted:
            echo = "" if self._echo_sent else self.echo
            self._echo_sent = True
            text = echo + "".join(o.text for o in outputs)
            arrays["text_output"] = np.asarray([text.encode()], dtype=np.object_)
        if "num_input_tokens" in wanted:
            arrays["num_input_tokens"] = np.asarray([last.num_prompt_tokens], dtype=np.uint32)
        if "num_output_tokens" in wanted:
            arrays["num_output_tokens"] = np.asarray([len(ids)], dtype=np.uint32)
        return arrays
