"""PEFT adapter loading: accepted variants, refused ones with clear errors, the host store and name checks."""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slora.backend.adapters.host_adapter import load_peft_adapter, peft_scale
from slora.backend.adapters.store import (
    MAX_PRELOAD_WORKERS,
    AdapterExistsError,
    AdapterStore,
    preload_workers,
    validate_adapter_name,
)
from slora.backend.errors import AdapterError, AdapterNotFoundError
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import LORA_MODULES, ModelSpec
from tests.model_fixtures import ModelWithAdapters


@pytest.fixture(scope="module")
def spec(llama: ModelWithAdapters) -> ModelSpec:
    return ModelSpec.from_dir(llama.base)


@pytest.fixture(scope="module")
def geometry(spec: ModelSpec) -> PoolGeometry:
    return PoolGeometry(spec.num_layers, 8, spec.num_kv_heads, spec.head_dim)


def _load(path: Path, spec: ModelSpec, geometry: PoolGeometry, name: str = "x"):  # type: ignore[no-untyped-def]
    return load_peft_adapter(name, path, spec, geometry, torch.float32)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


def test_rows_in_pages_hold_peft_weights_scaled(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry
) -> None:
    """Every A row and Bᵀ row sits where the adapter's row table says; ranks and scales follow PEFT."""
    path = llama.adapter_root / "r2-down"  # rank 2, down_proj rank 7 (rank_pattern), q_proj alpha 9
    adapter = _load(path, spec, geometry)
    weights = load_file(str(path / "adapter_model.safetensors"))
    ranks = dict(zip(LORA_MODULES, adapter.ranks))
    assert ranks["q_proj"] == 2 and ranks["down_proj"] == 7 and ranks["k_proj"] == 0
    assert adapter.scales[LORA_MODULES.index("q_proj")] == pytest.approx(9 / 2)
    assert adapter.scales[LORA_MODULES.index("down_proj")] == pytest.approx(3 / 7)
    first = 0
    for m, module in enumerate(LORA_MODULES):
        rank = adapter.ranks[m]
        if not rank:
            continue
        in_f, out_f = spec.module_shape(module)
        parent = "self_attn" if m < 4 else "mlp"
        for layer in range(spec.num_layers):
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_"
            flat = adapter.image[layer].reshape(-1)
            for j in range(rank):
                a_off = int(adapter.a_local[first + j])
                b_off = int(adapter.b_local[first + j])
                assert torch.equal(flat[a_off : a_off + in_f], weights[key + "A.weight"][j])
                assert torch.equal(flat[b_off : b_off + out_f], weights[key + "B.weight"][:, j])
        first += rank


