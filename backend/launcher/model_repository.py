"""Render the model repository: copy the templates (model_repository/) and append each model's parameters.

The templates are complete Triton configs without parameters; slora-serve appends, per model,

    parameters { key: "model" value: { string_value: "/path/to/checkpoint" } }

for the engine and serving options of `slora` (the ensemble is an alias of it and takes none). Templates are found at
$SLORA_MODEL_REPOSITORY, else next to the package sources (a source checkout or an editable install).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import slora

MODELS = ("slora", "ensemble")


def template_dir() -> Path:
    configured = os.environ.get("SLORA_MODEL_REPOSITORY")
    candidates = [Path(configured)] if configured else []
    candidates.append(Path(slora.__file__).resolve().parent.parent / "model_repository")
    for path in candidates:
        if all((path / model / "config.pbtxt").is_file() for model in MODELS):
            return path
    raise FileNotFoundError(
        f"the model repository templates are not at {', '.join(map(str, candidates))}: set SLORA_MODEL_REPOSITORY "
        "to the model_repository/ folder of the slora-triton sources"
    )


def render_repository(target: Path, parameters: dict[str, dict[str, str]], template: Path | None = None) -> Path:
    """Copy the templates to `target` (replacing it) and append `parameters[model]` to each model's config."""
    source = template or template_dir()
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for model, values in parameters.items():
        render_model(target, model, values, source)
    return target


def render_model(target: Path, model: str, values: dict[str, str], template: Path | None = None) -> None:
    """Write `model`'s config.pbtxt in the rendered repository `target` again: the template's, then `values`
    (slora-serve does this before it loads a model again with other parameters)."""
    source = (template or template_dir()) / model / "config.pbtxt"
    config = target / model / "config.pbtxt"
    if not source.is_file() or not config.parent.is_dir():
        raise FileNotFoundError(f"{config}: no such model in the repository template {source.parent.parent}")
    lines = [source.read_text(), "\n# Rendered by slora-serve\n"]
    lines += [pbtxt_parameter(key, value) + "\n" for key, value in values.items()]
    staged = config.with_name(".config.pbtxt.tmp")
    staged.write_text("".join(lines))
    staged.replace(config)


def pbtxt_parameter(key: str, value: str) -> str:
    return f'parameters {{ key: "{_escape(key)}" value: {{ string_value: "{_escape(value)}" }} }}'


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
