"""The docs a reader meets: a short README, links that resolve, and figures stated by their conditions.

A figure's conditions are the date, the machine's CPU flags, the load average, CPU utilization and the command;
words about who measured it or how the work was organised say nothing to a reader, so none appear in the tree.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.unit
PROCESS_WORDS = re.compile(r"\bengineers?\b|\bsittings?\b|\block[- ]holds?\b|\bcpu[- ]lock\b|\bissues? #?\d+",
                           re.IGNORECASE)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PROSE = "pagedgraph/data/"  # the shipped evaluation texts are prose about other things


def _tracked_text_files() -> list[str]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [n for n in names if not n.startswith(PROSE) and (REPO / n).is_file()]


def test_the_readme_is_short() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 150


def test_doc_links_resolve() -> None:
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.relative_to(REPO)} links to missing {target}"


def test_no_words_about_people_or_process_in_the_tree() -> None:
    found = []
    for name in _tracked_text_files():
        if PROCESS_WORDS.search(name):
            found.append(name)
        try:
            text = (REPO / name).read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                  if PROCESS_WORDS.search(line)]
    assert not found, "state conditions (date, CPU flags, load average, command) instead:\n" + "\n".join(found)


def test_the_performance_page_holds_current_results_only() -> None:
    """One row per figure, the latest; earlier runs and what was tried and dropped live in docs/bench/history.md."""
    text = (REPO / "docs" / "performance.md").read_text()
    assert len(text.splitlines()) <= 300, "move history to docs/bench/history.md"
    assert "Earlier:" not in text and "(bench/history.md)" in text