def _write_adapter(path: Path, weights: dict[str, torch.Tensor], **config: object) -> None:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(weights, str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize(("file_dtype", "dtype"), [(torch.float16, torch.bfloat16), (torch.float32, torch.float16)])
def test_per_layer_ranks_scales_and_skipped_layers(
    spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path, file_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    """Rows are padded to the module's largest rank, layers an adapter skips stay zero, and a layer's own scale is
    folded into its Bᵀ; rows run across page boundaries. Checked against a row-by-row reference image."""
    layer_ranks = {"q_proj": {0: 3, 1: 2}, "v_proj": {1: 4}, "o_proj": {0: 6, 1: 6}}
    alpha_pattern = {"layers.1.self_attn.q_proj": 5, "model.layers.0.self_attn.o_proj": 2}
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for module, layers in layer_ranks.items():
        in_f, out_f = spec.module_shape(module)
        for layer, rank in layers.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_"
            weights[key + "A.weight"] = torch.randn(rank, in_f, generator=generator).to(file_dtype)
            weights[key + "B.weight"] = torch.randn(out_f, rank, generator=generator).to(file_dtype)
    _write_adapter(tmp_path / "mixed", weights, lora_alpha=8, alpha_pattern=alpha_pattern)
    adapter = load_peft_adapter("mixed", tmp_path / "mixed", spec, geometry, dtype)

    expected = torch.zeros_like(adapter.image).view(spec.num_layers, -1)
    first = 0
    for m, module in enumerate(LORA_MODULES):
        layers = layer_ranks.get(module, {})
        assert adapter.ranks[m] == max(layers.values(), default=0)
        config = {"lora_alpha": 8, "alpha_pattern": alpha_pattern}
        scales = {}
        for layer, rank in layers.items():
            scales[layer] = peft_scale(config, f"model.layers.{layer}.self_attn.{module}", rank)
        if layers:
            assert adapter.scales[m] == scales[min(layers)]
        for layer, rank in layers.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_"
            in_f, out_f = spec.module_shape(module)
            for j in range(rank):
                a_off, b_off = int(adapter.a_local[first + j]), int(adapter.b_local[first + j])
                b_row = weights[key + "B.weight"][:, j].to(torch.float32) * (scales[layer] / adapter.scales[m])
                expected[layer, a_off : a_off + in_f] = weights[key + "A.weight"][j].to(dtype)
                expected[layer, b_off : b_off + out_f] = b_row.to(dtype)
        first += adapter.ranks[m]
    assert adapter.image.dtype == dtype
    assert adapter.num_pages > 2  # the width-64 rows (3+3+4+6+6 per layer) fill more than two 8-row pages
    assert torch.equal(adapter.image.view(spec.num_layers, -1).view(torch.int16), expected.view(torch.int16))


def test_pages_grow_with_rank_not_max_rank(llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry) -> None:
    small = _load(llama.adapter_root / "r3-all", spec, geometry)
    big = _load(llama.adapter_root / "r16-all", spec, geometry)
    elems_per_rank = sum(sum(spec.module_shape(m)) for m in LORA_MODULES)
    for adapter, rank in ((small, 3), (big, 16)):
        needed = math.ceil(rank * elems_per_rank / geometry.page_elems)
        assert needed <= adapter.num_pages <= needed + 3  # at most one partial page per row width


def test_peft_scale_rules() -> None:
    assert peft_scale({"lora_alpha": 16}, "model.layers.0.self_attn.q_proj", 4) == 4.0
    assert peft_scale({"lora_alpha": 16, "use_rslora": True}, "model.layers.0.self_attn.q_proj", 4) == 8.0
    pattern = {"lora_alpha": 16, "alpha_pattern": {"layers.1.self_attn.q_proj": 2}}
    assert peft_scale(pattern, "model.layers.1.self_attn.q_proj", 4) == 0.5
    assert peft_scale(pattern, "model.layers.0.self_attn.q_proj", 4) == 4.0


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: (p / "adapter_config.json").unlink(), "adapter_config.json is missing"),
        (lambda p: (p / "adapter_config.json").write_text("{nope"), "not valid JSON"),
        (lambda p: (p / "adapter_model.safetensors").unlink(), "adapter_model.safetensors is missing"),
        (lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"), "pickle file"),
        (lambda p: (p / "adapter_model.safetensors").write_bytes(b"garbage"), "cannot be read as safetensors"),
        (lambda p: _edit_config(p, peft_type="IA3"), "peft_type 'IA3' is not supported"),
        (lambda p: _edit_config(p, use_dora=True), "DoRA"),
        (lambda p: _edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda p: _edit_config(p, bias="all"), "bias='all'"),
    ],
)
def test_refused_with_file_and_reason(
    llama: ModelWithAdapters,
    spec: ModelSpec,
    geometry: PoolGeometry,
    tmp_path: Path,
    mutate,
    message: str,  # type: ignore[no-untyped-def]
) -> None:
    path = _copy(llama.adapter_root / "r1-qv", tmp_path)
    mutate(path)
    with pytest.raises(AdapterError, match=message) as err:
        _load(path, spec, geometry, name="bad-one")
    assert "bad-one" in str(err.value)


def _rewrite_tensors(path: Path, change) -> None:  # type: ignore[no-untyped-def]
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(1, 64)}), "unknown target"),
        (
            lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(1, 160)}),
            "unknown target",
        ),  # fmt: skip
        (lambda t: t.update({k: v[:, :10] for k, v in t.items() if "lora_A" in k}), "has shape"),
        (lambda t: t.update({k: torch.zeros(64, 2) for k, v in t.items() if "v_proj.lora_B" in k}), "has shape"),
        (
            lambda t: t.update({k: v.clone().fill_(float("nan")) for k, v in t.items() if "lora_B" in k}),
            "NaN or infinite",
        ),
        (
            lambda t: t.update(
                {k: v.clone().fill_(float("inf")) for k, v in t.items() if "1.self_attn.v_proj.lora_A" in k}
            ),
            r"layers\.1\.self_attn\.v_proj\.lora_A\.weight' holds NaN or infinite",
        ),  # the one tensor is named, not just its layer and module
        (lambda t: [t.pop(k) for k in list(t) if "q_proj.lora_B" in k], "without its lora_B"),
        (lambda t: t.update({k.replace("layers.0", "layers.9"): v.clone() for k, v in list(t.items())}), "layer 9"),
    ],
)
def test_bad_tensors_refused(
    llama: ModelWithAdapters,
    spec: ModelSpec,
    geometry: PoolGeometry,
    tmp_path: Path,
    change,
    message: str,  # type: ignore[no-untyped-def]
) -> None:
    path = _copy(llama.adapter_root / "r1-qv", tmp_path)
    _rewrite_tensors(path, change)
    with pytest.raises(AdapterError, match=message):
        _load(path, spec, geometry)


