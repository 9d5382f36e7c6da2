"""The adapter image cache: converted once per file version, then memory-mapped; hard links share an entry; a
broken entry or a refusing disk falls back to converting."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from slora.backend.adapters import image_cache
from slora.backend.adapters.host_adapter import HostAdapter, load_peft_adapter
from slora.backend.adapters.image_cache import ImageCache
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import ModelSpec
from tests.model_fixtures import ModelWithAdapters


class Converter:
    """load_peft_adapter, counting its calls."""

    def __init__(self, spec: ModelSpec, geometry: PoolGeometry, dtype: torch.dtype) -> None:
        self.spec, self.geometry, self.dtype = spec, geometry, dtype
        self.calls: list[str] = []

    def __call__(self, name: str, path: Path, generation: int) -> HostAdapter:
        self.calls.append(name)
        return load_peft_adapter(name, path, self.spec, self.geometry, self.dtype, generation=generation)


def _setup(model: ModelWithAdapters, tmp_path: Path, dtype: torch.dtype = torch.float32) -> tuple[ImageCache, Any]:
    spec = ModelSpec.from_dir(model.base)
    geometry = PoolGeometry(spec.num_layers, 8, spec.num_kv_heads, spec.head_dim)
    return ImageCache(tmp_path / "images", spec, geometry, dtype, max_rank=64), Converter(spec, geometry, dtype)


def _same(a: HostAdapter, b: HostAdapter) -> None:
    fields = ("name", "ranks", "scales", "generation", "num_pages")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert torch.equal(a.image, b.image) and torch.equal(a.a_local, b.a_local) and torch.equal(a.b_local, b.b_local)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_converted_once_then_mapped(llama: ModelWithAdapters, tmp_path: Path, dtype: torch.dtype) -> None:
    cache, convert = _setup(llama, tmp_path, dtype)
    load = cache.wrap(convert)
    for name in llama.adapters:
        first = load(name, llama.adapter_root / name, 1)
        again = load(name, llama.adapter_root / name, 2)
        _same(first, convert(name, llama.adapter_root / name, 1))
        assert again.generation == 2 and torch.equal(again.image, first.image)
    assert cache.writes == len(llama.adapters) and cache.hits == len(llama.adapters)
    assert convert.calls == [n for name in llama.adapters for n in (name, name)]  # the test's own calls included
    assert len(list((tmp_path / "images").glob("*.img"))) == len(llama.adapters)


def test_a_mapped_image_is_file_backed(llama: ModelWithAdapters, tmp_path: Path) -> None:
    """The image a hit returns shares the page cache's pages: it is a mapping of the file, not a private copy."""
    cache, convert = _setup(llama, tmp_path)
    path = llama.adapter_root / "r16-all"
    cache.load("r16-all", path, 0, convert)
    mapped = cache.load("r16-all", path, 0, convert)
    address = mapped.image.untyped_storage().data_ptr()
    maps = Path("/proc/self/maps").read_text().splitlines()
    files = [line.split()[-1] for line in maps if _covers(line, address)]
    assert files and files[0].endswith(".img")


def _covers(line: str, address: int) -> bool:
    low, high = (int(x, 16) for x in line.split()[0].split("-"))
    return low <= address < high


def test_hard_links_share_an_entry_and_a_rewritten_file_gets_a_new_one(
    llama: ModelWithAdapters, tmp_path: Path
) -> None:
    cache, convert = _setup(llama, tmp_path)
    source = llama.adapter_root / "r3-all"
    linked = tmp_path / "linked"
    linked.mkdir()
    for file in source.iterdir():
        os.link(file, linked / file.name)
    cache.load("a", source, 0, convert)
    cache.load("b", linked, 0, convert)
    assert cache.writes == 1 and cache.hits == 1 and convert.calls == ["a"]
    copy = Path(shutil.copytree(llama.adapter_root / "r1-qv", tmp_path / "rewritten"))
    before = cache.load("c", copy, 0, convert)
    shutil.copy(llama.adapter_root / "r5-ko" / "adapter_model.safetensors", copy / "adapter_model.safetensors")
    shutil.copy(llama.adapter_root / "r5-ko" / "adapter_config.json", copy / "adapter_config.json")
    after = cache.load("c", copy, 0, convert)
    assert cache.writes == 3 and before.ranks != after.ranks
    _same(after, convert("c", copy, 0))


def test_a_broken_entry_is_converted_again(llama: ModelWithAdapters, tmp_path: Path) -> None:
    cache, convert = _setup(llama, tmp_path)
    path = llama.adapter_root / "r8-mlp"
    cache.load("x", path, 0, convert)
    (image,) = (tmp_path / "images").glob("*.img")
    image.write_bytes(image.read_bytes()[:100])
    again = cache.load("x", path, 0, convert)
    assert convert.calls == ["x", "x"] and cache.writes == 2
    _same(again, convert("x", path, 0))
    assert cache.load("x", path, 0, convert).image.shape == again.image.shape and cache.hits == 1


def test_a_disk_that_refuses_writes_is_logged_once_and_adapters_still_load(
    llama: ModelWithAdapters, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache, convert = _setup(llama, tmp_path)

    def full(target: Path, suffix: str, data: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(image_cache, "_write_atomically", full)
    with caplog.at_level(logging.WARNING, logger="slora.backend.adapters.image_cache"):
        for name in llama.adapters[:3]:
            _same(cache.load(name, llama.adapter_root / name, 0, convert), convert(name, llama.adapter_root / name, 0))
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    assert cache.writes == 0 and cache.hits == 0
