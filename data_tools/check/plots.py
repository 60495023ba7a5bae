"""Inline SVG plots for the HTML report: no plotting library, no CDN, readable offline."""

from __future__ import annotations

from html import escape

from appliance.core.html_report import bars_svg

WIDTH, HEIGHT = 560, 220
PAD_LEFT, PAD_BOTTOM, PAD_TOP = 48, 40, 32


MAX_LABELLED_BARS = 40  # past it, vertical bars with no labels (each in its bar's tooltip)


def bar_chart(labels: list[str], counts: list[int], title: str, plot_id: str) -> str:
    """Vertical bars, one per label, with counts on top; where a label does not fit under its bar,
    horizontal bars with every label whole (the reports' shared bars_svg)."""
    n = max(len(counts), 1)
    top = max(counts, default=0) or 1
    inner_w, inner_h = WIDTH - PAD_LEFT - 10, HEIGHT - PAD_BOTTOM - PAD_TOP
    bar_w = inner_w / n
    if n <= MAX_LABELLED_BARS and any(_fit(label, bar_w) != label for label in labels):
        return bars_svg(title, "", list(zip(labels, counts)), "{}", font=10, bar=max(24 - n // 2, 10),
                        cls="plot bar-chart", svg_id=plot_id)
    parts = [_open(plot_id, title, "bar-chart")]
    for i, (label, count) in enumerate(zip(labels, counts)):
        h = inner_h * count / top
        x = PAD_LEFT + i * bar_w
        y = PAD_TOP + inner_h - h
        parts.append(f'<rect class="bar" x="{x + 1:.1f}" y="{y:.1f}" width="{max(bar_w - 2, 1):.1f}" '
                     f'height="{h:.1f}" fill="#4a7ab5"><title>{escape(label)}: {count}</title></rect>')
        if n <= 40:
            if len(str(count)) * 6 <= bar_w:  # a count wider than its bar would run into the next one
                parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{y - 3:.1f}" font-size="10" '
                             f'text-anchor="middle">{count}</text>')
            parts.append(f'<text class="tick" x="{x + bar_w / 2:.1f}" y="{HEIGHT - PAD_BOTTOM + 14}" font-size="10" '
                         f'text-anchor="middle">{escape(_fit(label, bar_w))}</text>')
    parts.append(_axes())
    parts.append("</svg>")
    return "".join(parts)


def histogram(counts: list[int], edges: list[float], bounds: dict, title: str, plot_id: str) -> str:
    """A histogram with the 3-sigma bounds (red, dashed) and the median/MAD bounds (orange) drawn."""
    lo, hi = edges[0], edges[-1]
    for key in ("sigma_low", "sigma_high", "mad_low", "mad_high"):
        lo, hi = min(lo, bounds[key]), max(hi, bounds[key])
    span = (hi - lo) or 1.0
    inner_w, inner_h = WIDTH - PAD_LEFT - 10, HEIGHT - PAD_BOTTOM - PAD_TOP
    top = max(counts, default=0) or 1

    def sx(v: float) -> float:
        return PAD_LEFT + inner_w * (v - lo) / span

    parts = [_open(plot_id, title, "histogram")]
    for count, a, b in zip(counts, edges[:-1], edges[1:]):
        h = max(inner_h * count / top, 2.0 if count else 0.0)  # one outlier in a bin stays visible
        parts.append(f'<rect class="bin" x="{sx(a):.1f}" y="{PAD_TOP + inner_h - h:.1f}" '
                     f'width="{max(sx(b) - sx(a), 0.5):.1f}" height="{h:.1f}" fill="#6c9a5c">'
                     f'<title>{a:.4g}..{b:.4g}: {count}</title></rect>')
    for key, colour, dash in (("sigma_low", "#c0392b", "6,3"), ("sigma_high", "#c0392b", "6,3"),
                              ("mad_low", "#e67e22", "2,2"), ("mad_high", "#e67e22", "2,2")):
        x = sx(bounds[key])
        parts.append(f'<line class="bound {key}" x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_TOP}" '
                     f'y2="{PAD_TOP + inner_h}" stroke="{colour}" stroke-width="1.5" stroke-dasharray="{dash}">'
                     f'<title>{key} = {bounds[key]:.4g}</title></line>')
    # The end ticks are anchored inwards so that their labels stay inside the plot.
    for v, anchor in ((lo, "start"), ((lo + hi) / 2, "middle"), (hi, "end")):
        parts.append(f'<text class="tick" x="{sx(v):.1f}" y="{HEIGHT - PAD_BOTTOM + 14}" font-size="10" '
                     f'text-anchor="{anchor}">{v:.4g}</text>')
    parts.append(_axes())
    parts.append("</svg>")
    return "".join(parts)


def _fit(label: str, width: float) -> str:
    """The label cut to what fits under a bar (about 6 px a character at font size 10); the bar's title has it all."""
    room = max(int(width // 6), 1)
    return label if len(label) <= room else label[:max(room - 1, 1)] + "\u2026"


def _open(plot_id: str, title: str, kind: str) -> str:
    return (f'<svg id="{escape(plot_id)}" class="plot {kind}" xmlns="http://www.w3.org/2000/svg" '
            f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
            f'aria-label="{escape(title)}"><text x="{PAD_LEFT}" y="14" font-size="12" '
            f'font-weight="bold">{escape(title)}</text>')


def _axes() -> str:
    y = HEIGHT - PAD_BOTTOM
    return (f'<line x1="{PAD_LEFT}" x2="{WIDTH - 10}" y1="{y}" y2="{y}" stroke="#333"/>'
            f'<line x1="{PAD_LEFT}" x2="{PAD_LEFT}" y1="{PAD_TOP}" y2="{y}" stroke="#333"/>')
