"""Warm the engine before it serves: run a few synthetic batches, then leave it idle and empty.

On a GPU the first batch of each launch shape makes Triton compile its kernels (about 0.5-2 s each on the H200
host), so without this the first users of a fresh server wait seconds for their first token. The waves cover a
prompt split into chunks, prompts alone, prompts of several lengths together, decodes mixed with prompts, and a
full decode batch, so that each of the LoRA kernels' tile shapes (decode, mixed, prompt: lora_shrink.shrink_config)
is compiled; they use the base model and up to MAX_ADAPTERS adapters already in host memory (nothing is read from disk).

The waves fit the engine they warm: no wave holds more requests than the waiting queue takes (max_waiting), no
prompt is longer than one request of it can hold in an empty pool with the largest warm-up adapter, and an adapter
that leaves no room for a prompt of one token is left out. A small pool or queue gets a smaller warm-up, never a
start that fails.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING

from slora.backend.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from slora.backend.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

MAX_ADAPTERS = 8
WARMUP_TOKENS = 4


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up waves; returns the seconds it took. The engine is idle and holds no adapter afterwards (its
    statistics still count the waves: LLMEngine forgets them)."""
    start = time.perf_counter()
    adapters = warm_adapters(engine)
    largest = max((engine.store.describe(name).num_pages for name in adapters if name), default=0)
    longest = longest_prompt(engine, largest)
    if longest < 1:
        logger.warning("warm-up skipped: the pool has no room for a request of one token")
        return 0.0
    short, medium, chunked = prompt_lengths(engine, longest)
    greedy = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
    vocab = engine.spec.vocab_size
    full = min(engine.config.max_num_seqs, engine.config.max_waiting)
    # (requests, prompt lengths cycled): a chunked prompt alone, prompts longer than a decode tile only (the LoRA
    # kernels' prompt-shaped tiles), every length mixed, prompts with decodes, and a full batch of short prompts
    # (its decodes run at the largest batch size). Request i of a wave uses adapters[(i + 1) % len]: the first
    # request of each wave has an adapter when any is in host memory, so the first waves reach the LoRA kernels.
    waves = [(1, [chunked]), (min(8, full), [medium]), (min(8, full), [short, medium, chunked])]
    waves += [(min(64, full), [short, medium]), (full, [short])]
    for size, lengths in waves:
        prompts = [synthetic_prompt(i, lengths[i % len(lengths)], vocab) for i in range(size)]
        engine.generate(prompts, [adapters[(i + 1) % len(adapters)] for i in range(size)], greedy)
    engine.evict_adapters()
    seconds = time.perf_counter() - start
    requests = sum(size for size, _ in waves)
    logger.info("warm-up: %d waves of %d requests, adapters %s, prompts of %d/%d/%d tokens in %.1fs", len(waves),
                requests, [a for a in adapters if a], short, medium, chunked, seconds)  # fmt: skip
    return seconds


def synthetic_prompt(i: int, length: int, vocab: int) -> list[int]:
    """Token ids 1 .. vocab-1, different for each request."""
    return [1 + (i * 7919 + j * 31) % (vocab - 1) for j in range(length)]


def warm_adapters(engine: LLMEngine) -> list[str | None]:
    """The base model (None) and up to MAX_ADAPTERS adapters in host memory that fit the pool with a prompt of one
    token (their refs are read, not the adapters: the host LRU order stays as preload left it)."""
    scheduler, store = engine.scheduler, engine.store
    one_token = scheduler.pages_for(1 + WARMUP_TOKENS)
    in_host = (a.name for a in store.list() if a.in_host)
    fitting = (name for name in in_host if scheduler.never_fits(one_token, store.describe(name).num_pages) is None)
    return [None, *itertools.islice(fitting, MAX_ADAPTERS)]


def longest_prompt(engine: LLMEngine, adapter_pages: int) -> int:
    """The longest prompt that, with WARMUP_TOKENS to generate and an adapter of `adapter_pages`, an empty pool
    can hold (0 if none can), and the model's context allows."""
    scheduler = engine.scheduler
    low, high = 0, engine.max_model_len - WARMUP_TOKENS
    while low < high:  # the largest length whose request fits: fitting is monotone in the length
        mid = (low + high + 1) // 2
        if scheduler.never_fits(scheduler.pages_for(mid + WARMUP_TOKENS), adapter_pages) is None:
            low = mid
        else:
            high = mid - 1
    return low


def prompt_lengths(engine: LLMEngine, longest: int) -> tuple[int, int, int]:
    """(short, medium, chunked) prompt lengths of at most `longest` tokens; the chunked one is longer than a step's
    token budget, so it is split into chunks, where the pool has room for it."""
    short, medium, chunked = (max(1, min(n, longest)) for n in (16, 300, engine.config.max_batch_tokens + 100))
    return short, medium, chunked
