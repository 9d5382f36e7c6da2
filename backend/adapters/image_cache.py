"""Adapters' converted page images on local disk: each adapter file version converted once, then memory-mapped.

Converting a PEFT file into its pool-page image (load_peft_adapter: read, check, transpose, fold scales, lay the
rows out in pages) costs far more CPU than the bytes it moves. With more adapters than the host budget holds the
store drops adapters and reads them again; through this cache a read again maps the converted image: no
conversion, and the OS page cache is the tier below host memory (an image still in it costs no disk read either).
A mapped image is file-backed: when the store drops it the kernel may reclaim its pages, and nothing is held twice
(the page cache and a private copy).

The directory::

    <key>.img    the image: [num_layers, num_pages, page_elems] in the model dtype, raw, C order
    <key>.json   {"format", "ranks", "scales", "shape"}; written after the image, so that it means the image is whole

<key> is a digest of what the image depends on: the config's bytes, the weights file's identity (device, inode,
size, mtime: hard links of one file share a key, a file rewritten gets a new one), the base model's projection
shapes, the page geometry, the dtype, max_rank and FORMAT. An entry is never rewritten; entries of files rewritten
since stay until the directory is cleared. Nothing is written that would leave less than MIN_FREE_FRACTION of the
file system free, and a write that fails (a full or read-only disk) is logged once: the adapter is then served from
its converted copy in memory, as without the cache.

Not with tensor parallelism: a rank's shard has a layout of its own (parallel/adapter_shard.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from slora.backend.adapters.host_adapter import CONFIG_FILE, WEIGHTS_FILE, HostAdapter, _layout, _row_offsets
from slora.backend.adapters.store import AdapterLoader
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import LORA_MODULES, ModelSpec

logger = logging.getLogger(__name__)

FORMAT = 1  # bumped whenever the image layout or the metadata change
WARM_CHUNK_BYTES = 1 << 20
MIN_FREE_FRACTION = 0.1  # of the cache's file system, left free: the cache never fills the disk
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ImageCache:
    """Page images under `directory` for one base model, page geometry and dtype (thread-safe)."""

    def __init__(
        self,
        directory: str | Path,
        spec: ModelSpec,
        geometry: PoolGeometry,
        dtype: torch.dtype,
        max_rank: int,
        pin_memory: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.geometry = geometry
        self.dtype = dtype
        self.pin_memory = pin_memory
        shapes = [spec.module_shape(m) for m in LORA_MODULES]
        self._model = json.dumps([FORMAT, spec.num_layers, shapes, repr(geometry), str(dtype), max_rank])
        self._lock = threading.Lock()
        self._write_failed = False
        self.hits = 0  # reads served by a mapped image
        self.writes = 0  # images converted and written

    def wrap(self, convert: AdapterLoader) -> AdapterLoader:
        """A loader that maps the cached image of an adapter, or converts it with `convert` and caches it."""

        def load(name: str, path: Path, generation: int) -> HostAdapter:
            return self.load(name, path, generation, convert)

        return load

    def load(self, name: str, path: Path, generation: int, convert: AdapterLoader) -> HostAdapter:
        key = self.key(path)
        if key is None:  # the files cannot be read: the conversion says why, naming the file
            return convert(name, path, generation)
        found = self._open(key, name, path, generation)
        if found is not None:
            with self._lock:
                self.hits += 1
            return found
        adapter = convert(name, path, generation)
        if not self._write(key, adapter):
            return adapter
        # The mapped image is the page cache's copy: the converted one is freed instead of being held twice.
        return self._open(key, name, path, generation) or adapter

    def key(self, path: Path) -> str | None:
        """The digest naming `path`'s image, or None when its config or weights cannot be read."""
        try:
            config = (path / CONFIG_FILE).read_bytes()
            stat = os.stat(path / WEIGHTS_FILE)
        except OSError:
            return None
        identity = [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns]
        text = json.dumps([self._model, hashlib.sha256(config).hexdigest(), identity])
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def _open(self, key: str, name: str, path: Path, generation: int) -> HostAdapter | None:
        """The image of `key` mapped (read through once, so that the page cache holds it), or None when there is
        none or it does not match what this model needs (it is then converted and written again)."""
        meta_file, image_file = self.directory / f"{key}.json", self.directory / f"{key}.img"
        try:
            meta = json.loads(meta_file.read_text())
            shape, ranks, scales = _checked_meta(meta, self.spec, self.geometry)
            numel = shape[0] * shape[1] * shape[2]
            if image_file.stat().st_size != numel * _element_size(self.dtype):
                raise ValueError(f"{image_file} is not {shape} of {self.dtype}")
            warm(image_file)
            image = torch.from_file(str(image_file), shared=False, size=numel, dtype=self.dtype).view(shape)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            logger.warning("adapter image cache: entry %s of adapter %r is unusable (%s); converting it again",
                           key, name, exc)  # fmt: skip
            return None
        a_local, b_local = _row_offsets(_layout(ranks, self.spec, self.geometry), ranks, self.geometry.page_elems)
        if self.pin_memory:
            image = image.pin_memory()
        return HostAdapter(name, path, ranks, scales, image, a_local, b_local, generation)

    def _write(self, key: str, adapter: HostAdapter) -> bool:
        """Write `adapter`'s image and metadata under `key` (each through a temporary file and a rename, so that a
        reader never sees part of one); False, logged once, when the disk refuses."""
        meta = {"format": FORMAT, "ranks": list(adapter.ranks), "scales": list(adapter.scales),
                "shape": list(adapter.image.shape)}  # fmt: skip
        suffix = f".{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            if not self._room_for(adapter.nbytes):
                raise OSError(f"less than {MIN_FREE_FRACTION:.0%} of the file system would stay free")
            _write_atomically(self.directory / f"{key}.img", suffix, _image_bytes(adapter.image))
            _write_atomically(self.directory / f"{key}.json", suffix, json.dumps(meta).encode())
        except OSError as exc:
            with self._lock:
                first, self._write_failed = not self._write_failed, True
            if first:
                logger.warning("adapter image cache: cannot write to %s (%s); adapters are converted at every read",
                               self.directory, exc)  # fmt: skip
            return False
        with self._lock:
            self.writes += 1
        return True

    def _room_for(self, nbytes: int) -> bool:
        disk = os.statvfs(self.directory)
        return (disk.f_bavail * disk.f_frsize - nbytes) >= MIN_FREE_FRACTION * disk.f_blocks * disk.f_frsize


