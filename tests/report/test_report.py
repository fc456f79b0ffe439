"""`rolerl report`: the page from synthetic run directories, its series ids, the config diff, the PNGs, the
errors; and the page opened in headless Chromium (no console errors, every series in the DOM)."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from rolerl.cli import main
from rolerl.config import load_config
from rolerl.report.figures import seesaw, specs
from rolerl.report.html import write_report
from rolerl.report.runs import ABSENT, config_diff, load_runs, run_names

FIGURES = ("reward", "eval", "roles", "entropy", "tools", "grad", "seesaw")
METRICS = {  # figure -> the metric part of its series ids, for the rows `_rows` writes
    "reward": ["reward_mean", "accuracy"],
    "eval": ["eval_pass_1", "eval_tool_call_rate", "eval_tool_error_rate"],  # no counts, stderr, seconds
    "roles": ["role_coder_loss_share", "role_reasoner_loss_share", "adapter_reason_grad_norm",
              "adapter_tool_grad_norm", "grad_norm"],
    "entropy": ["entropy", "kind_reasoning_entropy", "kind_tool_call_entropy"],
    "tools": ["tools_calls", "tools_error_rate", "tools_failures", "truncated_frac"],
    "grad": ["grad_cos_reason_reasoner__coder", "grad_conflict_frac_reason_reasoner__coder"],
    "seesaw": ["accuracy", "tool_success", "tool_use", "role_coder_accuracy", "role_reasoner_accuracy"],
}  # fmt: skip


def _rows(shift: float, evals: bool = True) -> list[dict]:
    rows = []
    for s in range(1, 5):
        row = {"step": s, "reward/mean": 0.2 * s + shift, "accuracy": 0.2 * s, "episodes": 8.0,
               "entropy": 1.0 - 0.1 * s, "kind/reasoning/entropy": 1.1, "kind/tool_call/entropy": 0.4,
               "tools/calls": 12.0 - 2 * s, "tools/errors": 2.0, "tools/error_rate": 2.0 / (12 - 2 * s),
               "tools/failures": float(s == 3), "truncated_frac": 0.125,
               "role/reasoner/loss_share": 0.75, "role/coder/loss_share": 0.25,
               "role/reasoner/accuracy": 0.2 * s, "role/coder/accuracy": 1.0 - 0.2 * s,
               "adapter/reason/grad_norm": 1.0 / s, "adapter/tool/grad_norm": 0.5, "grad_norm": 1.1,
               "time/step": 2.5}  # fmt: skip
        if s % 2 == 0:
            row |= {
                "grad/cos/reason/reasoner__coder": -0.25,
                "grad/conflict_frac/reason/reasoner__coder": 0.5,
            }
        if evals and s % 2 == 0:
            row |= {"eval/pass@1": 0.25 * s, "eval/tool_call_rate": 1.0 - 0.25 * s, "eval/tool_error_rate": 0.5,
                    "eval/tool_calls/mean": 1.5, "eval/examples": 64.0, "eval/stderr": 0.05,
                    "eval/seconds": 12.0}  # fmt: skip
        rows.append(row)
    return rows


def _run(root: Path, overrides: list[str], rows: list[dict], tail: str = "") -> Path:
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(load_config(None, overrides).to_yaml())
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return root


def _two_runs(root: Path) -> list[Path]:
    """seed0/rl and seed1/rl: equal directory names, configs that differ in optim.lr and adapters.preset;
    the second's last line was cut short by a kill."""
    a = _run(root / "seed0" / "rl", ["optim.lr=2e-5"], _rows(0.0))
    b = _run(root / "seed1" / "rl", ["optim.lr=1e-4", "adapters.preset=dart"], _rows(0.1), '{"step": 5, "rew')
    return [a, b]


@pytest.fixture
def two_runs(tmp_path) -> list[Path]:
    return _two_runs(tmp_path)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """The page of `_two_runs`, written once for the checks of its content and the browser's."""
    root = tmp_path_factory.mktemp("report")
    path = write_report(_two_runs(root), root / "out")
    assert path == root / "out" / "report.html"
    return path


def _expected(runs: list[str]) -> set[str]:
    return {f"series-{f}-{run}-{m}" for f in FIGURES for m in METRICS[f] for run in runs}


# seed0's reward is its accuracy at every step (shift 0): one curve, not one hidden under the other
TWO_RUNS_SERIES = _expected(["seed0_rl", "seed1_rl"]) - {"series-reward-seed0_rl-accuracy"}


