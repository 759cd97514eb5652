"""Token sampling: greedy through the backend's argmax; temperature / top-k / top-p with a per-request generator.

A seeded request draws from its own ``torch.Generator``, so its tokens do not depend on which other requests share
its batch (batch invariance holds for sampled requests too, not only greedy ones). Sampling uses the exponential
race (argmax of p / E with E ~ Exp(1)), which equals drawing from p.
"""
from __future__ import annotations

import torch

from vtengine.engine.sequence import Sequence


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] fp32 -> logits with the tokens outside top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


class Sampler:
    def __init__(self, backend):
        self.backend = backend

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], generators: dict[int, torch.Generator]) -> list[int]:
        out = [0] * len(seqs)
        greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
        if greedy_rows:
            rows = logits if len(greedy_rows) == len(seqs) else logits[greedy_rows]
            for i, tok in zip(greedy_rows, self.backend.greedy(rows).tolist()):
                out[i] = int(tok)
        for i, seq in enumerate(seqs):
            if seq.params.greedy:
                continue
            p = seq.params
            row = apply_top_k_top_p(logits[i].float() / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            race = torch.empty_like(probs).exponential_(generator=generators[seq.seq_id])
            out[i] = int(torch.argmax(probs / race))
        return out
