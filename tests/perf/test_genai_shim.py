"""perf/genai_shim stands in for plotly's imports in genai-perf (perf/genai_perf.sh) and refuses any real use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parents[2] / "perf" / "genai_shim"

# What genai-perf 0.0.16's plots modules import, then one use of each.
PROBE = """
import plotly.graph_objects as go
from plotly.graph_objects import Figure
from plotly.subplots import make_subplots
import plotly
assert plotly.__file__.startswith({shim!r}), plotly.__file__
for make in (go.Figure, go.Box, go.Scatter, go.Histogram2d, Figure, make_subplots):
    try:
        make()
    except RuntimeError as error:
        assert "plotly is not installed" in str(error), error
    else:
        raise AssertionError(make)
print("refused")
"""


def test_shim_imports_and_refuses_use() -> None:
    run = subprocess.run([sys.executable, "-c", PROBE.format(shim=str(SHIM))], env={"PYTHONPATH": str(SHIM)},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "refused"