def test_rank_above_limit_refused(llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry) -> None:
    with pytest.raises(AdapterError, match="ranks 1 to 8"):
        load_peft_adapter("big", llama.adapter_root / "r12-qkv", spec, geometry, torch.float32, max_rank=8)


@pytest.mark.parametrize("name", ["../etc", "a/b", ".hidden", "", "x" * 200, "a b", None, 3])
def test_adapter_names_are_validated(name: object) -> None:
    with pytest.raises(AdapterError, match="invalid"):
        validate_adapter_name(name)


def _store(llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, budget: int, root: Path) -> AdapterStore:
    def loader(name: str, path: Path, generation: int):  # type: ignore[no-untyped-def]
        return load_peft_adapter(name, path, spec, geometry, torch.float32, generation=generation)

    return AdapterStore(loader, budget, root=root)


def test_store_lru_budget_and_root_confinement(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path
) -> None:
    one = load_peft_adapter("r3-all", llama.adapter_root / "r3-all", spec, geometry, torch.float32).nbytes
    store = _store(llama, spec, geometry, budget=int(one * 2.5), root=llama.adapter_root)
    for name in ("r3-all", "r5-ko", "r1-qv", "r3-all", "r8-mlp"):
        store.get(name)
    assert store.host_bytes <= store.budget_bytes
    assert store.host_evictions >= 1
    in_host = {a.name for a in store.list() if a.in_host}
    assert "r8-mlp" in in_host and "r5-ko" not in in_host
    with pytest.raises(AdapterNotFoundError, match="'missing'"):
        store.get("missing")
    outside = tmp_path / "outside"
    shutil.copytree(llama.adapter_root / "r1-qv", outside)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "escape").symlink_to(outside)
    confined = _store(llama, spec, geometry, budget=1 << 30, root=tmp_path / "root")
    with pytest.raises(AdapterError, match="outside the adapter root"):
        confined.get("escape")


def test_registry_register_and_unregister(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path
) -> None:
    registry = tmp_path / "multi_lora.json"
    registry.write_text(json.dumps({"alias": str(llama.adapter_root / "r5-ko")}))
    store = _store(llama, spec, geometry, budget=1 << 30, root=tmp_path)
    store.register_file(registry)
    first = store.get("alias")
    assert first.ranks[LORA_MODULES.index("k_proj")] == 5
    second = store.register("alias", llama.adapter_root / "r1-qv", replace=True)
    assert second is not None and second.generation > first.generation
    assert store.get("alias").ranks[0] == 1
    bad = _copy(llama.adapter_root / "r1-qv", tmp_path)
    _edit_config(bad, peft_type="PREFIX_TUNING")
    with pytest.raises(AdapterError):
        store.register("broken", bad)
    assert "broken" not in {a.name for a in store.list()}
    store.unregister("alias")
    with pytest.raises(AdapterNotFoundError):
        store.get("alias")


