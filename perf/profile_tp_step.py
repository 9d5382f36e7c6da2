"""Tensor parallelism's communication per decode step (issue 30): the base model's collectives and the LoRA's.

    python -m perf.make_model --shape llama2-13b --out /tmp/slora-perf/llama2-13b
    python -m perf.make_adapters --model /tmp/slora-perf/llama2-13b --setting S2 -n 64 --out /tmp/slora-perf/a13
    python -m perf.profile_tp_step --model /tmp/slora-perf/llama2-13b --adapter-root /tmp/slora-perf/a13 \\
        --tensor-parallel-size 2 --batch 64 --steps 32 --out tp-profile.json

One engine (random weights unless --load-format safetensors), two phases in the same run: `base` (every request on
the base model) and `lora` (request i on the i-th adapter of the root, cycling: S-LoRA's S2 ranks 64/32/16/8 from
perf/make_adapters.py). Each phase admits --batch requests of --prompt-len tokens, steps until all of them
decode, then times --steps decode steps: the wall time per step and, on rank 0, the time in each kind of
collective (backend/parallel/collectives.py's CollectiveTimer: CUDA events around each on the compute stream, so a
collective's time includes waiting for the slowest rank; on the CPU the clock). Timing the collectives adds two
events per collective, so the step times of this script are a little above an untimed run's. With
--tensor-parallel-size 1 it gives the one-device step time to scale against (no collectives).

Issue 30's target: the LoRA's collectives (lora all-gather + lora all-reduce) below 5% of a decode step. The
throughput scaling (S-LoRA's Fig. 8) comes from perf/bench_engine.py with --engine-opt tensor_parallel_size=N.

    python -m perf.profile_tp_step --smoke     a tiny random model on the CPU (gloo, 2 ranks): checks the script
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.parallel.collectives import CollectiveTimer
from slora.backend.parallel.decoder import ShardedDecoder
from slora.backend.parallel.lora import LORA_ALL_GATHER, LORA_ALL_REDUCE

logger = logging.getLogger("perf.profile_tp_step")

WARM_DECODES = 4  # decode steps after the last prompt, before the clock


def run_phase(engine: LLMEngine, adapters: list[str | None], args: argparse.Namespace) -> dict[str, Any]:
    """Time --steps decode steps of --batch requests on `adapters` (cycled); the engine is idle afterwards."""
    sampling = SamplingParams(max_tokens=args.steps + WARM_DECODES + 64, temperature=0.0, ignore_eos=True)
    vocab = engine.spec.vocab_size
    ids = [engine.add_request([1 + (i * 31 + j) % (vocab - 1) for j in range(args.prompt_len)],
                              adapters[i % len(adapters)], sampling) for i in range(args.batch)]  # fmt: skip
    while any(r.num_computed < r.num_prompt for r in engine.requests.values()) or engine.scheduler.waiting:
        engine.step()
    for _ in range(WARM_DECODES):
        engine.step()
    timer = _start_timer(engine)
    _synchronize(engine)
    began = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    _synchronize(engine)
    seconds = time.perf_counter() - began
    collectives = timer.read() if timer is not None else {}
    calls = dict(timer.calls) if timer is not None else {}
    for request_id in ids:
        engine.abort(request_id)
    engine.step()  # the last in-flight step, if any
    engine.check_idle_integrity()
    return {
        "step_ms": 1e3 * seconds / args.steps,
        "collectives_ms": {k: 1e3 * v / args.steps for k, v in sorted(collectives.items())},
        "calls_per_step": {k: v / args.steps for k, v in sorted(calls.items())},
    }


def _start_timer(engine: LLMEngine) -> CollectiveTimer | None:
    if not isinstance(engine.model, ShardedDecoder):
        return None
    timer = CollectiveTimer(engine.device)
    engine.model.comm.timer = timer
    return timer


def _synchronize(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def summarize(phases: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The figures issue 30 asks for: the LoRA's collectives as a share of its decode step, and lora / base."""
    lora, base = phases["lora"], phases["base"]
    lora_comm = sum(lora["collectives_ms"].get(k, 0.0) for k in (LORA_ALL_GATHER, LORA_ALL_REDUCE))
    return {
        "lora_collectives_ms": lora_comm,
        "lora_collectives_share_of_step": lora_comm / lora["step_ms"],
        "lora_step_over_base_step": lora["step_ms"] / base["step_ms"],
    }


