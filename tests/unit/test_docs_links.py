"""Every relative link in README.md and docs/ resolves: the file exists, and an anchor names one of its headings
(GitHub's slugs: lower case, punctuation dropped, spaces to hyphens)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*)$", re.MULTILINE)


def slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def pages() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_slugs_follow_githubs_rule():
    assert slug("`rollout.multi_turn` and tools: a guide") == "rolloutmulti_turn-and-tools-a-guide"


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                slugs = {slug(h) for h in HEADING.findall(dest.read_text())}
                if anchor not in slugs:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)
