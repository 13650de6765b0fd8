"""The front pages stay short and current: README ≤ 200 lines with the two commands and no work history,
docs/benchmarks.md ≤ 300 lines of current numbers (the history lives in docs/benchmarks/reports/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BENCH = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
HISTORY = re.compile(r"\bsessions?\b|\bissues? #?\d+", re.IGNORECASE)


def test_readme_is_short_and_has_the_two_commands():
    assert len(README.splitlines()) <= 200
    assert "bash launch/quickstart.sh" in README
    assert "bash launch/setup.sh && .venv/bin/python -m pytest -q" in README


def test_front_pages_carry_no_work_history():
    for name, text in (("README.md", README), ("docs/benchmarks.md", BENCH)):
        found = sorted({m.group(0) for m in HISTORY.finditer(text)})
        assert found == [], f"{name} mentions {found}: move dated notes to docs/benchmarks/reports/"


def test_benchmarks_page_is_short_and_its_reports_exist():
    assert len(BENCH.splitlines()) <= 300
    reports = set(re.findall(r"reports/([\w.-]+\.md)", BENCH))
    assert reports and all((ROOT / "docs" / "benchmarks" / "reports" / r).is_file() for r in reports), reports


def test_readme_links_and_data_files_exist():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        assert (ROOT / target).exists(), target
    for data in re.findall(r"`(e2e_[\w]+\.json)`", BENCH):
        assert (ROOT / "docs" / "benchmarks" / "data" / data).is_file(), data