def warm(file: Path) -> None:
    """Read `file` through once, so that its pages are in the page cache before anyone copies from its mapping: the
    disk read happens here, on the reader's thread, not in the copier's (which would hold up every copy behind)."""
    buffer = bytearray(WARM_CHUNK_BYTES)
    with open(file, "rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass


def _checked_meta(
    meta: Any, spec: ModelSpec, geometry: PoolGeometry
) -> tuple[tuple[int, int, int], tuple[int, ...], tuple[float, ...]]:
    """(shape, ranks, scales) of an entry's metadata; ValueError unless they fit this model and page geometry."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else meta!r}, not {FORMAT}")
    shape = tuple(int(n) for n in meta["shape"])
    ranks = tuple(int(r) for r in meta["ranks"])
    scales = tuple(float(s) for s in meta["scales"])
    if len(ranks) != len(LORA_MODULES) or len(scales) != len(LORA_MODULES) or len(shape) != 3:
        raise ValueError("ranks, scales or shape of the wrong length")
    pages = sum(g.num_pages for g in _layout(ranks, spec, geometry))
    if shape != (spec.num_layers, pages, geometry.page_elems):
        raise ValueError(f"shape {shape}, but its ranks need {(spec.num_layers, pages, geometry.page_elems)}")
    return (shape[0], shape[1], shape[2]), ranks, scales


def _image_bytes(image: torch.Tensor) -> memoryview:
    """The image's bytes, without a copy, through an integer view of the same width (numpy has no bfloat16)."""
    flat = image.contiguous().view(_SAME_WIDTH_INT[image.element_size()]).reshape(-1).numpy()
    return flat.view("uint8").data


def _write_atomically(target: Path, suffix: str, data: memoryview | bytes) -> None:
    temporary = target.with_name(target.name + suffix)
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, target)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
