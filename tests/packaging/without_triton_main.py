"""What a process without the triton package can do (run by test_without_triton.py in the blocked environment).

python -m tests.packaging.without_triton_main imports
    every module of slora.backend, slora.kernels (but its Triton-language kernels) and slora.client, imported:
    prints {"failed": {module: {"missing": the module not found or null, "error": ...}}} for those that failed
python -m tests.packaging.without_triton_main generate JOB.json
    greedy tokens of LLMEngine(EngineConfig.from_dict(job["config"])) for job["prompts"] / job["adapters"], and
    what kernel_backend=triton says: prints {"tokens": [...], "triton_error": "...", "triton_loaded": bool}
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("slora.backend", "slora.kernels", "slora.client")
KERNELS = "slora.kernels.triton."  # the Triton-language kernels, imported only where they are used; but these:
TRITON_FREE_KERNEL_HELPERS = {
    "slora.kernels.triton.interpreter",
    "slora.kernels.triton.launch",
    "slora.kernels.triton.pdl",
}


def module_names() -> list[str]:
    """Every module of PACKAGES but the Triton-language kernels."""
    names = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        names.append(package)
        names += [info.name for info in pkgutil.walk_packages(module.__path__, package + ".")]
    return [name for name in names if not name.startswith(KERNELS) or name in TRITON_FREE_KERNEL_HELPERS]


def import_all() -> dict[str, Any]:
    failed = {}
    for name in module_names():
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, whatever it is
            missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
            failed[name] = {"missing": missing, "error": repr(exc)}
    return {"failed": failed, "modules": len(module_names()), "triton_loaded": "triton" in sys.modules}


def generate(job_file: Path) -> dict[str, Any]:
    from slora.backend.config import EngineConfig
    from slora.backend.engine.llm_engine import LLMEngine
    from slora.backend.engine.sampling_params import SamplingParams

    job = json.loads(job_file.read_text())
    engine = LLMEngine(EngineConfig.from_dict(job["config"]))
    greedy = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    done = engine.generate(job["prompts"], job["adapters"], greedy)
    engine.check_idle_integrity()
    return {"tokens": [c.token_ids for c in done], "ops": engine.model.ops.name,
            "triton_error": triton_error(job["config"]), "triton_loaded": "triton" in sys.modules}  # fmt: skip


def triton_error(config: dict[str, Any]) -> str:
    """What an engine asked for kernel_backend=triton says (on CPU: under TRITON_INTERPRET=1, set by the test)."""
    from slora.backend.config import EngineConfig
    from slora.backend.engine.llm_engine import LLMEngine

    try:
        LLMEngine(EngineConfig.from_dict({**config, "kernel_backend": "triton"}))
    except ValueError as exc:
        return str(exc)
    return ""


def main(argv: list[str]) -> int:
    result = import_all() if argv[0] == "imports" else generate(Path(argv[1]))
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
