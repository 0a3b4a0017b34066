"""The project's text speaks of the software: no labels of rounds of work, no tracker citations, no files outside
the repository.

README.md, docs/, notebooks/ (the cells' source text, not their outputs), epd_lab/, tests/ and scripts/ are read
for an ordinal naming a round of work ("the <ordinal> <round word>"), a numbered round word, a numbered tracker
item (a word, a space, a number: a link into another project's tracker, ``.../issues/123``, is not one), the
design notes' file name and a path into the folder beside the checkout. Results carry their commit, date and
machine instead. The patterns are built from pieces so that this file does not match them itself.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHERE = ("README.md", "docs", "notebooks", "epd_lab", "tests", "scripts")
SUFFIXES = {".md", ".py", ".pyi", ".pyx", ".pxd", ".sh", ".ipynb", ".cfg", ".toml", ".txt", ".yml", ".yaml"}

ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
            "eighteenth", "nineteenth", "twentieth")
ROUND_WORDS = ("sess" + "ion", "rou" + "nd")
TRACKER_WORD = "iss" + "ue"


def _pattern() -> re.Pattern[str]:
    ordinal = "(?:" + "|".join(ORDINALS) + ")"
    round_word = "(?:" + "|".join(ROUND_WORDS) + ")"
    parts = [
        rf"\b{ordinal}(?:'s)?\s+{round_word}s?\b",      # an ordinal naming a round of work, wrapped or not
        rf"\b{ROUND_WORDS[0]}s?\s+[0-9]+",               # a numbered round of work
        rf"\b{TRACKER_WORD}s?\s+[0-9]+",                 # a numbered tracker item
        re.escape("DESIGN" + ".md"),                      # the design notes outside the repository
        re.escape(".." + "/shared"),                      # a path beside the checkout
    ]
    return re.compile("|".join(parts), re.IGNORECASE)


PATTERN = _pattern()


def _files() -> list[Path]:
    found = []
    for name in WHERE:
        path = ROOT / name
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                            and "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts)
    return found


def _matches(text: str) -> list[tuple[int, str]]:
    """(line number, matched text) of every match, the match read across a line break too."""
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(0).split())) for m in PATTERN.finditer(text)]


def _notebook_hits(path: Path, raw: str) -> list[str]:
    """Hits in the cells' source text, each named by the line of the raw JSON that holds it (else by cell)."""
    raw_lines = raw.splitlines()
    hits = []
    for index, cell in enumerate(json.loads(raw)["cells"]):
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        lines = text.splitlines()
        for number, found in _matches(text):
            encoded = json.dumps(lines[number - 1], ensure_ascii=False)[1:-1]
            where = next((f"{n}" for n, raw_line in enumerate(raw_lines, 1) if encoded in raw_line),
                         f"cell {index}")
            hits.append(f"{path.relative_to(ROOT)}:{where}: {found!r}")
    return hits


def _hits(path: Path) -> list[str]:
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    if path.suffix == ".ipynb":
        return _notebook_hits(path, raw)
    return [f"{path.relative_to(ROOT)}:{n}: {found!r}" for n, found in _matches(raw)]


def test_the_pattern_finds_what_it_is_for_and_spares_other_projects_links():
    for text in ("the " + ORDINALS[16] + " " + ROUND_WORDS[0], "the " + ORDINALS[7] + "'s " + ROUND_WORDS[0],
                 "the " + ORDINALS[4] + " " + ROUND_WORDS[1], ROUND_WORDS[0] + "s 16",
                 "since the " + ORDINALS[9] + "\n" + ROUND_WORDS[0], ROUND_WORDS[0] + " 5",
                 TRACKER_WORD.capitalize() + " 22's placements", "(" + TRACKER_WORD + " 40)",
                 TRACKER_WORD + "s 18 and 20", "see DESIGN" + ".md", "cat .." + "/shared/notes"):
        assert PATTERN.search(text), text
    for text in ("https://github.com/vllm-project/vllm/" + TRACKER_WORD + "s/36869", "vllm #36869",
                 "peer_" + ROUND_WORDS[0] + "_id", "one " + ROUND_WORDS[1] + " of each order",
                 "the first token", "a ninth socket is closed", TRACKER_WORD + "s a batch"):
        assert not PATTERN.search(text), text


def test_no_round_labels_tracker_citations_or_outside_files():
    files = _files()
    assert any(p.suffix == ".ipynb" for p in files) and (ROOT / "README.md") in files
    hits = [hit for path in files for hit in _hits(path)]
    assert not hits, "round labels, tracker citations or files outside the repository:\n" + "\n".join(hits)
