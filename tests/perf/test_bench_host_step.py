"""perf/bench_host_step.py on the tiny model: the engine keeps decoding with the stubbed forward, and the timing
comes back for every repeat."""

from __future__ import annotations

import json
from pathlib import Path

from perf import bench_host_step
from perf.bench_decode_step import adapter_dirs
from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine


def test_host_step_times_decode_steps_with_adapters(tiny_model: Path, tiny_adapters: Path, tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    result = bench_host_step.main(["--model", str(tiny_model), "--adapter-root", str(tiny_adapters), "--adapters", "6",
                                   "--seqs", "12", "--prompt-len", "20", "--steps", "5", "--repeats", "3",
                                   "--out", str(out)])  # fmt: skip
    assert result.seqs == 12 and result.adapters == 6
    assert len(result.repeats_ms) == 3 and all(t > 0 for t in result.repeats_ms)
    slack = 0.001  # the repeats are reported rounded to 3 decimals, the median is not: one unit of slack
    assert min(result.repeats_ms) - slack <= result.median_ms <= max(result.repeats_ms) + slack
    assert json.loads(out.read_text())["median_ms"] == result.median_ms


def test_joiners_make_every_step_mixed_with_new_adapters(tiny_model: Path, tiny_adapters: Path) -> None:
    """--join: each step carries the new prompts next to the running decodes, their adapters are the ones after the
    running requests' in the list, and they finish after one token, so the batch keeps its size."""
    args = bench_host_step.parse_args(["--model", str(tiny_model), "--adapter-root", str(tiny_adapters), "--seqs", "4",
                                       "--prompt-len", "8", "--join", "2", "--join-prompt-len", "6"])  # fmt: skip
    result = bench_host_step.main(["--model", str(tiny_model), "--adapter-root", str(tiny_adapters), "--seqs", "4",
                                   "--prompt-len", "8", "--join", "2", "--join-prompt-len", "6", "--steps", "3",
                                   "--repeats", "2"])  # fmt: skip
    assert result.joins == 2 and len(result.repeats_ms) == 2
    engine = LLMEngine(EngineConfig(model=str(tiny_model), load_format="dummy", device="cpu", kernel_backend="torch",
                                    adapter_root=str(tiny_adapters), max_num_seqs=8))  # fmt: skip
    names = adapter_dirs(str(tiny_adapters), args.adapters)
    bench_host_step.fill(engine, 4, 8, names[:4])
    running = {s.request_id for s in engine.scheduler.running}
    joiners = bench_host_step.Joiners(engine, 2, 6, names, first=4)
    joiners()
    new = list(engine.scheduler.waiting)
    assert [r.num_prompt for r in new] == [6, 6]
    assert [r.adapter_name for r in new] == [names[4 % len(names)], names[5 % len(names)]]
    outputs = engine.step()
    finished = {o.request_id for o in outputs if o.finished}
    assert finished == {r.request_id for r in new}, "the new prompts ran in this step, with one token each"
    assert {s.request_id for s in engine.scheduler.running} == running
