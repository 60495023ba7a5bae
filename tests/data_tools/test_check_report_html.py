"""report.html rendered in headless Chromium: the plots and thumbnails are in the rendered page."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from check_datasets import make_planted
from data_tools.check.run import run_check

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def _chromium(tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    # unshare -n: the page must render with no network (no CDN, nothing fetched).
    cmd = ["unshare", "-n", CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--no-first-run", f"--user-data-dir={tmp_path / 'chromium-profile'}", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_report_renders_with_plots_offline(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is required for the report test (installer/bootstrap.sh --system)")
    planted = make_planted(tmp_path / "data", per_class=12, minority=2)
    out = tmp_path / "out"
    run_check([(str(planted.train), "train"), (str(planted.val), "val")], out, progress=False,
              fail_on="imbalance>3")
    html = (out / "report.html").read_text()
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in html

    url = (out / "report.html").as_uri()
    dom = _chromium(tmp_path, url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    rendered = dom.stdout
    assert re.search(r'<svg id="plot-label-balance"[^>]*class="plot bar-chart"', rendered)
    assert len(re.findall(r'<rect class="bar"', rendered)) == 5  # one bar per class
    assert ">0 cat</text>" in rendered and ">4 eel</text>" in rendered
    for stat in ("width", "height", "brightness", "contrast", "aspect", "encoded_size"):
        assert f'id="plot-stat-{stat}"' in rendered, stat
    assert rendered.count('class="bound sigma_low"') == 6 and rendered.count('class="bound mad_high"') == 6
    outliers = re.search(r"<div class=\"thumbs\" id=\"outliers\">(.*?)</div>\s*<h2>", rendered, re.S).group(1)
    assert "data:image/png;base64," in outliers
    groups = re.search(r'<div id="duplicate-groups">(.*)', rendered, re.S).group(1)
    assert groups.count("data:image/png;base64,") >= 6  # exact copies, leaked copies, near copies
    assert "Gate: <span class=\"fail\">FAILED</span>" in rendered

    shot = tmp_path / "report.png"
    proc = _chromium(tmp_path, url, f"--screenshot={shot}", "--window-size=1280,2600")
    assert proc.returncode == 0 and shot.stat().st_size > 20_000, proc.stderr[-2000:]
    ARTIFACTS.mkdir(exist_ok=True)
    kept = ARTIFACTS / "data-check-report.png"
    shutil.copy(shot, kept)
    print(f"report screenshot: {kept}")
