"""Import stand-in for plotly, for genai-perf on hosts without it (the H200 host: no registry, and plotly's 9.7 MB
wheel does not fit beside the server bundle in what a device call can carry).

genai-perf 0.0.16 imports plotly when it starts but draws with it only under --generate-plots, which
perf/genai_perf.sh never passes; that script puts this folder on PYTHONPATH only when `import plotly` fails. Any
use raises an error that says so.
"""

MESSAGE = "plotly is not installed: perf/genai_shim stands in for genai-perf's imports only (no --generate-plots)"


class Unavailable:
    """Every plotly object genai-perf names: making one raises."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(MESSAGE)