def test_preload_fills_host_memory_and_skips_bad_ones(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(llama.adapter_root, root)
    _edit_config(root / "r5-ko", peft_type="IA3")
    store = _store(llama, spec, geometry, budget=1 << 30, root=root)
    assert store.preload(workers=3) == len(llama.adapters) - 1
    in_host = {a.name for a in store.list() if a.in_host}
    assert in_host == set(llama.adapters) - {"r5-ko"}
    assert store.preload() == 0  # all in host memory already


def test_preload_of_named_adapters_loads_only_those(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry
) -> None:
    store = _store(llama, spec, geometry, budget=1 << 30, root=llama.adapter_root)
    chosen = list(llama.adapters[1:3])
    assert store.preload(workers=2, names=chosen) == 2
    assert {a.name for a in store.list() if a.in_host} == set(chosen)


def test_preload_threads_follow_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    for cores, workers in ((1, 1), (2, 2), (64, MAX_PRELOAD_WORKERS)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert preload_workers() == workers


def test_preload_loads_on_one_intra_op_thread_and_restores_torch_threads(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path
) -> None:
    seen: list[int] = []

    def load(name: str, path: Path, generation: int):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return load_peft_adapter(name, path, spec, geometry, torch.float32, generation=generation)

    previous = torch.get_num_threads()
    store = AdapterStore(load, 1 << 30, llama.adapter_root)
    assert store.preload(workers=2) == len(llama.adapters)
    assert seen == [1] * len(llama.adapters)
    assert torch.get_num_threads() == previous


def _gets_together(store: AdapterStore, name: str, callers: int) -> list[object]:
    """What `callers` threads got from store.get(name), called at once: the adapter or the exception."""
    results: list[object] = [None] * callers

    def call(i: int) -> None:
        try:
            results[i] = store.get(name)
        except AdapterError as exc:
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def _gated_loader(spec: ModelSpec, geometry: PoolGeometry, reads: list[str], error: str | None, waiters: int):  # type: ignore[no-untyped-def]
    """A loader that counts its reads and lets each finish only once the store counts `waiters` gets waiting for
    it (every caller but the reading one)."""
    store_ref: list[AdapterStore] = []

    def load(name: str, path: Path, generation: int):  # type: ignore[no-untyped-def]
        reads.append(name)
        deadline = time.monotonic() + 10
        while store_ref[0].load_waits < waiters and time.monotonic() < deadline:
            time.sleep(0.01)
        if error:
            raise AdapterError(error)
        return load_peft_adapter(name, path, spec, geometry, torch.float32, generation=generation)

    return load, store_ref


@pytest.mark.parametrize("error", [None, "adapter 'r3-all': disk on fire"])
def test_concurrent_gets_of_one_adapter_read_it_once(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, error: str | None
) -> None:
    reads: list[str] = []
    callers = 4
    load, store_ref = _gated_loader(spec, geometry, reads, error, waiters=callers - 1)
    store = AdapterStore(load, 1 << 30, llama.adapter_root)
    store_ref.append(store)
    results = _gets_together(store, "r3-all", callers)
    assert reads == ["r3-all"] and store.load_waits == callers - 1
    if error:
        assert all(isinstance(r, AdapterError) and "disk on fire" in str(r) for r in results)
        assert not store.in_host("r3-all")
        with pytest.raises(AdapterError, match="disk on fire"):
            store.get("r3-all")  # a failed read is not remembered: the next get reads again
        assert reads == ["r3-all", "r3-all"]
    else:
        assert all(r is results[0] for r in results) and store.in_host("r3-all") and store.loads == 1
        assert store.get("r3-all") is results[0] and reads == ["r3-all"]


# ---- config numbers, bad root entries, names, replace (issue 25) ---------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"lora_alpha": float("nan")}, "lora_alpha"),
        ({"lora_alpha": float("inf")}, "lora_alpha"),
        ({"lora_alpha": 1e300}, "lora_alpha"),  # finite, but the scale 1e300 / r makes every output garbage
        ({"lora_alpha": 1e-320}, "lora_alpha"),  # positive, but the scale underflows to nothing
        ({"lora_alpha": -4}, "lora_alpha"),
        ({"lora_alpha": True}, "lora_alpha"),
        ({"lora_alpha": "8"}, "lora_alpha"),
        ({"r": 0}, "r must be an integer rank"),
        ({"r": 2.5}, "r must be an integer rank"),
        ({"r": float("nan")}, "r must be an integer rank"),
        ({"r": True}, "r must be an integer rank"),
        ({"r": 10**6}, "r must be an integer rank"),
        ({"alpha_pattern": {"q_proj": float("nan")}}, r"alpha_pattern\['q_proj'\]"),
        ({"alpha_pattern": {"q_proj": float("-inf")}}, r"alpha_pattern\['q_proj'\]"),
        ({"alpha_pattern": {"v_proj": 1e300}}, r"alpha_pattern\['v_proj'\]"),
        ({"alpha_pattern": {"v_proj": 0}}, r"alpha_pattern\['v_proj'\]"),
        ({"alpha_pattern": [1, 2]}, "alpha_pattern"),
        ({"rank_pattern": {"q_proj": float("nan")}}, r"rank_pattern\['q_proj'\]"),
        ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\]"),
        ({"rank_pattern": {"q_proj": 1.5}}, r"rank_pattern\['q_proj'\]"),
        ({"lora_dropout": float("nan")}, "lora_dropout"),
        ({"lora_dropout": 1.5}, "lora_dropout"),
        ({"lora_dropout": -0.1}, "lora_dropout"),
        ({"use_rslora": "yes"}, "use_rslora"),
        ({"layers_to_transform": [0, -1]}, "layers_to_transform"),
        ({"layers_to_transform": 0.5}, "layers_to_transform"),
    ],
)
def test_config_numbers_are_checked_with_file_and_field(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path, changes: dict, field: str
) -> None:
    """NaN, infinite or absurd numbers in adapter_config.json are refused, naming the file and the field; before,
    lora_alpha NaN/inf/1e300 was accepted and the adapter emitted token 0 forever."""
    path = _copy(llama.adapter_root / "r1-qv", tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(AdapterError, match=field) as err:
        _load(path, spec, geometry, name="bad-numbers")
    assert "bad-numbers" in str(err.value) and str(path / "adapter_config.json") in str(err.value)


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"lora_alpha": 1e5}, "lora_alpha"),  # 1e5 / 1: finite numbers, a scale no trained adapter has
        ({"lora_alpha": 1e-7, "use_rslora": True}, "lora_alpha"),
        ({"alpha_pattern": {"model.layers.1.self_attn.v_proj": 1e7}}, "alpha_pattern"),
    ],
)
def test_the_folded_scale_is_checked(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path, changes: dict, where: str
) -> None:
    path = _copy(llama.adapter_root / "r1-qv", tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(AdapterError, match=rf"{where}.*scale") as err:
        _load(path, spec, geometry)
    assert str(path / "adapter_config.json") in str(err.value)


def test_sane_config_numbers_still_load(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path
) -> None:
    path = _copy(llama.adapter_root / "r1-qv", tmp_path)
    _edit_config(path, lora_alpha=0.5, lora_dropout=0.1, use_rslora=True, r=1, layers_to_transform=[0, 1],
                 rank_pattern={"q_proj": 1}, alpha_pattern={"v_proj": 64.0})  # fmt: skip
    adapter = _load(path, spec, geometry)
    assert adapter.scales[LORA_MODULES.index("q_proj")] == 0.5
    assert adapter.scales[LORA_MODULES.index("v_proj")] == 64.0


@pytest.mark.parametrize("name", ["abc\n", "a\tb", "a\x00b", "a..b", "..", "a\\b", "a/../b", "tenant\r\n"])
def test_adapter_names_with_control_characters_separators_or_dots_are_refused(name: str) -> None:
    with pytest.raises(AdapterError, match="invalid") as err:
        validate_adapter_name(name)
    assert repr(name) in str(err.value)


def _root_with_bad_entries(llama: ModelWithAdapters, tmp_path: Path) -> Path:
    """An adapter root: two good adapters, a folder symlink and a weights-file symlink that leave the root, a
    folder symlink that stays inside (an alias), and a folder with a config but a name no client can send."""
    root = tmp_path / "root"
    root.mkdir()
    for name in ("r1-qv", "r5-ko"):
        shutil.copytree(llama.adapter_root / name, root / name)
    outside = tmp_path / "outside"
    shutil.copytree(llama.adapter_root / "r3-all", outside)
    (root / "link-out").symlink_to(outside)
    leaky = root / "leaky-weights"
    leaky.mkdir()
    shutil.copy(outside / "adapter_config.json", leaky / "adapter_config.json")
    (leaky / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    (root / "alias").symlink_to(root / "r1-qv")
    shutil.copytree(llama.adapter_root / "r1-qv", root / "bad name")
    (root / ".cache").mkdir()  # hidden: never an adapter, never reported
    return root


def test_bad_root_entries_are_skipped_and_reported_once(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One bad entry of the adapter root no longer fails the whole listing (and with it start-up and `list`)."""
    store = _store(llama, spec, geometry, budget=1 << 30, root=_root_with_bad_entries(llama, tmp_path))
    with caplog.at_level("WARNING", logger="slora.backend.adapters.store"):
        assert [a.name for a in store.list()] == ["alias", "r1-qv", "r5-ko"]
        assert store.counts() == (0, 3)
        assert [a.name for a in store.list()] == ["alias", "r1-qv", "r5-ko"]
    bad = store.bad_entries()
    assert set(bad) == {"link-out", "leaky-weights", "bad name"}
    assert "outside the adapter root" in bad["link-out"] and "outside the adapter root" in bad["leaky-weights"]
    assert "invalid" in bad["bad name"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 3 and all("skipped" in w for w in warned)  # once each, not once per listing
    assert store.get("alias").ranks == store.get("r1-qv").ranks


def test_symlinks_out_of_the_root_are_refused_for_folders_and_weight_files(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path
) -> None:
    store = _store(llama, spec, geometry, budget=1 << 30, root=_root_with_bad_entries(llama, tmp_path))
    with pytest.raises(AdapterError, match="'link-out'.*outside the adapter root"):
        store.get("link-out")
    with pytest.raises(AdapterError, match=r"'leaky-weights'.*adapter_model\.safetensors.*outside the adapter root"):
        store.get("leaky-weights")
    with pytest.raises(AdapterNotFoundError, match="'ghost'"):
        store.get("ghost")
    assert not store.in_host("leaky-weights")


def test_load_of_an_existing_name_needs_replace(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path
) -> None:
    """A registered name, or a folder of the root, is not silently re-pointed to other weights."""
    store = _store(llama, spec, geometry, budget=1 << 30, root=llama.adapter_root)
    store.register("tenant", llama.adapter_root / "r5-ko")
    with pytest.raises(AdapterExistsError, match="'tenant' already exists.*replace"):
        store.register("tenant", llama.adapter_root / "r1-qv")
    with pytest.raises(AdapterExistsError, match="'r8-mlp' already exists"):
        store.register("r8-mlp", llama.adapter_root / "r1-qv")  # a folder of the root
    assert store.path_of("tenant") == llama.adapter_root / "r5-ko"
    assert store.get("r8-mlp").ranks[LORA_MODULES.index("gate_proj")] == 8
    replaced = store.register("r8-mlp", llama.adapter_root / "r1-qv", replace=True)
    assert replaced is not None and store.get("r8-mlp") is replaced and replaced.ranks[0] == 1
    assert store.path_of("ghost") is None


def test_per_layer_scales_that_overflow_the_dtype_are_refused(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path
) -> None:
    """Each in range, but layer 1's scale is 1e10 times layer 0's: folded into its Bᵀ it overflows float16."""
    path = _copy(llama.adapter_root / "r1-qv", tmp_path)
    _edit_config(path, lora_alpha=1e-6, alpha_pattern={"model.layers.1.self_attn.v_proj": 1e4})
    assert _load(path, spec, geometry).image.isfinite().all()  # float32 holds it
    with pytest.raises(AdapterError, match="v_proj.*beyond torch.float16"):
        load_peft_adapter("x", path, spec, geometry, torch.float16)


def test_counts_relist_the_root_off_the_callers_thread(
    llama: ModelWithAdapters, spec: ModelSpec, geometry: PoolGeometry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread asks for the counts after every step: once the root's listing is older than its TTL the
    call returns the old count at once, and a new folder is counted when the listing made in another thread ends."""
    root = tmp_path / "root"
    shutil.copytree(llama.adapter_root / "r1-qv", root / "first")
    store = _store(llama, spec, geometry, budget=1 << 30, root=root)
    assert store.counts() == (0, 1)
    shutil.copytree(llama.adapter_root / "r5-ko", root / "second")
    assert store.counts() == (0, 1)  # within the TTL: the listing is not redone
    listing, release = threading.Event(), threading.Event()
    scan = store._scan_root

    def slow_scan() -> tuple[dict[str, Path], dict[str, str]]:
        listing.set()
        release.wait(10)
        return scan()

    monkeypatch.setattr(store, "_scan_root", slow_scan)
    monkeypatch.setattr("slora.backend.adapters.store.ROOT_LISTING_TTL_S", 0.0)
    assert store.counts() == (0, 1)  # the listing is under way in its own thread, not this one
    assert listing.wait(10)
    assert store.counts() == (0, 1)  # one listing at a time
    release.set()
    deadline = time.monotonic() + 10
    while store.counts() != (0, 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.counts() == (0, 2)
