"""slora-triton: many LoRA adapters over one base LLM, served through NVIDIA Triton (S-LoRA).

The subpackages live at the top of the repository (backend/, kernels/, client/) and are installed as
slora.backend, slora.kernels, slora.client. When this file is imported from a source checkout (editable install,
a Triton python-backend stub with the checkout on PYTHONPATH, or the checkout as the working directory), the
checkout's root is added to the package path so that those imports resolve without any import hook.
"""

from pathlib import Path

__version__ = "0.1.0"

_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "backend" / "__init__.py").is_file() and not (Path(__file__).parent / "backend").exists():
    __path__.append(str(_checkout))
