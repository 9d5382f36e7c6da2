"""Running out of GPU memory while the engine starts, explained: what the page pool took and which options leave
the rest more room.

The pool is sized first, as a share of the memory free after the weights (startup.py), because the CUDA graphs
captured next record its addresses. The graphs, the host adapters' graph families and the warm-up's steps must
then fit in what the pool left. A torch OutOfMemoryError there names an allocation of a few hundred MiB, not the
share that left too little, so the error says which options change it.
"""

from __future__ import annotations

import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.startup import CUDA_DEFAULT_POOL_FRACTION
from slora.backend.errors import SloraError
from slora.backend.memory.page_pool import PagePool

GiB = 1 << 30
SMALLER_BY = 0.1  # the share the error suggests: this much below the one that failed


class StartupMemoryError(SloraError, RuntimeError):
    """The device ran out of memory while the engine started; the message names the options that leave more."""


def explained(exc: torch.OutOfMemoryError, config: EngineConfig, pool: PagePool | None) -> StartupMemoryError:
    """The error to raise for `exc`, from an engine of `config` whose page pool (None: not made yet) is `pool`."""
    taken = ""
    if pool is not None:
        taken = f" after the page pool took {pool.storage.numel() * pool.storage.element_size() / GiB:.1f} GiB"
    if config.pool_bytes is not None:
        sizing = f"pool_bytes={config.pool_bytes}"
        remedy = "a smaller pool_bytes"
    else:
        fraction = config.pool_fraction or CUDA_DEFAULT_POOL_FRACTION
        given = "" if config.pool_fraction is not None else " (auto)"
        sizing = f"pool_fraction={fraction:g}{given} of the memory free after the weights"
        remedy = f"a smaller pool_fraction (e.g. {max(round(fraction - SMALLER_BY, 2), 0.05):g}) or pool_bytes"
    return StartupMemoryError(
        f"the device ran out of memory while the engine started{taken} ({sizing}): give {remedy}, or fewer CUDA "
        f"graph buckets (max_num_seqs, mixed_cuda_graph_tokens); torch said: {exc}"
    )
