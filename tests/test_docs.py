"""The README and the manual in docs/: every relative link leads somewhere, and the README stays a front page.

A link is checked the way GitHub renders it: the target file must exist, relative to the page that links it, and a
`#anchor` must be the slug of one of that file's headings (lower case, punctuation dropped, spaces to hyphens, a
repeated heading numbered -1, -2, ...). Links to other sites are not followed: the suite runs without a network.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

# [text](target) and ![alt](target); the target ends at the first space (a title may follow) or `)`.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks: a `# comment` in a shell example is no heading, `[i](j)` no link."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: code spans keep their text, then lower case, every character that is not a
    letter, digit, space, hyphen or underscore dropped, and each space a hyphen."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading anchors on its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    targets = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        targets += LINK.findall(CODE_SPAN.sub("", line))  # `[x](y)` inside a code span is text, not a link
    return targets


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: another site
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}: ({target})"
        if not linked.exists():
            problems.append(f"{where}: no file {file_part}")
        elif anchor and (linked.is_dir() or linked.suffix != ".md"):
            problems.append(f"{where}: an anchor into something that is not a Markdown file")
        elif anchor and anchor not in anchors(linked):
            problems.append(f"{where}: no heading #{anchor} in {linked.relative_to(root)}")
    return problems


def test_slug_is_githubs() -> None:
    assert slug("Temperature (`student.kd.temperature`, default 1)") == "temperature-studentkdtemperature-default-1"
    assert slug("Logit datasets: `kdflow store import` and `kdflow store export`") == \
        "logit-datasets-kdflow-store-import-and-kdflow-store-export"
    assert slug("Sampled and hybrid targets (`precompute.targets: hybrid | sampled`)") == \
        "sampled-and-hybrid-targets-precomputetargets-hybrid--sampled"
    assert slug("The teacher's logits in float32 (on by default)") == "the-teachers-logits-in-float32-on-by-default"


def test_fenced_code_has_no_headings_or_links(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```bash\n# a comment\n[a](missing.md)\n```\n\n## Title\n", encoding="utf-8")
    assert anchors(page) == {"title", "title-1"}
    assert links(page) == []


def test_a_missing_file_or_heading_is_named(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Here\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#here) [b](other.md#there) [c](gone.md) [d](https://example.org/x)\n",
                    encoding="utf-8")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2
    assert "no heading #there in other.md" in problems[0]
    assert "no file gone.md" in problems[1]


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: the "
                                            f"manual belongs in docs/")
