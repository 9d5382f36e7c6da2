"""The names genai-perf imports from plotly.graph_objects (see __init__.py)."""

from plotly import Unavailable

Figure = Box = Scatter = Histogram2d = Unavailable
