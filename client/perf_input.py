"""perf_analyzer input data with a different adapter per request (the `adapter_id` input tensor).

    python -m slora.client.perf_input --target slora --http-url localhost:8000 --out pa.json
    python -m slora.client.perf_input --target ensemble --adapters demo-qv-r4,demo-o-r2 --out pa.json

Each row is one request of perf_analyzer's --input-data file: a random prompt (token ids for `slora`, words for
the ensemble), the adapter of that row (cycling through the server's adapters and the base model, shuffled with
a fixed seed), max_tokens, stream=true and greedy sampling that ignores EOS (every request generates max_tokens).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slora.client.admin import adapter_command

logger = logging.getLogger(__name__)

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars watch silent rivers run toward "
         "distant mountains under an amber sky").split()  # fmt: skip


def input_rows(
    target: str, adapters: Sequence[str], rows: int, prompt_tokens: int, max_tokens: int, vocab: int, seed: int
) -> list[dict[str, Any]]:
    """The `data` rows of a perf_analyzer input file; adapter "" is the base model."""
    rng = random.Random(seed)
    choices = ["", *adapters]
    order = [choices[i % len(choices)] for i in range(rows)]
    rng.shuffle(order)
    sampling = json.dumps({"temperature": 0, "ignore_eos": True})
    data = []
    for adapter in order:
        row: dict[str, Any] = {
            "adapter_id": [adapter],
            "max_tokens": [max_tokens],
            "stream": [True],
            "sampling_parameters": [sampling],
        }
        if target == "slora":
            ids = [rng.randrange(100, vocab) for _ in range(prompt_tokens)]
            row["input_ids"] = {"content": ids, "shape": [len(ids)]}
        else:
            row["text_input"] = [" ".join(rng.choice(WORDS) for _ in range(prompt_tokens))]
            row["exclude_input_in_output"] = [True]
        data.append(row)
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slora.client.perf_input", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("slora", "ensemble"), default="slora")
    parser.add_argument("--adapters", help="comma-separated names (default: ask the server at --http-url)")
    parser.add_argument("--http-url", default="localhost:8000")
    parser.add_argument("--rows", type=int, default=256, help="requests in the file (perf_analyzer cycles them)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (tokens, or words)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.adapters is not None:
        adapters = [a for a in args.adapters.split(",") if a]
    else:
        adapters = [row["name"] for row in adapter_command(args.http_url, "list")]
    rows = input_rows(args.target, adapters, args.rows, args.prompt_tokens, args.max_tokens, args.vocab, args.seed)
    Path(args.out).write_text(json.dumps({"data": rows}) + "\n")
    logger.info("%s: %d requests over %d adapters and the base model", args.out, len(rows), len(adapters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
