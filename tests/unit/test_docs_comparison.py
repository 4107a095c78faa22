"""The comparison with other frameworks (docs/comparison.md) keeps its cell grammar: every peer cell is "yes" with a
link to that peer's own repository, "no", or "unknown", so that a cell can never again read as a vague "not claimed"."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "comparison.md"

# column -> the prefix every link of that column starts with: the peer's own repository on GitHub
PEERS = {
    "verl": "https://github.com/volcengine/verl/",
    "NeMo-RL": "https://github.com/NVIDIA-NeMo/RL/",
    "slime": "https://github.com/THUDM/slime/",
    "AReaL": "https://github.com/inclusionAI/AReaL/",
    "ROLL": "https://github.com/alibaba/ROLL/",
}
LINK = r"\[[^\]\n]+\]\((https://[^)\s]+)\)"
YES = re.compile(rf"yes \({LINK}(?:, {LINK})*\)")


def cells(line: str) -> list:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table() -> tuple:
    lines = [ln for ln in PAGE.read_text().splitlines() if ln.startswith("|")]
    header, rule, *rows = lines
    assert set(cells(rule)) <= {"---", ":---", "---:"}, rule
    return cells(header), [cells(r) for r in rows]


def cell_problem(column: str, cell: str):
    """None if the cell is well formed for this peer's column, else why not."""
    if cell in ("no", "unknown"):
        return None
    if not YES.fullmatch(cell):
        return "not 'yes ([page](https://...))', 'no' or 'unknown'"
    bad = [u for u in re.findall(LINK, cell) if not u.startswith(PEERS[column])]
    return f"links outside {PEERS[column]}: {bad}" if bad else None


def test_columns_are_megarl_and_the_five_peers():
    header, rows = table()
    assert header == ["", "megarl", *PEERS], header
    assert rows and all(len(r) == len(header) for r in rows), [r[0] for r in rows if len(r) != len(header)]


def test_every_peer_cell_is_yes_with_a_link_no_or_unknown():
    header, rows = table()
    problems = [f"{row[0]} / {col}: {problem}: {cell!r}"
                for row in rows for col, cell in zip(header[2:], row[2:])
                if (problem := cell_problem(col, cell))]
    assert not problems, "\n".join(problems)


def test_the_grammar_refuses_what_it_should():
    assert cell_problem("verl", "yes ([dapo.md](https://github.com/volcengine/verl/blob/main/docs/algo/dapo.md))") is None
    assert cell_problem("slime", "yes ([a](https://github.com/THUDM/slime/blob/main/a.py), "
                                 "[b](https://github.com/THUDM/slime/blob/main/b.md))") is None
    for bad in ("not claimed", "yes", "yes (DAPO)", "yes ([x](http://github.com/volcengine/verl/x))",
                "yes ([x](docs/algo.md))", "yes ([x](https://github.com/THUDM/slime/x))", "no (planned)"):
        assert cell_problem("verl", bad), bad


def test_readme_links_the_comparison_and_the_support_matrix():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/comparison.md)" in readme and "(docs/support.md)" in readme
