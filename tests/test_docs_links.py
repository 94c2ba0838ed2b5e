"""Every pointer into the docs resolves: a markdown link's file and heading, a `docs/x.md`
named in code or docs, and a section cited as (page.md, "Section"). Pages move and
headings change; a stale pointer sends a newcomer nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# docs/x.md or x.md, optionally followed by , "Section" (a citation of one of its headings)
MENTION = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)(?:, \"([^\"]+)\")?")


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' line in a code block is no heading
    return re.findall(r"^#+ (.*)$", text, flags=re.M)


def sources() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    code = [p for d in ("mtjax", "experiments", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    return found + [p for p in code if p != Path(__file__)]  # this file names pages of its own examples


def page_named(name: str, near: Path, root: Path) -> Path:
    """The page a mention means: docs/x.md from the root, x.md beside the mentioning file or in docs/."""
    if name.startswith("docs/") or name == "README.md":
        return root / name
    return near.parent / name if (near.parent / name).exists() else root / "docs" / name


def broken(path: Path, root: Path = ROOT) -> list[str]:
    text, out = path.read_text(), []
    where = path.relative_to(root)
    if path.suffix == ".md":
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, tag = target.partition("#")
            page = path.parent / file if file else path
            if not page.exists():
                out.append(f"{where}: link to a missing {target}")
            elif tag and page.suffix == ".md" and tag not in {anchor(h) for h in headings(page)}:
                out.append(f"{where}: link to a missing heading {target}")
    # A citation may wrap, or follow a comment's '#'; link targets were checked above.
    flat = re.sub(r"\s+", " ", LINK.sub("]", text).replace("#", " "))
    for name, section in MENTION.findall(flat):
        page = page_named(name, path, root)
        if not page.exists():
            if path.suffix == ".md" or name.startswith("docs/"):
                out.append(f"{where}: names a missing {name}")
            continue  # in code, another file's name (a benchmark's bench.md output, a test's fixture)
        if section and not any(h.startswith(section) for h in headings(page)):
            out.append(f"{where}: {name} has no section \"{section}\"")
    return out


def test_every_link_mention_and_cited_section_of_the_docs_resolves():
    problems = [p for path in sources() for p in broken(path)]
    assert not problems, "\n".join(problems)


def test_a_stale_pointer_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Real section\n\n```\n# not a heading\n```\n")
    readme = tmp_path / "README.md"
    readme.write_text('See [it](docs/a.md#real-section), docs/a.md, (a.md, "Real section").\n')
    assert broken(readme, tmp_path) == []
    readme.write_text('[x](docs/b.md) [y](docs/a.md#not-a-heading) docs/c.md (a.md, "Moved away")\n')
    assert broken(readme, tmp_path) == ["README.md: link to a missing docs/b.md",
                              "README.md: link to a missing heading docs/a.md#not-a-heading",
                              "README.md: names a missing docs/c.md",
                              'README.md: a.md has no section "Moved away"']
