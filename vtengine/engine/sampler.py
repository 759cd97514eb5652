"""Token sampling: greedy through the backend's argmax; temperature / top-k / top-p with a per-request generator.

A seeded request draws from its own ``torch.Generator``, so its tokens do not depend on which other requests share
its batch (batch invariance holds for sampled requests too, not only greedy ones). Sampling uses the exponential
race (argmax of p / E with E ~ Exp(1)), which equals drawing from p.
"""
from __future__ import annotations

import torch

from vtengine.engine.sequence import Sequence
from vtengine.engine.transfer import to_device


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
        # scattered back to vocabulary order as a mask: a boolean index would wait for the device to size it
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, backend):
        self.backend = backend

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], generators: dict[int, torch.Generator]
               ) -> torch.Tensor:
        """The next token of every sequence, as an int64 tensor on the logits' device (no host sync)."""
        greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
        if len(greedy_rows) == len(seqs):
            return self.backend.greedy(logits)          # a fresh int64 [B]: no buffer and no copy into one
        out = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        if greedy_rows:
            idx = to_device(greedy_rows, torch.int64, logits.device)
            out[idx] = self.backend.greedy(logits[idx]).to(torch.int64)
        for i, seq in enumerate(seqs):
            if seq.params.greedy:
                continue
            p = seq.params
            row = apply_top_k_top_p(logits[i].float() / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            race = torch.empty_like(probs).exponential_(generator=generators[seq.seq_id])
            out[i] = torch.argmax(probs / race)
        return out

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], generators: dict[int, torch.Generator]) -> list[int]:
        return self.sample(logits, seqs, generators).tolist()