def print_table(phases: dict[str, dict[str, Any]], summary: dict[str, float]) -> None:
    labels = sorted({k for p in phases.values() for k in p["collectives_ms"]})
    logger.info("%-6s %10s  %s", "phase", "step ms", "  ".join(f"{k} ms (%)" for k in labels))
    for name, phase in phases.items():
        spent = [phase["collectives_ms"].get(k, 0.0) for k in labels]
        cells = [f"{ms:.3f} ({100 * ms / phase['step_ms']:.1f})" for ms in spent]
        logger.info("%-6s %10.3f  %s", name, phase["step_ms"], "  ".join(cells))
    logger.info("LoRA collectives: %.3f ms per step, %.2f%% of the LoRA decode step (target < 5%%); "
                "LoRA step / base step = %.3f", summary["lora_collectives_ms"],
                100 * summary["lora_collectives_share_of_step"], summary["lora_step_over_base_step"])  # fmt: skip


def engine_config(args: argparse.Namespace) -> EngineConfig:
    options = dict(item.split("=", 1) for item in args.engine_opt)
    return EngineConfig.from_dict({
        "model": str(args.model), "adapter_root": str(args.adapter_root), "device": args.device, "dtype": args.dtype,
        "load_format": args.load_format, "kernel_backend": args.kernel_backend,
        "tensor_parallel_size": str(args.tensor_parallel_size), "max_num_seqs": str(max(args.batch, 1)),
        "preload_adapters": "true", **options,
    })  # fmt: skip


def smoke_args(args: argparse.Namespace, workdir: Path) -> argparse.Namespace:
    """A tiny random Llama with four adapters, 2 ranks on the CPU."""
    from perf.make_adapters import main as make_adapters
    from perf.make_model import main as make_model

    make_model(["--shape", "tiny", "--out", str(workdir / "model"), "--no-tokenizer"])
    make_adapters(["--model", str(workdir / "model"), "--setting", "S2", "-n", "4", "--out", str(workdir / "a")])
    return argparse.Namespace(**{**vars(args), "model": workdir / "model", "adapter_root": workdir / "a",
                                 "device": "cpu", "dtype": "float32", "kernel_backend": "torch", "batch": 4,
                                 "steps": 4, "prompt_len": 8, "tensor_parallel_size": 2})  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            args = smoke_args(args, Path(tmp))
        engine = LLMEngine(engine_config(args))
        try:
            names: list[str | None] = sorted(a.name for a in engine.list_adapters())
            if not names:
                raise SystemExit(f"no adapters under --adapter-root {args.adapter_root}")
            phases = {"base": run_phase(engine, [None], args), "lora": run_phase(engine, list(names), args)}
        finally:
            if engine.parallel is not None:
                engine.parallel.close()
    summary = summarize(phases)
    print_table(phases, summary)
    result = {"tensor_parallel_size": args.tensor_parallel_size, "batch": args.batch, "steps": args.steps,
              "prompt_len": args.prompt_len, "model": str(args.model), "phases": phases, **summary}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--adapter-root", type=Path, help="adapters the lora phase cycles through")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="requests decoding together")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per phase")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--load-format", default="dummy", choices=("dummy", "safetensors"))
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--engine-opt", action="append", default=[], help="any EngineConfig field, KEY=VALUE")
    parser.add_argument("--out", type=Path, help="write the result as JSON")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, 2 ranks (checks the script)")
    return parser


if __name__ == "__main__":
    main()