def _index(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="rolerl-series">(.*?)</script>', page, re.S)
    assert m, "no series index in the page"
    return json.loads(m.group(1))


def test_report_of_two_runs(report):
    out, page = report.parent, report.read_text()
    # nothing is fetched from the network: no src/href (or CSS url/import) to another host
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"(url\(\s*['\"]?\s*(https?:)?//|@import)", page, re.I)
    assert "<script src" not in page
    index = _index(page)
    assert [r["name"] for r in index["runs"]] == ["seed0/rl", "seed1/rl"]  # equal names: parent added
    assert set(index["series"]) == TWO_RUNS_SERIES
    for sid in index["series"]:
        assert page.count(f'id="{sid}"') == 1, sid  # in the SVG, once
    assert set(index["figures"]) == set(FIGURES)
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids)), "two SVGs share an element id"
    for name in FIGURES:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the config diff: the keys that differ, a value per run; equal keys are not listed
    table = re.search(r'<table id="config-diff">(.*?)</table>', page, re.S).group(1)
    rows = [[html.unescape(c) for c in re.findall(r"<t[dh]>(?:<code>)?(.*?)(?:</code>)?</t[dh]>", tr)]
            for tr in re.findall(r"<tr>(.*?)</tr>", table)]  # fmt: skip
    assert rows[0] == ["key", "seed0/rl", "seed1/rl"]
    assert ["adapters.preset", '"shared"', '"dart"'] in rows and ["optim.lr", "2e-05", "0.0001"] in rows
    assert not [r for r in rows[1:] if r[0] not in ("adapters.preset", "optim.lr")]  # nothing else differs
    assert page.count("<details>") == 2 and "<summary>seed1/rl: config.yaml</summary>" in page


def test_a_figure_without_data_is_a_note_and_its_old_png_goes(tmp_path):
    rows = [{"step": s, "reward/mean": 0.5, "accuracy": 0.5} for s in (1, 2)]
    run = _run(tmp_path / "run", [], rows)
    (run / "report").mkdir()
    (run / "report" / "grad.png").write_bytes(b"stale")
    path = write_report([run])  # default OUT: the run's report/
    assert path == run / "report" / "report.html"
    page = path.read_text()
    assert set(_index(page)["series"]) == {"series-reward-run-reward_mean", "series-seesaw-run-accuracy"}
    assert "No run logged grad/cos/*, grad/conflict_frac/*." in page
    assert sorted(p.name for p in (run / "report").glob("*.png")) == ["reward.png", "seesaw.png"]


def _approx(points, expected) -> bool:
    return len(points) == len(expected) and all(
        x == ex and y == pytest.approx(ey) for (x, y), (ex, ey) in zip(points, expected, strict=True)
    )


def test_seesaw_values(tmp_path):
    """At eval points when every run has them: pass@1, eval tool-call rate, 1 - eval tool error rate, and
    the rollouts' role accuracy of that step. Else per step, with calls per episode scaled by the peak."""
    with_eval = load_runs([_run(tmp_path / "a", [], _rows(0.0))])
    curves = {k: pts for k, _, pts in seesaw(with_eval).panels[0].curves["a"]}
    assert curves["accuracy"] == [(2.0, 0.5), (4.0, 1.0)]
    assert curves["tool_use"] == [(2.0, 0.5), (4.0, 0.0)]
    assert curves["tool_success"] == [(2.0, 0.5), (4.0, 0.5)]
    assert _approx(curves["role/coder/accuracy"], [(2.0, 0.6), (4.0, 0.2)])
    mixed = load_runs([tmp_path / "a", _run(tmp_path / "b", [], _rows(0.0, evals=False))])
    curves = {k: pts for k, _, pts in seesaw(mixed).panels[0].curves["b"]}
    assert _approx(curves["accuracy"], [(s, 0.2 * s) for s in (1.0, 2.0, 3.0, 4.0)])
    # calls per episode 10/8, 8/8, 6/8, 4/8 over the peak 10/8; success = 1 - 2/calls
    assert _approx(curves["tool_use"], [(1.0, 1.0), (2.0, 0.8), (3.0, 0.6), (4.0, 0.4)])
    assert _approx(curves["tool_success"], [(1.0, 0.8), (2.0, 0.75), (3.0, 2 / 3), (4.0, 0.5)])


