"""The HF PEFT baseline of S-LoRA's evaluation: transformers + peft `generate`, one adapter at a time.

    python -m perf.baseline_peft --model /tmp/slora-perf/model --adapter-root /tmp/slora-perf/adapters/S1 \\
        --max-requests 200 --time-limit 90 --out results.json traces/s1-n5.jsonl

As S-LoRA's PEFT baseline does: the requests that have arrived are grouped by adapter; for each group the adapter
is made active (`load_adapter` the first time, then `set_adapter`) and the group is run in batches of at most
`--max-batch-size` (S-LoRA used 50 for its Llama-7B table, 6 for its figures) with `generate`: greedy, prompts
left-padded to the longest, every row running to the batch's longest output (EOS ignored); then the queue is
looked at again. Base-model requests run with the adapters disabled. A streamer timestamps every decoding step, so
a request's first token and its finish (at its own output length) are known within its batch.

The model has random weights of the config's shapes (as the engine's `load_format=dummy`), initialized directly
on the device. PEFT is slow, so the run is bounded: the first `--max-requests` requests of the trace, and no new
batch after `--time-limit` seconds; the results record both, and requests never served count as unfinished.
A progress bar of served requests shows on a terminal (`--no-progress`), a log line after each round everywhere.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from perf.metrics import RequestRecord, per_request, summarize
from perf.results import append_runs, headline, make_run, trace_info
from perf.workload import Trace, TraceRequest, load_trace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeftOptions:
    max_batch_size: int = 50
    max_requests: int = 200
    time_limit_s: float = 90.0
    max_loaded: int = 0  # adapters kept loaded in the PEFT model, least recently used dropped; 0: no limit
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")
        if self.max_loaded < 0:
            raise ValueError(f"max_loaded must be >= 0, got {self.max_loaded}")


class StepClock:
    """A `generate` streamer: the time of every decoding step (the first `put` is the prompt, not a step)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """A causal LM of the config's shapes with random weights, built on `device` (fast even for 7B on a GPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class AdapterSwitcher:
    """Loads adapters into one PeftModel on first use and activates them; optionally keeps at most `max_loaded`."""

    def __init__(self, base: Any, root: Path | None, max_loaded: int) -> None:
        self.base = base
        self.root = root
        self.max_loaded = max_loaded
        self.model: Any = None  # the PeftModel, once the first adapter is loaded
        self.loaded: OrderedDict[str, None] = OrderedDict()
        self.loads = 0
        self.switches = 0
        self._active: str | None = None

    def activate(self, name: str | None) -> Any:
        """The model to call `generate` on, with adapter `name` active (None: the base model alone)."""
        if name is None:
            return self.base if self.model is None else self.model
        if self.root is None:
            raise ValueError(f"request for adapter {name!r} but no --adapter-root was given")
        if name not in self.loaded:
            self._load(name)
        self.loaded.move_to_end(name)
        if self._active != name:
            self.model.set_adapter(name)
            self._active = name
            self.switches += 1
        return self.model

    def _load(self, name: str) -> None:
        from peft import PeftModel

        assert self.root is not None  # checked in activate
        if not (self.root / name / "adapter_config.json").is_file():
            raise FileNotFoundError(f"adapter {name!r}: {self.root / name}/adapter_config.json is missing")
        path = str(self.root / name)
        if self.model is None:
            self.model = PeftModel.from_pretrained(self.base, path, adapter_name=name).eval()
        else:
            self.model.load_adapter(path, adapter_name=name)
        self.loaded[name] = None
        self.loads += 1
        if self.max_loaded and len(self.loaded) > self.max_loaded:
            victim = next(iter(self.loaded))
            if victim == self._active:
                self._active = None
            self.model.delete_adapter(victim)
            del self.loaded[victim]


def run_batch(
    switcher: AdapterSwitcher,
    batch: list[TraceRequest],
    records: dict[int, RequestRecord],
    start: float,
    options: PeftOptions,
) -> None:
    adapter = batch[0].adapter
    model = switcher.activate(adapter)
    device = next(model.parameters()).device
    width = max(r.input_len for r in batch)
    ids = torch.full((len(batch), width), options.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):  # left padding: every prompt ends at the last column
        ids[row, width - r.input_len :] = torch.tensor(r.prompt_ids)
        mask[row, width - r.input_len :] = 1
    steps = max(r.output_len for r in batch)
    clock = StepClock(start)
    kwargs = {"max_new_tokens": steps, "min_new_tokens": steps, "do_sample": False, "streamer": clock,
              "pad_token_id": options.pad_token_id}  # fmt: skip
    with torch.inference_mode():
        if adapter is None and switcher.model is not None:
            with switcher.model.disable_adapter():
                model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        else:
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
    for r in batch:
        record = records[r.index]
        for t in clock.times[: r.output_len]:
            record.add_chunk(t, 1)
        record.finish(clock.times[r.output_len - 1], "length")


def replay(
    switcher: AdapterSwitcher, trace: Trace, options: PeftOptions, progress: bool | None = None
) -> tuple[list[RequestRecord], float]:
    """S-LoRA's PEFT loop; returns the records and the duration (to the last finish, or the time limit).
    `progress`: a bar of served requests (None: on a terminal only)."""
    off = None if progress is None else not progress
    with tqdm(total=len(trace), desc="peft", unit="req", disable=off, leave=False) as bar:
        return _replay(switcher, trace, options, bar)


def _replay(
    switcher: AdapterSwitcher, trace: Trace, options: PeftOptions, bar: tqdm
) -> tuple[list[RequestRecord], float]:
    remaining = list(trace.requests)
    records = {r.index: RequestRecord(r.index, r.adapter, r.input_len, r.output_len, r.arrival) for r in remaining}
    start = time.perf_counter()
    while remaining:
        now = time.perf_counter() - start
        if now > options.time_limit_s:
            logger.warning("time limit: %d requests never served", len(remaining))
            return list(records.values()), now
        queue = [r for r in remaining if r.arrival <= now]
        if not queue:
            time.sleep(min(remaining[0].arrival - now, 0.05))
            continue
        served: set[int] = set()
        for batch in _batches(queue, options.max_batch_size):
            if time.perf_counter() - start > options.time_limit_s:
                break
            run_batch(switcher, batch, records, start, options)
            served |= {r.index for r in batch}
            bar.update(len(batch))
        remaining = [r for r in remaining if r.index not in served]
        done = len(records) - len(remaining)
        logger.info("t=%6.1fs served %d/%d (%d adapter loads, %d switches)", time.perf_counter() - start, done,
                    len(records), switcher.loads, switcher.switches)  # fmt: skip
    last = max((r.finish_time or 0.0 for r in records.values()), default=0.0)
    return list(records.values()), last


def _batches(queue: list[TraceRequest], size: int) -> list[list[TraceRequest]]:
    groups: dict[str | None, list[TraceRequest]] = {}
    for r in queue:  # groups in order of their first request's arrival
        groups.setdefault(r.adapter, []).append(r)
    return [group[i : i + size] for group in groups.values() for i in range(0, len(group), size)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--model", type=Path, required=True, help="model directory (config.json)")
    parser.add_argument("--adapter-root", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"),
                        help="default: float16 on CUDA, float32 on CPU")  # fmt: skip
    parser.add_argument("--max-batch-size", type=int, default=50)
    parser.add_argument("--max-requests", type=int, default=200)
    parser.add_argument("--time-limit", type=float, default=90.0)
    parser.add_argument("--max-loaded", type=int, default=0)
    parser.add_argument("--name-prefix", default="peft")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (default: on a terminal)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    options = PeftOptions(args.max_batch_size, args.max_requests, args.time_limit, args.max_loaded)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "float32"))
    started = time.perf_counter()
    base = load_model(args.model, device, dtype)
    logger.info("PEFT baseline model ready in %.1fs on %s (%s)", time.perf_counter() - started, device, dtype)
    for path in args.traces:
        trace = load_trace(path).head(options.max_requests)
        switcher = AdapterSwitcher(base, args.adapter_root, options.max_loaded)
        try:
            records, duration = replay(switcher, trace, options, progress=False if args.no_progress else None)
        except (OSError, ValueError) as exc:  # e.g. an adapter of the trace missing: next trace
            logger.error("PEFT run on %s failed: %s", path, exc)
            base = switcher.model.unload() if switcher.model is not None else base
            continue
        metrics = summarize(records, duration)
        metrics.update(adapter_loads=switcher.loads, adapter_switches=switcher.switches)
        info = {**asdict(options), "device": str(device), "dtype": str(dtype), "bounded_prefix": len(trace)}
        run = make_run(f"{args.name_prefix}-{path.stem}", "peft", trace_info(trace, path), info, metrics,
                       group=args.name_prefix, per_request=per_request(records))  # fmt: skip
        append_runs(args.out, [run])
        logger.info("%s", headline(run))
        if switcher.model is not None:  # unload the adapters: the next trace starts from the bare model
            base = switcher.model.unload()


if __name__ == "__main__":
    main()
