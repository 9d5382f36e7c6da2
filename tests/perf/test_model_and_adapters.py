"""Generated model dirs and adapters are what the engine, PEFT and the word-level tokenizer expect."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from perf.make_adapters import SETTINGS, WEIGHTS_FILE
from perf.make_model import ids_to_text
from slora.backend.adapters.host_adapter import load_peft_adapter
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import ModelSpec


def test_llama2_7b_config_has_the_issue_shapes(tmp_path: Path) -> None:
    from perf.make_model import SHAPES, write_model_dir

    path = write_model_dir(SHAPES["llama2-7b"], tmp_path / "m", tokenizer=False)
    spec = ModelSpec.from_dir(path)
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.intermediate_size, spec.vocab_size) == (
        4096, 32, 32, 11008, 32000,
    )  # fmt: skip
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "float16"
    assert not (path / "tokenizer.json").exists()


def test_word_tokenizer_round_trips_exact_ids(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = [3, 17, 1023, 500, 2, 9]
    assert tokenizer.encode(ids_to_text(ids), add_special_tokens=True) == ids
    assert tokenizer.eos_token_id == 2


def test_adapters_share_weight_files_but_load_as_distinct_adapters(tiny_model: Path, tiny_adapters: Path) -> None:
    spec = ModelSpec.from_dir(tiny_model)
    geometry = PoolGeometry(spec.num_layers, 16, spec.num_kv_heads, spec.head_dim)
    s1 = [load_peft_adapter(f"s1-000{i}", tiny_adapters / f"s1-000{i}", spec, geometry, torch.float32) for i in
          range(3)]  # fmt: skip
    assert all(a.ranks == (8, 8, 8, 8, 0, 0, 0) for a in s1)
    assert not torch.equal(s1[0].image, s1[1].image)  # two distinct files ...
    assert torch.equal(s1[0].image, s1[2].image)  # ... shared round-robin
    assert os.stat(tiny_adapters / "s1-0000" / WEIGHTS_FILE).st_nlink > 1
    s2 = [load_peft_adapter(f"s2-000{i}", tiny_adapters / f"s2-000{i}", spec, geometry, torch.float32) for i in
          range(4)]  # fmt: skip
    assert [a.max_rank for a in s2] == list(SETTINGS["S2"].ranks)
    sall = load_peft_adapter("sall-0001", tiny_adapters / "sall-0001", spec, geometry, torch.float32)
    assert sall.ranks == (32,) * 7
    assert s1[0].image.abs().max() > 0 and torch.isfinite(s1[0].image).all()


def test_peft_loads_a_generated_adapter(tiny_model: Path, tiny_adapters: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig.from_pretrained(str(tiny_model))
    base = AutoModelForCausalLM.from_config(config)
    model = PeftModel.from_pretrained(base, str(tiny_adapters / "s2-0001"), adapter_name="s2-0001")
    model.load_adapter(str(tiny_adapters / "sall-0000"), adapter_name="sall-0000")
    model.set_adapter("sall-0000")
    inner: Any = model.base_model.model
    lora_b = inner.model.layers[0].mlp.down_proj.lora_B["sall-0000"].weight
    assert lora_b.shape == (64, 64) and lora_b.abs().sum() > 0
