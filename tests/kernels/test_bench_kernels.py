"""perf/bench_kernels.py end to end at tiny shapes (--smoke): every case runs and the Triton rows match the torch
reference; on CPU the kernels run in Triton's interpreter (timings mean nothing there)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark instead")
def test_bench_kernels_smoke(tmp_path: Path) -> None:
    from perf import bench_kernels

    out = tmp_path / "kernels.json"
    assert bench_kernels.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    kernels = {r["kernel"] for r in rows}
    assert {"lora_qkv", "lora_layer", "attention_decode", "attention_prefill", "kv_write"} <= kernels
    graphs = ("triton_graph", "split_graph")
    parts = {f"{impl}:{part}" for impl in ("triton", "triton_pair", *graphs) for part in ("shrink", "expand")}
    impls = {"triton", "torch_ref", "padded_bmm", "triton_pair", *graphs, "triton_fused", "fused_engine",
             "fused_graph"}  # fmt: skip
    assert {r["impl"] for r in rows} == impls | parts
    pair = [r for r in rows if r["impl"] == "triton_pair"]  # the steps with decodes and prompts, lora_split off
    assert pair and all("prompt" in r["case"] and r["kernel"].startswith("lora_") for r in pair), pair
    assert any(r["case"].startswith(bench_kernels.SERVED_MIXED) for r in pair), "the served step with prompts"
    # a step with prompts, shrink and expand timed apart: their minimum bytes are the whole call's, split in two
    whole = {(r["kernel"], r["case"], r["impl"]): r["min_bytes"] for r in rows}
    for r in pair:
        for impl in ("triton", "triton_pair"):
            shrink, expand = (whole[(r["kernel"], r["case"], f"{impl}:{part}")] for part in ("shrink", "expand"))
            assert 0 < shrink < r["min_bytes"] and shrink + expand == r["min_bytes"], (r["kernel"], r["case"])
    # the decode steps, also as a CUDA graph replays them; the 7-token S2 step (3n/2 + 1) is padded to bucket 8
    graph = {r["case"] for r in rows if r["impl"] == "triton_graph"}
    lora = [r for r in rows if r["impl"] == "triton" and r["kernel"].startswith("lora_")]
    decode = {r["case"] for r in lora if "decode" in r["case"] and "prompt" not in r["case"]}
    # the served steps with prompts (an adapter a request, and 5 adapters) as their graph replays them, both ways
    mixed = {c for c in graph if c.startswith(bench_kernels.SERVED_MIXED)}
    assert mixed == {r["case"] for r in rows if r["impl"] == "split_graph"} and len(mixed) == 2, mixed
    for case in mixed:
        for impl in graphs:
            shrink, expand = (whole[("lora_qkv", case, f"{impl}:{part}")] for part in ("shrink", "expand"))
            assert shrink + expand == whole[("lora_qkv", case, impl)], (case, impl)
    graph -= mixed
    assert graph == decode and any(c.startswith("S2 decode 7 req") for c in graph), graph
    assert {r["case"] for r in rows if r["impl"] == "fused_graph"} == graph, "lora_fused's graph of each decode step"
    assert any(c.startswith(bench_kernels.SERVED_DECODE) for c in graph), "the served decode step"
    # the served decode steps (an adapter a request, and 5 adapters) as their graphs replay them: shrink and expand
    served_parts = {r["case"] for r in rows if r["impl"] == "triton_graph:shrink"} - mixed
    assert served_parts == {c for c in graph if c.startswith(bench_kernels.SERVED_DECODE)}, served_parts
    assert any(", 5 adapters @" in c for c in served_parts), served_parts
    for r in rows:
        assert r["ms"] > 0 and r["min_bytes"] > 0 and math.isfinite(r["gbps"])
        if r["max_rel_err"] is not None:
            assert r["max_rel_err"] < 0.05, r
        assert (r["same_size_copy_ms"] is not None) == (r["impl"] == "triton"), r  # the copy of the op's own size
        if r["kernel"].startswith("lora_"):  # checked against the reference: every whole call
            assert (r["max_rel_err"] is None) == (":" in r["impl"] or r["kernel"] == "lora_layer"), r
    assert result["targets"], "no target was checked"
    # the decodes beside prompts go through the general attention kernel, held to the decode bandwidth target
    targets = [t["target"] for t in result["targets"]]
    assert any(t.startswith(f"attention_prefill [{bench_kernels.DECODES_WITH_PROMPTS}") for t in targets), targets


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark instead")
def test_spread_pages_scatters_the_lora_cases_over_a_larger_pool(tmp_path: Path) -> None:
    """--spread-pages: the same cases, named with their pool's size, still matching the torch reference."""
    from perf import bench_kernels

    out = tmp_path / "kernels.json"
    assert bench_kernels.main(["--smoke", "--only", "lora", "--spread-pages", "300", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all("[pool of 300 pages] @" in r["case"] for r in rows), {r["case"] for r in rows}
    checked = [r for r in rows if r["max_rel_err"] is not None]
    assert checked and all(r["max_rel_err"] < 0.05 for r in checked)
    with pytest.raises(SystemExit):
        bench_kernels.main(["--smoke", "--spread-pages", "-1", "--out", str(out)])
    bench_kernels.spread_pages = 0  # the module's default, for whatever runs next in this process


def test_tune_case_sweeps_the_served_step_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """--tune-case: the sweep of a saturated server's GQA step with prompts, and no other sweep."""
    from perf import bench_kernels

    swept: list[tuple[str, int, int]] = []

    def fake_tune(label: str, case: object, call: int = 0) -> list[dict[str, object]]:
        swept.append((label, case.num_tokens, call))  # type: ignore[attr-defined]
        return [{"kernel": label, "config": "c", "ms": 1.0, "vs_default": 1.0}]

    monkeypatch.setattr(bench_kernels, "tune_lora", fake_tune)
    monkeypatch.setattr(bench_kernels, "DEVICE", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    assert bench_kernels.tune(True, None, bench_kernels.SERVED_MIXED)[0]["kernel"] == swept[0][0]
    ((label, tokens, call),) = swept
    assert label.startswith(bench_kernels.SERVED_MIXED) and call == 0
    assert tokens == 40 + 2 * 30  # the smoke shape: 7n + 12 decodes beside two prompts of 13n/2 + 4 tokens, n = 4


def test_tune_case_sweeps_the_served_decode_step_as_its_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """--tune-case "served decode": a saturated server's decode step, each request on its own S1 adapter, as its
    CUDA graph replays it (the bucket's tokens, static metadata), swept on its q/k/v and o calls."""
    from perf import bench_kernels
    from slora.backend.executor.cuda_graphs import bucket_for, bucket_sizes

    swept: list[tuple[str, int, int, str]] = []

    def fake_tune(label: str, case: object, call: int = 0) -> list[dict[str, object]]:
        meta = case.meta  # type: ignore[attr-defined]
        swept.append((label, case.num_tokens, call, meta.whole().kind(bench_kernels.kernel_settings)))  # type: ignore[attr-defined]
        assert meta.static is not None, "graph metadata"
        return [{"kernel": label, "config": "c", "ms": 1.0, "vs_default": 1.0}]

    fused: list[tuple[int, int, bool]] = []

    def fake_fused(case: object, call: int) -> list[dict[str, object]]:
        fused.append((case.num_tokens, call, case.meta.static is None))  # type: ignore[attr-defined]
        return []

    monkeypatch.setattr(bench_kernels, "tune_lora", fake_tune)
    monkeypatch.setattr(bench_kernels, "tune_fused", fake_fused)
    monkeypatch.setattr(bench_kernels, "DEVICE", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    assert len(bench_kernels.tune(True, None, bench_kernels.SERVED_DECODE)) == 2
    bucket = bucket_for(bucket_sizes(bench_kernels.GRAPH_MAX_SEQS), 12)  # the smoke shape: 6n - 12 decodes, n = 4
    assert [(tokens, call, kind) for _, tokens, call, kind in swept] == [(bucket, 0, "decode"), (bucket, 1, "decode")]
    assert swept[0][0].startswith(bench_kernels.SERVED_DECODE)
    # the fused kernel's configs, on the decode step as its graph replays it and as an eager step, and on the
    # served step with prompts
    graphed = [(bucket, 0, False), (bucket, 1, False)]
    assert fused == graphed + [(12, 0, True), (12, 1, True), (100, 0, True), (100, 1, True)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real sweep instead")
def test_tune_case_sweeps_the_few_adapters_decode_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """--tune-case "served decode few": the decode step over 5 adapters as its graph replays it (the few adapters'
    16-token tiles), q/k/v and o; every kind of candidate runs on that graph's tile table, the GEMV shrink and
    expand set together, and the config tables are restored after."""
    from perf import bench_kernels
    from slora.kernels.triton import lora_expand, lora_shrink

    shrink, expand = lora_shrink.MIXED, lora_expand.MIXED
    monkeypatch.setattr(bench_kernels, "DEVICE", torch.device("cpu"))
    # two candidates of each kind: the interpreter runs every one
    for name in ("few_shrink_variants", "mixed_expand_variants", "few_gemv_pairs"):
        full = getattr(bench_kernels, name)
        monkeypatch.setattr(bench_kernels, name, lambda full=full: full()[:2])
    results = bench_kernels.tune(True, None, bench_kernels.SERVED_DECODE_FEW)
    assert lora_shrink.MIXED is shrink and lora_expand.MIXED is expand
    kinds = {r["kernel"].split(" (")[0] for r in results}
    assert kinds == {"lora_shrink", "lora_expand", "lora_shrink+expand GEMV"}, kinds
    assert len(results) == 12 and all("5 adapters" in r["kernel"] for r in results), results
    assert {r["kernel"].endswith((" qkv)", " o)")) for r in results} == {True}, results
    ran = [r for r in results if "ms" in r]
    assert all(r["ms"] > 0 for r in ran)
    gemv = [r for r in results if r["kernel"].startswith("lora_shrink+expand GEMV")]
    assert gemv and all("error" not in r for r in gemv), gemv
    assert all("error" not in r for r in results if r["kernel"].startswith("lora_shrink ")), results
