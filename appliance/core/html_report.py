"""Self-contained HTML reports (inline SVG charts, no scripts, no CDN) next to their JSON twins."""

from __future__ import annotations

import html

PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")


def bars_svg(title: str, unit: str, values: list[tuple[str, float]], fmt: str) -> str:
    """Horizontal bars, one per (label, value)."""
    top = max((v for _, v in values), default=0) or 1.0
    rows = []
    for i, (label, value) in enumerate(values):
        y, width = 30 + i * 34, 300 * value / top
        rows.append(f'<text x="0" y="{y + 17}" font-size="13">{html.escape(label[:14])}</text>'
                    f'<rect x="110" y="{y}" width="{width:.1f}" height="24" fill="{PALETTE[i % len(PALETTE)]}"/>'
                    f'<text x="{115 + width:.1f}" y="{y + 17}" font-size="13">{fmt.format(value)} {unit}</text>')
    return (f'<svg class="bars" xmlns="http://www.w3.org/2000/svg" width="560" height="{40 + 34 * len(values)}" role="img">'
            f'<text x="0" y="16" font-size="14" font-weight="bold">{html.escape(title)}</text>{"".join(rows)}</svg>')


def columns_svg(title: str, values: list[float], limit: float | None = None, color: str = PALETTE[0]) -> str:
    """One column per sample (e.g. max |difference| per sample) on a log scale, since differences
    of 1e-8 and a limit of 1e-4 must both be visible, with the allowed limit as a red line.

    A log scale cannot draw 0: when every value is 0 there is no chart, only a line saying so."""
    import math

    n, zeros = len(values), sum(1 for v in values if v <= 0)
    if zeros == n:
        return (f'<p class="identical"><b>{html.escape(title)}</b>: identical on all {n} samples '
                "(every difference is 0).</p>")
    positive = [v for v in [*values, limit or 0.0] if v > 0]
    top = max(positive)
    floor = min(min(positive) / 10, top / 10)
    span = math.log10(top) - math.log10(floor)

    def frac(v: float) -> float:
        return (math.log10(max(v, floor)) - math.log10(floor)) / span

    # The plot ends 110 px before the right edge: the limit's label sits there, clear of the columns.
    width, height, left, right = 680, 160, 50, 570
    step = (right - left) / n
    cols = "".join(f'<rect class="column" x="{left + i * step:.1f}" y="{30 + height * (1 - frac(v)):.1f}" '
                   f'width="{max(step - 1, 1):.1f}" height="{height * frac(v) if v > 0 else 0:.1f}" fill="{color}">'
                   f'<title>sample {i}: {v:.3g}</title></rect>'
                   for i, v in enumerate(values))
    line, above = "", 0
    if limit:
        above = sum(1 for v in values if v > limit)
        y = 30 + height * (1 - frac(limit))
        line = (f'<line x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#cf222e" stroke-dasharray="4"/>'
                f'<text class="limit" x="{right + 4}" y="{y + 4:.1f}" font-size="11" fill="#cf222e">'
                f'allowed {limit:.3g}</text>')
    counts = [f"{n} samples"]
    if zeros:
        counts.append(f"{zeros} identical (difference 0, no column)")
    if limit:
        counts.append(f"{above} above the allowed {limit:.3g}")
    return (f'<svg class="columns" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 50}" role="img">'
            f'<text x="0" y="16" font-size="14" font-weight="bold">{html.escape(title)} (log scale)</text>'
            f'<text x="45" y="36" font-size="11" text-anchor="end">{top:.0e}</text>'
            f'<text x="45" y="{30 + height}" font-size="11" text-anchor="end">{floor:.0e}</text>{cols}{line}</svg>'
            f'<p class="counts">{"; ".join(counts)}.</p>')


def page(title: str, made_by: str, json_name: str, verdict: bool | None, body: str, style: str = "") -> str:
    """The one page frame of every report: title, verdict, the body, and where its JSON twin is.
    style: extra CSS (e.g. right-aligned number columns)."""
    status = "" if verdict is None else f': <span class="{"PASS" if verdict else "FAIL"}">{"PASS" if verdict else "FAIL"}</span>'
    return f"""<!DOCTYPE html>
<!-- made by {html.escape(made_by)}; data in {html.escape(json_name)} -->
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:60em}}td,th{{padding:.2em .8em;text-align:left}}
.PASS{{color:#1a7f37}}.FAIL{{color:#cf222e}}svg{{display:block;margin:1em 0}}{style}</style></head><body>
<h1>{html.escape(title)}{status}</h1>
{body}
<p><small>Made by {html.escape(made_by)}; the same figures are in {html.escape(json_name)}.</small></p>
</body></html>
"""
