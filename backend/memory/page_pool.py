"""The unified page pool: one memory region, one page index space, shared by KV-cache blocks and LoRA weights.

Layout (S-LoRA's Unified Paging, generalized to GQA and to MLP projections)::

    storage: [num_layers, num_pages, page_elems]            one tensor, model dtype, allocated once
                         │
      page p ────────────┼──── the same index p names one slab in every layer
                         ▼
    as a KV block (block_size tokens), in layer l:
      storage[l, p] = │ K: block_size × kv_heads × head_dim │ V: block_size × kv_heads × head_dim │
                        token slot s of page p  ->  flat slot index p * block_size + s

    as adapter rows of width w (w = in/out features of a projection), in layer l:
      storage[l, p] = │ row 0 (w) │ row 1 (w) │ ... │ row n-1 (w) │ unused │    n = page_elems // w
                        a row is one rank of lora_A (w = in_features) or of lora_Bᵀ (w = out_features);
                        its address is the flat element offset  p * page_elems + i * w  in storage[l]

    page_elems = block_size × 2 × kv_heads × head_dim  (≥ the widest row, see PoolGeometry.validate)

An adapter of rank r takes about r × Σ(in + out) / page_elems pages: pages in proportion to its rank, no padding
to a maximum rank. Both kinds come from the same free list, so neither fragments the other.

Reserved regions (the ablation of S-LoRA's Fig. 5, EngineConfig.adapter_region_fraction): the same storage and
index space, cut once at start into two regions with a free list each::

    page index:  0 ............ A-1 │ A ................... N-1
                 adapter pages only │ KV pages only

so that adapter weights and KV blocks no longer compete for pages: a KV block cannot use a free adapter page, and
evicting adapters frees nothing for KV. `num_free_for(kind)` and `num_pages_for(kind)` answer for the region a kind
allocates from; in the unified pool (the default) both are the whole pool's.

The pool is the only allocator: it hands out and takes back page indices and records who owns each page. It
never calls anyone; the scheduler decides what to evict or preempt. `check_integrity` proves that no page is lost,
none is owned twice and, with reserved regions, none is held or free outside its region.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

DEFAULT_PAGE_SIZE = 16  # tokens a page when page_size is auto and the model's widest adapter row fits


class PageKind(enum.IntEnum):
    FREE = 0
    KV = 1
    ADAPTER = 2


@dataclass(frozen=True)
class PoolGeometry:
    """Shape of one page; the same for every layer."""

    num_layers: int
    block_size: int  # tokens per KV page
    num_kv_heads: int
    head_dim: int

    @property
    def page_elems(self) -> int:
        return self.block_size * 2 * self.num_kv_heads * self.head_dim

    def rows_per_page(self, width: int) -> int:
        return self.page_elems // width

    def page_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one page index across all layers."""
        return self.num_layers * self.page_elems * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def holding(cls, num_layers: int, block_size: int | None, num_kv_heads: int, head_dim: int,
                widest_row: int) -> PoolGeometry:  # fmt: skip
        """The geometry of `block_size` tokens a page (checked to hold `widest_row`), or with None the smallest one
        from DEFAULT_PAGE_SIZE up, doubling, whose page holds it."""
        if block_size is None:
            block_size = DEFAULT_PAGE_SIZE
            while block_size * 2 * num_kv_heads * head_dim < widest_row:
                block_size *= 2
        geometry = cls(num_layers, block_size, num_kv_heads, head_dim)
        geometry.validate(widest_row)
        return geometry

    def validate(self, widest_row: int) -> None:
        if self.page_elems < widest_row:
            minimum = -(-widest_row // (2 * self.num_kv_heads * self.head_dim))
            raise ValueError(
                f"page_size={self.block_size} tokens gives pages of {self.page_elems} elements, smaller than "
                f"the widest adapter row ({widest_row}); use page_size >= {minimum}"
            )


class PoolIntegrityError(AssertionError):
    """The pool's bookkeeping is inconsistent (a bug, never a user error)."""


Owner = Hashable


@dataclass
class _Region:
    """Pages [start, stop) and their free list; the kinds allocated from it."""

    start: int
    stop: int
    kinds: frozenset[PageKind]
    # Free pages are handed out lowest index first after a reset, then most recently freed first.
    free: list[int]

    @classmethod
    def of(cls, start: int, stop: int, *kinds: PageKind) -> _Region:
        return cls(start, stop, frozenset(kinds), list(range(stop - 1, start - 1, -1)))

    @property
    def size(self) -> int:
        return self.stop - self.start

    def __contains__(self, page: int) -> bool:
        return self.start <= page < self.stop


class PagePool:
    """Fixed-size pages of one storage tensor, handed out to KV blocks and adapter weights.

    `adapter_pages`: None for the unified pool (one free list for both kinds); else pages [0, adapter_pages) are
    for adapter weights only and the rest for KV blocks only (module docstring). Not thread-safe: the engine thread
    is the only caller.
    """

    def __init__(
        self,
        geometry: PoolGeometry,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device,
        adapter_pages: int | None = None,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.geometry = geometry
        self.num_pages = num_pages
        self.adapter_pages = adapter_pages
        self._regions = _regions(num_pages, adapter_pages)
        self._region_of = {kind: r for r in self._regions for kind in r.kinds}
        self.storage = torch.zeros((geometry.num_layers, num_pages, geometry.page_elems), dtype=dtype, device=device)
        g = geometry  # the per-layer views every step asks for, made once (a view costs host time per call)
        kv_shape = (num_pages, 2, g.block_size, g.num_kv_heads, g.head_dim)
        self._kv_layers = [self.storage[i].view(kv_shape) for i in range(g.num_layers)]
        self._flat_layers = [self.storage[i].view(-1) for i in range(g.num_layers)]
        self._kind = [PageKind.FREE] * num_pages
        self._owner: list[Owner | None] = [None] * num_pages
        self._by_owner: dict[Owner, set[int]] = {}
        self._count = {kind: 0 for kind in PageKind}
        self._count[PageKind.FREE] = num_pages

    @property
    def unified(self) -> bool:
        """Whether KV blocks and adapter weights take pages from one free list (evicting one frees pages for both)."""
        return len(self._regions) == 1

    @property
    def num_free(self) -> int:
        """Free pages of the whole pool (with reserved regions, not all of them usable by one kind)."""
        return self._count[PageKind.FREE]

    def num_free_for(self, kind: PageKind) -> int:
        """Free pages an allocation of `kind` can take."""
        return len(self._region_of[kind].free)

    def num_pages_for(self, kind: PageKind) -> int:
        """Pages of the region `kind` allocates from: the most it can ever hold."""
        return self._region_of[kind].size

    @property
    def _free(self) -> list[int]:
        """The unified pool's free list itself; with reserved regions a copy of their lists, adapter region first."""
        if self.unified:
            return self._regions[0].free
        return [page for region in self._regions for page in region.free]

    def count(self, kind: PageKind) -> int:
        return self._count[kind]

    def pages_of(self, owner: Owner) -> frozenset[int]:
        return frozenset(self._by_owner.get(owner, ()))

    def alloc(self, n: int, kind: PageKind, owner: Owner) -> list[int] | None:
        """Take `n` free pages of `kind`'s region for `owner`, or None (and change nothing) when fewer are free."""
        if kind == PageKind.FREE:
            raise ValueError("cannot allocate pages of kind FREE")
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        free = self._region_of[kind].free
        if n > len(free):
            return None
        if n == 0:
            return []
        pages = [free.pop() for _ in range(n)]
        owned = self._by_owner.setdefault(owner, set())
        for page in pages:
            self._kind[page] = kind
            self._owner[page] = owner
            owned.add(page)
        self._count[kind] += n
        self._count[PageKind.FREE] -= n
        return pages

    def free(self, pages: Iterable[int], owner: Owner) -> None:
        """Give back pages that `owner` holds; freeing a page one does not own is a bug and raises."""
        owned = self._by_owner.get(owner, set())
        for page in pages:
            if page not in owned:
                raise PoolIntegrityError(f"page {page} is not owned by {owner!r}")
            owned.remove(page)
            kind = self._kind[page]
            self._count[kind] -= 1
            self._count[PageKind.FREE] += 1
            self._kind[page] = PageKind.FREE
            self._owner[page] = None
            self._region_of[kind].free.append(page)
        if not owned:
            self._by_owner.pop(owner, None)

    def free_all(self, owner: Owner) -> None:
        self.free(sorted(self._by_owner.get(owner, ())), owner)

    def kv_layer(self, layer: int) -> torch.Tensor:
        """KV view of one layer: [num_pages, 2, block_size, num_kv_heads, head_dim]."""
        return self._kv_layers[layer]

    def flat_layer(self, layer: int) -> torch.Tensor:
        """One layer as a flat vector; adapter row offsets index into it."""
        return self._flat_layers[layer]

    def check_integrity(self) -> None:
        """Raise PoolIntegrityError unless every page is either free or owned by exactly one owner, and every page
        (free or owned) lies in the region of its kind."""
        free = self._check_free_lists()
        owned_total = 0
        seen: set[int] = set()
        for owner, pages in self._by_owner.items():
            if not pages:
                raise PoolIntegrityError(f"owner {owner!r} is recorded with no pages")
            if pages & seen:
                raise PoolIntegrityError(f"pages {sorted(pages & seen)} are owned twice")
            seen |= pages
            owned_total += len(pages)
            for page in pages:
                self._check_owned(page, owner)
        if free & seen:
            raise PoolIntegrityError(f"pages {sorted(free & seen)} are both free and owned")
        if len(free) + owned_total != self.num_pages:
            raise PoolIntegrityError(
                f"{self.num_pages - len(free) - owned_total} page(s) are lost (neither free nor owned)"
            )
        by_kind = {kind: self._kind.count(kind) for kind in PageKind}
        if by_kind != self._count or by_kind[PageKind.FREE] != len(free):
            raise PoolIntegrityError(f"page counts {self._count} disagree with the page table {by_kind}")

    def _check_free_lists(self) -> set[int]:
        """Every free page, once, each on its own region's list; raises otherwise."""
        free: set[int] = set()
        for region in self._regions:
            listed = set(region.free)
            if len(listed) != len(region.free) or listed & free:
                raise PoolIntegrityError("a page is on the free list twice")
            outside = sorted(p for p in listed if p not in region)
            if outside:
                raise PoolIntegrityError(f"free pages {outside} are listed outside their region")
            free |= listed
        return free

    def _check_owned(self, page: int, owner: Owner) -> None:
        kind = self._kind[page]
        if self._owner[page] != owner or kind == PageKind.FREE:
            raise PoolIntegrityError(f"page {page} is recorded for {owner!r} but marked otherwise")
        if page not in self._region_of[kind]:
            raise PoolIntegrityError(f"page {page} holds {kind.name} outside the {kind.name} region")


def _regions(num_pages: int, adapter_pages: int | None) -> tuple[_Region, ...]:
    """One region for both kinds (unified), or the adapter region [0, adapter_pages) and the KV region after it."""
    if adapter_pages is None:
        return (_Region.of(0, num_pages, PageKind.KV, PageKind.ADAPTER),)
    if isinstance(adapter_pages, bool) or not 0 < adapter_pages < num_pages:
        raise ValueError(
            f"adapter_pages must be in [1, {num_pages - 1}] for a pool of {num_pages}, got {adapter_pages!r}"
        )
    return _Region.of(0, adapter_pages, PageKind.ADAPTER), _Region.of(adapter_pages, num_pages, PageKind.KV)