def test_run_names_and_config_diff(tmp_path):
    roots = [tmp_path / "x" / "rl", tmp_path / "y" / "rl", tmp_path / "base"]
    assert run_names(roots) == ["x/rl", "y/rl", "base"]
    assert run_names([tmp_path / "rl", tmp_path / "rl"]) == [
        f"{tmp_path.name}/rl #1",
        f"{tmp_path.name}/rl #2",
    ]
    runs = load_runs([_run(tmp_path / "p", ["train.steps=3"], []), _run(tmp_path / "q", [], [])])
    runs[1].config["roles"] = {"coder": {"lr_scale": 2.0}}
    assert config_diff(runs) == [("train.steps", ["3", "100"]), ("roles", ["{}", ABSENT]),
                                 ("roles.coder.lr_scale", [ABSENT, "2.0"])]  # fmt: skip


def test_not_a_run_dir(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty'? is not a run directory: it has no metrics.jsonl"):
        write_report([tmp_path / "empty"])
    assert not (tmp_path / "empty" / "report").exists()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        f"rolerl report: error: {str(tmp_path / 'empty')!r} is not a run directory: it has no metrics.jsonl"
    ]
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "missing' is not a run directory: no such directory" in capsys.readouterr().err


def test_cli(two_runs, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["report", *map(str, two_runs), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    assert (out / "report.html").is_file()


# ---------------------------------------------------------------------------------------------------------
# The page in a browser


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium); CI installs it")
    return exe


def _open(exe: str, page: Path, profile: Path) -> tuple[str, list[str]]:
    """The DOM after loading `page`, and the console messages the page caused (an error, a blocked load:
    the report's own page logs nothing at all)."""
    proc = subprocess.run(
        [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
         "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0 and "</html>" in proc.stdout, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line and page.as_uri() in line]
    return proc.stdout, console


class _Dom(HTMLParser):
    """Element ids of a dumped DOM, the ids whose element holds a drawn path, and the series index."""

    VOID = {"meta", "link", "img", "br", "hr", "input", "source", "wbr", "col", "area", "base", "embed"}

    def __init__(self, text: str) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.drawn: set[str] = set()
        self.stack: list[str | None] = []
        self.index_text: str | None = None
        self._in_index = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "path" and a.get("d"):
            self.drawn.update(i for i in self.stack if i and i.startswith("series-"))
        self._in_index = a.get("id") == "rolerl-series"
        if tag not in self.VOID:
            self.stack.append(a.get("id"))

    def handle_endtag(self, tag):
        if tag not in self.VOID and self.stack:
            self.stack.pop()
        self._in_index = False

    def handle_data(self, data):
        if self._in_index:
            self.index_text = (self.index_text or "") + data


def test_page_in_headless_chromium(report, tmp_path):
    exe, path = _chromium(), report
    start = time.perf_counter()
    dom, console = _open(exe, path, tmp_path / "profile")
    seconds = time.perf_counter() - start
    assert console == []
    parsed = _Dom(dom)
    series = json.loads(parsed.index_text)["series"]
    assert set(series) == TWO_RUNS_SERIES
    assert not set(series) - parsed.ids, "series missing from the DOM"
    assert not set(series) - parsed.drawn, "series without a drawn path"
    # the check sees a page that breaks: a copy that loads an image from the network logs a blocked load
    bad = tmp_path / "broken.html"
    bad.write_text(path.read_text().replace("</body>", '<img src="https://example.com/x.png"></body>'))
    _, console = _open(exe, bad, tmp_path / "profile")
    assert len(console) == 1 and "https://example.com/x.png" in console[0]
    assert seconds < 30, f"Chromium took {seconds:.1f} s to load the page"


def test_curves_that_coincide_are_drawn_once_and_named_together(tmp_path):
    """The demo's reward is its accuracy; with one adapter the total gradient norm is that adapter's."""
    rows = [{"step": s, "reward/mean": 0.25 * s, "accuracy": 0.25 * s, "grad_norm": 1.0 / s,
             "adapter/policy/grad_norm": 1.0 / s} for s in (1, 2, 3)]  # fmt: skip
    rows[1]["grad_norm"] = 0.6  # the second run differs at one step: two curves
    a = _run(tmp_path / "a", [], [dict(r, grad_norm=1.0 / r["step"]) for r in rows])
    b = _run(tmp_path / "b", [], rows)
    figures = {f.name: f for f in specs(load_runs([a, b]))}
    reward = figures["reward"].panels[0].curves
    assert [(k, label) for k, label, _ in reward["a"]] == [
        ("reward/mean", "reward (mean) = accuracy (rollouts)")
    ]
    norms = figures["roles"].panels[1].curves
    assert [(k, label) for k, label, _ in norms["a"]] == [
        ("adapter/policy/grad_norm", "policy = all adapters")
    ]
    assert [k for k, _, _ in norms["b"]] == ["adapter/policy/grad_norm", "grad_norm"]
