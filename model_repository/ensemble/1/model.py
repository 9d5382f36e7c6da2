"""Triton entry point of `ensemble` (an alias of `slora`, a peer of its engine); the code is in the slora package.

The Python backend's stub does not process .pth files of the folders on PYTHONPATH, so an editable install of
slora (a .pth import hook) is invisible to it: re-add those folders as site dirs. slora-serve lists them in
SLORA_SITE_DIRS; in a container with a regular install this finds nothing to do.
"""

import os
import site
import sys

# The stub ignores PYTHONPATH: folders meant to come first for it alone (a NumPy 1, see stub_compat.py) go here,
# before anything imports NumPy.
sys.path[:0] = [d for d in os.environ.get("SLORA_STUB_PYTHONPATH", "").split(os.pathsep) if d and d not in sys.path]
for _dir in [d for d in os.environ.get("SLORA_SITE_DIRS", "").split(os.pathsep) if d] + [
    d for d in list(sys.path) if d.endswith(("site-packages", "dist-packages"))
]:
    site.addsitedir(_dir)

from slora.backend.serving.triton.alias_model import TritonPythonModel  # noqa: E402,F401
