"""grid.png: the candidate/baseline ratio per concurrency, one panel per axis, with the spread of the reps.

The dot is the oriented median ratio (> 1 favours the candidate), the bar spans each candidate rep against the
baseline median (min..max), the colour is the separation (WIN green, LOSS red, NEUTRAL grey); the thin light bar
left of it spans the baseline's own reps against their median, so complete separation reads as two bars that do
not overlap. Rendering is
deterministic (Agg, fixed size and dpi, no PNG software/date metadata) so `vtcampaign render` rewrites the same bytes.
"""
from __future__ import annotations

import io

from campaigns.evidence import Evidence
from campaigns.stats import AXES, OPTIONAL_AXES, oriented_ratio, rep_ratios

COLORS = {"WIN": "#2e7d32", "LOSS": "#c62828", "NEUTRAL": "#757575"}


def grid_png(ev: Evidence) -> bytes:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = [a for a in AXES + OPTIONAL_AXES if any(s.axis == a.name for s in ev.stats)]
    cands = [a.name for a in ev.candidates]
    ncols = min(4, max(1, len(axes)))
    nrows = max(1, -(-len(axes) // ncols))
    fig, panels = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.6 * nrows), dpi=100, squeeze=False)
    for i, panel in enumerate(panels.flat):
        if i >= len(axes):
            panel.axis("off")
            continue
        axis = axes[i]
        concs = sorted({s.concurrency for s in ev.stats if s.axis == axis.name})
        for k, cand in enumerate(cands):
            # Candidates side by side around each concurrency tick.
            offset = (k - (len(cands) - 1) / 2) * 0.15
            for j, c in enumerate(concs):
                hit = [s for s in ev.stats if s.axis == axis.name and s.candidate == cand and s.concurrency == c]
                if not hit or hit[0].ratio is None:
                    continue
                s = hit[0]
                spread = rep_ratios(s) or [s.ratio]
                off_med = s.summary[s.baseline].median
                base = [r for v in s.reps[s.baseline]
                        if (r := oriented_ratio(v, off_med, s.higher_is_better)) is not None] or [1.0]
                panel.vlines(j + offset - 0.06, min(base), max(base), color="#bdbdbd", linewidth=2)
                colour = COLORS[s.separation]
                panel.vlines(j + offset, min(spread), max(spread), color=colour, linewidth=2)
                panel.plot(j + offset, s.ratio, "o", color=colour, markersize=5,
                           label=cand if j == 0 and len(cands) > 1 else None)
        panel.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        panel.set_xticks(range(len(concs)), [f"c{c}" for c in concs])
        panel.set_title(f"{axis.label} ({'higher' if axis.higher_is_better else 'lower'} is better)", fontsize=8)
        panel.tick_params(labelsize=7)
        if len(cands) > 1 and i == 0:
            panel.legend(fontsize=6)
    fig.suptitle(f"{ev.campaign_id}: ratio vs {ev.baseline.name} (> 1 favours the candidate)", fontsize=9)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.86, wspace=0.3, hspace=0.45)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()
