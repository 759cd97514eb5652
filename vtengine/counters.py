"""Always-on kernel counters: which route each routed kernel took, its launch grid, its compiled variant.

Cheap by design (a dict increment per launch, no device sync). The mechanism gate and ``/metrics`` read them.
Keys are (kernel, route); each entry keeps the launch count, a histogram of grids, of split counts and of
compiled variants (the constexpr tuple that selects a binary).
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_lock = threading.Lock()


@dataclass
class RouteStats:
    launches: int = 0
    grids: Counter = field(default_factory=Counter)
    splits: Counter = field(default_factory=Counter)
    variants: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {
            "launches": self.launches,
            "grids": {"x".join(map(str, g)): n for g, n in self.grids.items()},
            "splits": {str(s): n for s, n in self.splits.items()},
            "variants": {str(v): n for v, n in self.variants.items()},
        }


_stats: dict[tuple[str, str], RouteStats] = {}


def record(kernel: str, route: str, grid: tuple = (), splits: int | None = None, variant: Any = None) -> None:
    """Record one launch of ``kernel`` through ``route`` (e.g. ('decode_attention', 'gqa_swap'))."""
    with _lock:
        st = _stats.get((kernel, route))
        if st is None:
            st = _stats[(kernel, route)] = RouteStats()
        st.launches += 1
        if grid:
            st.grids[tuple(int(g) for g in grid)] += 1
        if splits is not None:
            st.splits[int(splits)] += 1
        if variant is not None:
            st.variants[variant] += 1


def reset() -> None:
    with _lock:
        _stats.clear()


def snapshot() -> dict[str, dict[str, dict[str, Any]]]:
    """{kernel: {route: {launches, grids, splits, variants}}}: a JSON-ready copy."""
    with _lock:
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for (kernel, route), st in sorted(_stats.items()):
            out.setdefault(kernel, {})[route] = st.to_dict()
        return out


def launches(kernel: str, route: str | None = None) -> int:
    with _lock:
        return sum(st.launches for (k, r), st in _stats.items() if k == kernel and (route is None or r == route))
