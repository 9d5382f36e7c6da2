"""Which LoRA launches a captured graph holds: its family, the modules its steps' adapters may target and a bound on
their ranks. Decode graphs (cuda_graphs.py) and graphs of steps with prompts (mixed_graphs.py) pick theirs alike.

A graph launches the LoRA kernels of its family's modules only (an attention-only adapter set, S-LoRA's S1, skips the
MLP calls) with grids sized for its rank bound, not for max_lora_rank (256 by default: rank-8 adapters would run in
grids of idle rank programs). The generic family (all seven modules at max_lora_rank) covers every step; the
families of the adapters in host memory are added as they are known, and a step replays the cheapest family
captured that covers it, or, when only the generic one would, a family of its own.
"""

from __future__ import annotations

from slora.backend.model.spec import LORA_MODULES
from slora.kernels.metadata import LoraMeta

Modules = frozenset[int]  # LoRA modules (indices into LORA_MODULES) the adapters of a graph's steps may target
Family = tuple[Modules, int]  # (modules, rank bound)
ALL_MODULES: Modules = frozenset(range(len(LORA_MODULES)))
NO_MODULES: Modules = frozenset()
MIN_RANK_BOUND = 16  # the LoRA kernels' rank chunk: smaller bounds would not shrink any grid


def rank_bound(max_rank: int, limit: int) -> int:
    """The power of two (at least MIN_RANK_BOUND, at most `limit`) that bounds a step's largest rank."""
    return min(limit, max(MIN_RANK_BOUND, 1 << (max(max_rank, 1) - 1).bit_length()))


class GraphFamilies:
    """The families captured for every bucket, the generic one first."""

    def __init__(self, max_lora_rank: int) -> None:
        self.max_lora_rank = max_lora_rank
        self.generic: Family = (ALL_MODULES, max_lora_rank)
        self.captured: list[Family] = [self.generic]

    def add(self, modules: Modules, max_rank: int) -> Family | None:
        """Register the family of adapters of these modules and ranks up to max_rank; it, if it is new."""
        family = (frozenset(modules), rank_bound(max_rank, self.max_lora_rank))
        if not family[0] or family in self.captured:
            return None
        self.captured.append(family)
        return family

    def of_step(self, lora: LoraMeta) -> Family:
        """The cheapest captured family that covers the step's adapters; the step's own when only the generic
        one would."""
        modules, bound = lora.targeted_modules(), rank_bound(lora.max_rank, self.max_lora_rank)
        covering = [f for f in self.captured if f[0] >= modules and f[1] >= bound]
        best = min(covering, key=lambda f: (len(f[0]) * f[1], f[1]))
        return (modules, bound) if best == self.generic else best
