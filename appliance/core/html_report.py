"""Self-contained HTML reports (inline SVG charts, no scripts, no CDN) next to their JSON twins."""

from __future__ import annotations

import html

PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")


# Text is measured by its characters: an SVG cannot wrap or shrink a label to fit, so the chart is sized
# to its longest label instead (CHAR_EM is a generous sans-serif width: capitals and digits, in font
# sizes). MAX_WIDTH keeps a chart inside the page frame below (60em at 16 px = 960 px, less margins) at
# 1,280 px; a label too long for a column beside its bar goes on lines of its own above it.
CHAR_EM = 0.62
MAX_WIDTH = 900
BAR_SPAN = 300  # px of the longest bar
BOLD = ' font-weight="bold"'
TICK = ' class="tick"'  # a bar's label (tests read them)


def text_px(text: str, font: float) -> float:
    return len(text) * font * CHAR_EM


def wrapped(text: str, font: float, width: float) -> list[str]:
    """text on lines of at most width px, broken after a space, '/', '.', '_' or '-' where it can, else anywhere."""
    per_line = max(int(width / (font * CHAR_EM)), 8)
    lines = []
    while len(text) > per_line:
        cut = max(text.rfind(c, 0, per_line) for c in " /._-")
        cut = cut + 1 if cut >= per_line // 2 else per_line
        lines.append(text[:cut].rstrip())
        text = text[cut:].lstrip()
    return [*lines, text]


def _text_lines(lines: list[str], x: float, y: float, font: float, step: float, extra: str = "") -> str:
    """One <text> per line; extra: attributes added to each (a class, a weight)."""
    return "".join(f'<text x="{x:.1f}" y="{y + i * step:.1f}" font-size="{font:g}"{extra}>{html.escape(line)}</text>'
                   for i, line in enumerate(lines))


def bars_svg(title: str, unit: str, values: list[tuple[str, float]], fmt: str, *, font: float = 13,
             bar: float = 24, cls: str = "bars", svg_id: str | None = None) -> str:
    """Horizontal bars, one per (label, value), every label and value whole: the label column is as wide
    as the longest label, or, past MAX_WIDTH, each label sits on its own lines above its bar. A negative
    value draws no bar."""
    top = max((abs(v) for _, v in values), default=0) or 1.0
    shown = [f"{fmt.format(v)} {unit}" for _, v in values]
    value_w = max((text_px(t, font) for t in shown), default=0) + 10
    label_w = max((text_px(label, font) for label, _ in values), default=0) + 10
    beside = label_w + BAR_SPAN + value_w <= MAX_WIDTH
    title_lines = wrapped(title, 14, MAX_WIDTH)
    y, rows, widest = 16 + 18 * len(title_lines) - 4, [], 0.0
    for i, ((label, value), value_text) in enumerate(zip(values, shown)):
        length = BAR_SPAN * max(value, 0) / top
        if beside:
            x = label_w
            rows.append(_text_lines([label], 0, y + bar * 0.7, font, 0, TICK))
        else:
            lines = wrapped(label, font, MAX_WIDTH)
            rows.append(_text_lines(lines, 0, y + font, font, font * 1.25, TICK))
            y, x = y + font * 1.25 * len(lines) + 2, 0
        rows.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{length:.1f}" height="{bar:g}" fill="{PALETTE[i % len(PALETTE)]}"/>'
                    + _text_lines([value_text], x + length + 5, y + bar * 0.7, font, 0))
        widest = max(widest, x + length + 5 + value_w)
        y += bar + 10
    width = min(max(widest, *(text_px(t, 14) for t in title_lines), label_w if beside else 0) + 4, MAX_WIDTH)
    named = f' id="{html.escape(svg_id)}"' if svg_id else ""
    return (f'<svg{named} class="{cls}" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y + 6:.0f}" role="img">'
            f'{_text_lines(title_lines, 0, 16, 14, 18, BOLD)}'
            f'{"".join(rows)}</svg>')


def table_html(head: list[str], rows: list[list], numeric_from: int = 1) -> str:
    """An HTML table (every report's tables are tables, never Markdown in a <pre>); columns from
    numeric_from on are right-aligned."""
    def cell(tag: str, i: int, value) -> str:
        align = ' style="text-align:right"' if i >= numeric_from else ""
        return f"<{tag}{align}>{html.escape(str(value))}</{tag}>"
    return ("<table><tr>" + "".join(cell("th", i, h) for i, h in enumerate(head)) + "</tr>"
            + "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>" for row in rows)
            + "</table>")


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
