"""A resident adapter keeps no host image once its copy is done: the pool holds no host memory."""

from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path

import pytest
import torch

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.memory.adapter_cache import AdapterCache
from slora.backend.memory.page_pool import PagePool, PoolGeometry


def _adapter(geometry: PoolGeometry, pages: int) -> HostAdapter:
    image = torch.randn((geometry.num_layers, pages, geometry.page_elems))
    empty = torch.zeros(0, dtype=torch.int64)
    return HostAdapter("x", Path("x"), (2,) + (0,) * 6, (0.5,) + (0.0,) * 6, image, empty, empty, generation=4)


def _until(condition, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return bool(condition())


def test_the_image_is_dropped_once_copied_and_the_pool_holds_it() -> None:
    geometry = PoolGeometry(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4)
    pool = PagePool(geometry, 16, torch.float32, torch.device("cpu"))
    cache = AdapterCache(pool)
    host = _adapter(geometry, pages=3)
    expected = host.image.clone()
    image = weakref.ref(host.image)
    resident = cache.load(host)
    assert resident is not None
    resident.wait_copied(pool.storage.device)
    del host
    assert _until(lambda: resident.host.image.is_meta), "the copy's callback drops the image"
    assert _until(lambda: image() is None), "nothing else keeps it"
    assert torch.equal(pool.storage[:, resident.pages], expected)
    kept = resident.host
    assert (kept.key, kept.ranks, kept.scales, kept.num_pages, kept.nbytes) == (
        ("x", 4), (2,) + (0,) * 6, (0.5,) + (0.0,) * 6, 3, expected.numel() * 4)  # fmt: skip
    with pytest.raises((NotImplementedError, RuntimeError, TypeError)):
        kept.image.numpy()  # a meta tensor: no data to copy by mistake
