"""Independent references: greedy decoding through Hugging Face's own modules, and a near-tie-aware comparison."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GreedyTrace:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 logit at each step


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> GreedyTrace:
    """Greedy tokens from the HF model with its own KV cache (EOS ignored), with each step's top-2 margin."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    past = None
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2).values
        margins.append(float(top[0] - top[1]))
        token = int(torch.argmax(logits))
        tokens.append(token)
        ids = torch.tensor([[token]], device=device)
    return GreedyTrace(tokens, margins)


def compare_greedy(got: list[int], ref: GreedyTrace, tie_margin: float) -> int:
    """Assert `got` equals the reference up to the first near tie; return how many tokens were compared.

    A difference is allowed only at a step where the reference's top-2 logits are within `tie_margin`; after
    it the sequences legitimately diverge and are not compared further.
    """
    assert len(got) == len(ref.tokens), f"length {len(got)} != reference {len(ref.tokens)}"
    for i, (a, b) in enumerate(zip(got, ref.tokens)):
        if ref.margins[i] < tie_margin:
            return i
        assert a == b, f"token {i}: got {a}, reference {b} (margin {ref.margins[i]:.4g}); got {got}, ref {ref.tokens}"
    return len(got)
