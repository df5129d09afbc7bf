"""report.html of a real `ddiloco local` run, opened in a real browser (headless Chromium).

pytest tests/e2e/test_report_html.py      # needs the Debian package chromium (tests/run.sh)

The page is written by the run itself; Chromium loads it from file://, dumps the DOM it built
and takes a screenshot. The DOM must hold the run's numbers from report.json, every learner and
every section; the screenshot must show the charts (the timeline's "computing" colour).
"""

from __future__ import annotations

import copy
import html
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ddiloco.local.report_html import write_html

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

SECTIONS = ("headline", "loss", "timeline", "goodput", "bandwidth", "chaos", "config")


def chromium() -> str:
    for name in (os.environ.get("DDILOCO_CHROMIUM", ""), "chromium", "chromium-browser"):
        if name and (path := shutil.which(name)):
            return path
    pytest.fail(
        "headless Chromium not found: install the Debian package `chromium` "
        "(tests/run.sh does) or point DDILOCO_CHROMIUM at the binary"
    )


def browse(page: Path, tmp: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    cmd += [f"--user-data-dir={tmp / 'profile'}", "--window-size=1400,2600", *flags]
    done = subprocess.run(
        [*cmd, page.resolve().as_uri()], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def stat_value(dom: str, key: str) -> str:
    m = re.search(rf'id="stat-{key}".*?<div class="value">(.*?)</div>', dom, re.S)
    assert m, f"stat-{key} missing from the page"
    return html.unescape(m.group(1))


def section(dom: str, name: str) -> str:
    m = re.search(rf'<section id="{name}">(.*?)</section>', dom, re.S)
    assert m, f"section {name} missing"
    return m.group(1)


def test_report_html_renders_the_runs_numbers_in_chromium(reported_run, tmp_path: Path) -> None:
    r, page = reported_run.report, reported_run.out / "report.html"
    raw = page.read_text()
    # self-contained: nothing fetched, nothing run
    assert "<script" not in raw and "@import" not in raw and "url(" not in raw
    assert not re.search(r'(src|href)="(https?:)?//', raw)

    dom = browse(page, tmp_path, "--dump-dom").stdout
    assert stat_value(dom, "goodput") == f"{r['goodput']:.3f}"
    assert stat_value(dom, "merged-work") == f"{r['merged_work_ratio']:.3f}"
    loss = f"{r['eval_loss_initial']:.3f} -> {r['eval_loss_final']:.3f}"
    assert stat_value(dom, "eval-loss") == loss
    tokens = f"{r['tokens_computed']:,} / {r['tokens_merged']:,}"
    assert stat_value(dom, "tokens") == tokens
    assert stat_value(dom, "merges") == f"{r['merges']} ({r['global_version']})"
    assert stat_value(dom, "chaos") == str(len(r["chaos_applied"])) and r["chaos_applied"]
    assert stat_value(dom, "bytes") == f"{r['bytes_up']:,} / {r['bytes_down']:,}"
    for name in SECTIONS:
        assert f'id="{name}"' in dom, name
    # every learner in the timeline (its row label) and in the table, with its own numbers
    timeline, table = section(dom, "timeline"), section(dom, "timeline").split("<table", 1)[1]
    for learner in r["learners"]:
        assert f">{learner['id']}</text>" in timeline, learner["id"]
        row = re.search(rf"<tr><td>{re.escape(learner['id'])}</td>(.*?)</tr>", table)
        assert row and f"<td>{learner['goodput']:.3f}</td>" in row.group(1)
        assert f"<td>{learner['contributions']}</td>" in row.group(1)
    # the chaos the run applied: each event in the table, kills as triangles on the timeline
    events = section(dom, "chaos")
    for e in r["chaos_applied"]:
        assert f"<td>{e['action']}</td><td>{e['target']}</td>" in events
    kills = sum(len(x["kill_times"]) for x in r["learners"])
    assert kills >= 1 and timeline.count("killed at") == kills
    assert timeline.count("merged by") == sum(len(x["merged_at"]) for x in r["learners"]) > 0
    # loss: the eval curve plus one training curve per learner; goodput and bytes are drawn
    assert section(dom, "loss").count("<polyline") == 1 + len(r["learners"])
    assert section(dom, "goodput").count("<polyline") == 2
    assert section(dom, "bandwidth").count("<polyline") == 4

    shot = tmp_path / "report.png"
    browse(page, tmp_path, f"--screenshot={shot}")
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]  # floats in [0, 1]
    assert pixels.shape[0] >= 2000 and pixels.shape[1] >= 1300, pixels.shape
    non_white = (pixels < 0.94).any(axis=-1).mean()
    assert 0.03 < non_white < 0.8, f"screenshot looks blank or broken: {non_white:.3f} non-white"
    assert pixels.std() > 0.05
    teal = (abs(pixels - [0x2A / 255, 0x9D / 255, 0x8F / 255]) < 0.03).all(axis=-1).sum()
    assert teal > 2000, f"the timeline's computing bars are not on the screenshot ({teal} px)"


def test_strings_from_the_run_are_escaped(reported_run, tmp_path: Path) -> None:
    r = copy.deepcopy(reported_run.report)
    evil = '<b id="x">l&0</b>"\''
    r["learners"][0]["id"] = evil
    r["config"]["data"] = "</td><script>alert(1)</script>"
    (tmp_path / "evil").mkdir()
    page = write_html(r, tmp_path / "evil" / "report.html")
    assert "<script>" not in page.read_text()
    dom = browse(page, tmp_path, "--dump-dom").stdout
    assert '<b id="x">' not in dom and "<script>alert" not in dom
    assert html.escape(evil, quote=False) in dom  # shown as text, in the timeline and table
    assert dom.count(html.escape(evil, quote=False)) >= 2
