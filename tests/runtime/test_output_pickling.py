"""A RequestOutput crosses from the engine's process to the server's with every step: pickled as its fields."""

from __future__ import annotations

import dataclasses
import pickle

from slora.backend.engine.outputs import RequestOutput
from slora.backend.errors import EngineOverloadedError
from slora.backend.runtime.messages import OutputsMsg
from slora.backend.runtime.output_pump import portable


def test_every_field_survives_the_pipe() -> None:
    """Each field set to a value unlike its default, so that a field left out of the pickled state shows."""
    output = RequestOutput("r-7", [5, 6], text="hi", finished=True, finish_reason="error", num_prompt_tokens=3,
                           num_output_tokens=2, error="boom", exception=EngineOverloadedError("full"))  # fmt: skip
    defaults = RequestOutput("x", [])
    assert all(getattr(output, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(RequestOutput))
    (back,) = pickle.loads(pickle.dumps(OutputsMsg([portable(output)], None))).outputs
    for f in dataclasses.fields(RequestOutput):
        if f.name != "exception":
            assert getattr(back, f.name) == getattr(output, f.name), f.name
    assert isinstance(back.exception, EngineOverloadedError) and str(back.exception) == "full"
    assert pickle.loads(pickle.dumps(RequestOutput("r", [1]))) == RequestOutput("r", [1])
