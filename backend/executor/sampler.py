"""Pick the next token of each request from its logits: greedy, or temperature → top-k → top-p → draw.

Each sampled request draws from its own torch.Generator (seeded from its `seed` when given), so its tokens do
not depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from slora.backend.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [num_seqs, vocab] float32 → one token id per row."""
    return [int(t) for t in sample_on_device(logits, params, generators).tolist()]


def sample_on_device(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """The tokens (int64 [num_seqs], on the logits' device) without waiting for them: nothing here reads the
    device, so the host can go on to the next step while the GPU samples."""
    tokens = torch.argmax(logits, dim=-1)
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = filtered_probs(logits[row], p)
            tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (vLLM's order); logits: [vocab]."""
    scaled = logits.float() / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= p.top_p  # masked in sorted order, then put back: no host sync (as order[drop] has)
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.softmax(scaled, dim=-1)
