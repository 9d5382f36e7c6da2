"""Adapter copies run on the copier's thread: each lands in exactly its pages of every layer once its Future
is done, many in a row reuse the staging buffers safely (CUDA), and nothing else in the pool changes."""

from __future__ import annotations

import pytest
import torch

from slora.backend.memory.adapter_copier import AdapterCopier, copy_pages_on_host

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staging_buffers", [1, 2])
def test_copies_land_in_their_pages_only(device: str, staging_buffers: int, dtype: torch.dtype) -> None:
    layers, pages, page_elems = 3, 40, 64
    storage = torch.full((layers, pages, page_elems), -1.0, device=device, dtype=dtype)
    copier = AdapterCopier(storage, staging_buffers)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(pages, generator=generator).tolist()
    placed: list[tuple[list[int], torch.Tensor]] = []
    for size in (3, 1, 5, 2, 4, 3, 6, 2):  # more copies than buffers, of different sizes
        chosen, order = order[:size], order[size:]
        image = torch.randn((layers, size, page_elems), generator=generator).to(dtype)
        placed.append((chosen, image))
    done = [copier.submit(image, torch.tensor(chosen, dtype=torch.int64)) for chosen, image in placed]
    for future in done:
        event = future.result(timeout=60)
        assert (event is None) == (device == "cpu")
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
    result = storage.cpu()
    for chosen, image in placed:
        torch.testing.assert_close(result[:, chosen], image, rtol=0, atol=0)
    untouched = [p for p in range(pages) if p in order]
    assert torch.all(result[:, untouched] == -1.0)
    copier.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compute and copy streams")
def test_copy_waits_for_work_queued_before_it() -> None:
    """A copy submitted after the compute stream queued a write to the same pages lands after that write: with
    overlapped steps a launched step may still use pages that were freed and handed to an adapter."""
    storage = torch.zeros((2, 8, 1 << 20), device="cuda")
    copier = AdapterCopier(storage)
    torch.cuda._sleep(200_000_000)  # keeps the compute stream busy for a while (~0.1 s)
    storage[:, 3].fill_(-1.0)  # a late write by "the step in flight"
    image = torch.ones((2, 1, 1 << 20))
    event = copier.submit(image, torch.tensor([3], dtype=torch.int64)).result(timeout=60)
    torch.cuda.current_stream().wait_event(event)
    assert bool(torch.all(storage[:, 3] == 1.0))
    copier.close()


def test_a_host_pool_refuses_an_image_of_another_dtype() -> None:
    storage = torch.zeros((2, 4, 8), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32.*bfloat16"):
        copy_pages_on_host(storage, torch.tensor([1]), torch.ones((2, 1, 8), dtype=torch.float32))
    assert not storage.any()
