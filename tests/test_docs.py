"""The docs stay honest: every config field has a docstring, docs/config.md is what
scripts/config_reference.py generates from them, and the relative links of README.md and
docs/*.md (anchors included) lead somewhere."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional
from urllib.parse import unquote

from deepspeed_gift.config import _GiftModel
from scripts import config_reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# ---- field docstrings ------------------------------------------------------------------
class _ToyInner(_GiftModel):
    size: int = 3
    """Documented."""

    color: str = "red"


class _Toy(_GiftModel):
    documented: bool = True
    """A field with a docstring."""

    bare: int = 0
    inner: Optional[_ToyInner] = None
    """A nested block; its own fields are walked too."""


def test_every_config_field_has_a_docstring():
    missing = config_reference.undocumented()
    assert missing == [], ("fields without a docstring in deepspeed_gift/config.py (add one under each): "
                           + ", ".join(missing))


def test_undocumented_names_exactly_the_fields_without_a_docstring():
    assert _Toy.model_fields["documented"].description == "A field with a docstring."
    assert config_reference.undocumented(_Toy, "toy") == ["toy.bare", "toy.inner.color"]
    assert "| `toy.inner.size` | int | `3` | Documented. |" in config_reference.render(_Toy, "toy")


# ---- docs/config.md --------------------------------------------------------------------
def test_generated_references_are_up_to_date():
    for path, write in config_reference.GENERATED:  # docs/config.md, docs/telemetry.md
        name = str(path.relative_to(ROOT))
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        expected = write()
        assert current == expected, (f"{name} is stale: run {config_reference.COMMAND}\n"
                                     + config_reference.stale_diff(current, expected, name=name))


# ---- links -----------------------------------------------------------------------------
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:name|id)=[\"']([^\"']+)[\"']", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif line.strip().startswith(fence):
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (link targets and HTML tags dropped), lowercased,
    every character that is not a letter, digit, underscore, hyphen or space removed, then each
    space made a hyphen (runs are kept: ``a & b`` -> ``a--b``)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set:
    """Every anchor a Markdown file has: heading slugs (a repeat gets ``-1``, ``-2``, ... as on
    GitHub) and explicit ``<a name=...>``/``id=...``."""
    found, counts = set(), {}
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(_HTML_ANCHOR.findall(line))
    return found


def relative_links(path: Path):
    """(line number, target) of each Markdown link and reference definition that is not a URL,
    outside code blocks and code spans."""
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        prose = _INLINE_CODE.sub("", line)
        targets = _LINK.findall(prose)
        ref = _REF_DEF.match(prose)
        if ref:
            targets.append(ref.group(1))
        for target in targets:
            if target and not _SCHEME.match(target):
                yield number, target


def broken_links(path: Path, root: Path = ROOT) -> list:
    """One line per relative link of ``path`` that leads to no file or directory, or to no
    heading of the Markdown file it names; paths are shown relative to ``root``."""
    def shown(p: Path) -> str:
        return Path(os.path.relpath(p.resolve(), root.resolve())).as_posix()

    broken = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = path.parent / unquote(file_part) if file_part else path
        where = f"{shown(path)}:{number}: ({target})"
        if not dest.exists():
            broken.append(f"{where} no such file or directory")
        elif anchor and dest.is_file() and dest.suffix.lower() == ".md" and unquote(anchor) not in anchors(dest):
            broken.append(f"{where} no heading with anchor #{anchor} in {shown(dest)}")
    return broken


def test_slug_follows_github():
    assert slug("Config reference") == "config-reference"
    assert slug("Results: `launch/compare.py` as shipped") == "results-launchcomparepy-as-shipped"
    assert slug("`gift.geometry`") == "giftgeometry"
    assert slug("Geometry lifecycle (`deepspeed_gift/lifecycle.py`, with `x.py`)") == \
        "geometry-lifecycle-deepspeed_giftlifecyclepy-with-xpy"
    assert slug("A & B -- c") == "a--b----c"
    assert slug("See [the docs](docs/config.md) now") == "see-the-docs-now"


def test_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# Part One\n\n## Part One\n", encoding="utf-8")
    doc = tmp_path / "a.md"
    doc.write_text("# Top\n"
                   "[ok](sub/b.md#part-one-1) [dir](sub) [self](#top) [web](https://x.invalid/none)\n"
                   "[gone](missing.md) [bad anchor](sub/b.md#part-two) [bad self](#nowhere)\n"
                   "`[in code](nope.md)`\n```\n[in fence](nope.md)\n```\n", encoding="utf-8")
    assert broken_links(doc, tmp_path) == [
        "a.md:3: (missing.md) no such file or directory",
        "a.md:3: (sub/b.md#part-two) no heading with anchor #part-two in sub/b.md",
        "a.md:3: (#nowhere) no heading with anchor #nowhere in a.md",
    ]


def test_relative_links_resolve():
    broken = [line for doc in DOCS for line in broken_links(doc)]
    assert broken == [], "broken links:\n" + "\n".join(broken)


# ---- the README as a product page -------------------------------------------------------
README_MAX_LINES = 200  # the bound: a page read in two minutes
FIRST_SCREEN_LINES = 40


def test_readme_is_short_and_opens_with_a_gift_block_that_validates():
    import json

    from deepspeed_gift import get_gift_config

    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    blocks, current = [], None
    for i, line in enumerate(lines):
        if current is None and line.strip() == "```json":
            current = (i, [])
        elif current is not None and line.strip() == "```":
            blocks.append((current[0], "\n".join(current[1])))
            current = None
        elif current is not None:
            current[1].append(line)
    configs = [(start, json.loads(text)) for start, text in blocks]
    with_gift = [(start, cfg) for start, cfg in configs if "gift" in cfg]
    assert with_gift and with_gift[0][0] < FIRST_SCREEN_LINES
    for _, cfg in with_gift:
        assert get_gift_config(cfg).enabled  # a block a user pastes is a valid, enabled one
