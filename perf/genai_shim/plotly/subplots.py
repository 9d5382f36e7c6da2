"""plotly.subplots.make_subplots for genai-perf's imports (see __init__.py)."""

from plotly import MESSAGE


def make_subplots(*args: object, **kwargs: object) -> None:
    raise RuntimeError(MESSAGE)
