"""The source says why, not when: no issue numbers in the components, loggers named by module.

    pytest tests/unit/test_source_prose.py

An issue number points at a tracker outside the repository; a reader of the code needs the
reason it stood for, written where the code is. A logger named after another module makes a
log line lie about where it came from.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("synchronizer", "learner", "local", "simulator", "cli", "operator")
ISSUE = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
MODULE_LOGGER = re.compile(r"^\w+\s*(?::[^=]+)?=\s*logging\.getLogger\((?P<arg>[^)]*)\)", re.M)


def sources() -> list[Path]:
    return sorted(p for c in COMPONENTS for p in (ROOT / c).rglob("*.py"))


def test_the_components_exist() -> None:
    assert all((ROOT / c).is_dir() for c in COMPONENTS)
    assert len(sources()) > 50


def test_no_component_names_an_issue_number() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in sources()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if ISSUE.search(line)
    ]
    assert not found, "say the reason, not the issue:\n" + "\n".join(found)


def test_module_loggers_are_named_after_their_module() -> None:
    found = [
        f"{p.relative_to(ROOT)}: logging.getLogger({m['arg']})"
        for p in sources()
        for m in MODULE_LOGGER.finditer(p.read_text())
        if m["arg"].strip() != "__name__"
    ]
    assert not found, "use logging.getLogger(__name__):\n" + "\n".join(found)
