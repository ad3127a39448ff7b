"""The repository is self-contained: no path of a particular machine and no reference to design
documents outside it; every ``docs/design.md#section`` the code and docs point at exists."""

from __future__ import annotations

import re

from tests.helpers import REPO

SOURCES = ("actors", "protocol", "runtime", "bench", "docs", "examples")
FORBIDDEN = re.compile(r"/work/|shared/seeds|\.\./shared|[Ss]eeds? 00\d|[Dd]esigns? 00\d")


def _files() -> list[tuple[str, str]]:
    paths = [REPO / "README.md"]
    for top in SOURCES:
        paths += sorted(p for p in (REPO / top).rglob("*") if p.suffix in (".py", ".md", ".toml"))
    return [(str(p.relative_to(REPO)), p.read_text(encoding="utf-8")) for p in paths]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_no_machine_paths_or_outside_design_documents() -> None:
    found = [
        f"{name}:{n}: {line.strip()}"
        for name, text in _files()
        for n, line in enumerate(text.splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert found == []


def test_every_design_section_pointed_at_exists() -> None:
    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", design, flags=re.MULTILINE)}
    assert {"sync-topic-and-cim", "epochs", "hand-off", "retry-and-dead-letter-queues"} <= anchors
    pointed = {
        (name, anchor)
        for name, text in _files()
        for anchor in re.findall(r"design\.md#([\w-]+)", text)
    }
    assert pointed, "nothing points at docs/design.md sections"
    assert sorted(p for p in pointed if p[1] not in anchors) == []
