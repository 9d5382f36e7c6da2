"""Record what the scheduler decides, step by step, for a seeded workload: the reference that `fcfs` must keep.

`record(engine, workload)` adds each request on its arrival step, steps the engine to the end and returns one line
per step: the seqs scheduled (`request:tokens`, in plan order) and the requests preempted (`!request`). With
`ignore_eos` and fixed `max_tokens` the schedule depends only on lengths, arrivals and the pool, never on the
tokens sampled, so the lines of one workload are the same on every machine and for any model weights.

tests/engine/data/fcfs_schedules.json holds the lines recorded by the scheduler before scheduling policies existed
(`python -m tests.engine.schedule_trace --write` regenerates it from the code checked out).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GOLDEN = Path(__file__).parent / "data" / "fcfs_schedules.json"


@dataclass(frozen=True)
class Arrival:
    step: int  # added before this step
    request_id: str
    prompt: list[int]
    adapter: str | None
    max_tokens: int


@dataclass(frozen=True)
class ScheduleCase:
    """A workload and the engine options it runs under (pages: pool size in pages of 8 tokens)."""

    name: str
    seed: int
    num_requests: int
    pages: int
    options: dict[str, Any]
    waves: int = 4

    def arrivals(self, adapters: tuple[str, ...]) -> list[Arrival]:
        rng = random.Random(self.seed)
        out = []
        for i in range(self.num_requests):
            step = rng.randrange(self.waves) * 7
            prompt = [rng.randrange(3, 100) for _ in range(rng.randint(3, 40))]
            adapter = rng.choice([None, *adapters])
            out.append(Arrival(step, f"q{i}", prompt, adapter, rng.randint(2, 20)))
        return sorted(out, key=lambda a: a.step)


CASES = (
    ScheduleCase("tight-pool-chunked", seed=11, num_requests=24, pages=44,
                 options={"max_batch_tokens": 32, "max_num_seqs": 8}),
    ScheduleCase("admit-interval", seed=12, num_requests=20, pages=400, options={"admit_interval": 3}),
    ScheduleCase("overlap-tight", seed=13, num_requests=20, pages=40,
                 options={"overlap_steps": True, "max_batch_tokens": 48}),
    ScheduleCase("few-seqs", seed=14, num_requests=16, pages=300, options={"max_num_seqs": 2}),
)  # fmt: skip


def record(engine: Any, arrivals: list[Arrival]) -> list[str]:
    """Step `engine` over `arrivals` to the end; one line per step (see the module docstring)."""
    lines: list[str] = []
    schedule = engine.scheduler.schedule

    def recording() -> Any:
        plan = schedule()
        seqs = [f"{s.request.request_id}:{s.num_tokens}" for s in plan.seqs]
        lines.append(" ".join(seqs + [f"!{r.request_id}" for r in plan.preempted]))
        return plan

    engine.scheduler.schedule = recording
    pending = list(arrivals)
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            sampling = {"max_tokens": a.max_tokens, "temperature": 0.0, "ignore_eos": True}
            engine.add_request(a.prompt, a.adapter, sampling, request_id=a.request_id)
        engine.step()
        engine.pool.check_integrity()
        step += 1
        if step > 5000:
            raise AssertionError("the engine did not finish")
    engine.check_idle_integrity()
    return lines


def engine_for(case: ScheduleCase, base: Path, adapter_root: Path, **extra: Any) -> Any:
    from slora.backend.config import EngineConfig
    from slora.backend.engine.llm_engine import LLMEngine

    probe = LLMEngine(EngineConfig(model=str(base), page_size=8, pool_bytes=1 << 20, device="cpu"))
    page_bytes = probe.pool.geometry.page_bytes(probe.dtype)  # the engine's page bytes: same device, same dtype
    config = EngineConfig(model=str(base), adapter_root=str(adapter_root), page_size=8, device="cpu",
                          pool_bytes=case.pages * page_bytes, **case.options, **extra)  # fmt: skip
    return LLMEngine(config)


def main(argv: list[str] | None = None) -> None:
    import tempfile

    from tests.factories import MIXED_ADAPTERS, save_adapter, save_random_model, tiny_llama_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"write {GOLDEN}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        base = save_random_model(tiny_llama_config(), Path(tmp) / "base", seed=1)
        for i, spec in enumerate(MIXED_ADAPTERS):
            save_adapter(base, spec, Path(tmp) / "adapters", seed=100 + i)
        names = tuple(s.name for s in MIXED_ADAPTERS)
        golden = {}
        for case in CASES:
            engine = engine_for(case, base, Path(tmp) / "adapters")
            golden[case.name] = record(engine, case.arrivals(names))
            logger.info("%s: %d steps, %d preemptions, %d adapter evictions", case.name, len(golden[case.name]),
                        engine.scheduler.num_preemptions, engine.cache.evictions)  # fmt: skip
    if args.write:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=0) + "\n")


if __name__ == "__main__":
    main()
