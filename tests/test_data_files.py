"""What is committed under data/ is read or cited by something, and the repository stays small.

A data file counts as referenced when some tracked text file (code, a test, a script, the Makefile, a doc, or a
notebook's cell sources, not its outputs) names it: by its path from the repository, from data/ or from
data/bench/, or by its file name where no other data file has that name; or names a folder above it at
data/bench/<name> or deeper; or gives a glob (``*``) or a brace list (``run{1,2}``) that resolves to it or to a
folder above it. A log or result that only a referenced data file names (a summary's ``log``) counts as well: the
references are followed from the code and docs into the data they name."""
from __future__ import annotations

import fnmatch
import itertools
import json
import re
import subprocess
from collections import Counter
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 10 * 1000 * 1000
TEXT_SUFFIXES = {".py", ".pyi", ".pyx", ".pxd", ".md", ".ipynb", ".sh", ".cfg", ".toml", ".txt", ".yml", ".yaml", ""}
TOKEN = re.compile(r"[A-Za-z0-9_.*{},/-]+")
PREFIXES = ("", "data/", "data/bench/")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.split("\0") if p and (ROOT / p).is_file()]


def expand(token: str) -> list[str]:
    """``a{1,2}b`` as ``a1b`` and ``a2b`` (every brace list in the token)."""
    parts = re.split(r"\{([^{}]*)\}", token)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def texts(files: list[str], data: bool = False) -> dict[str, str]:
    """The text of `files` (their cell sources for notebooks); data/'s files only where `data`."""
    out = {}
    for name in files:
        path = ROOT / name
        if name.startswith("data/") != data or path.suffix not in TEXT_SUFFIXES | {".json", ".log"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if path.suffix == ".ipynb":
            text = "\n".join("".join(cell["source"]) for cell in json.loads(text)["cells"])
        out[name] = text
    return out


def referenced(data: list[str], corpus: dict[str, str]) -> set[str]:
    names = Counter(PurePosixPath(d).name for d in data)
    folders = {str(p) for d in data for p in PurePosixPath(d).parents if len(p.parts) >= 3}
    folders.discard("data/bench/logs")
    found: set[str] = set()
    tokens = {t.strip(".,/").removeprefix("../").removeprefix("./") for text in corpus.values()
              for t in TOKEN.findall(text)}
    for token in tokens:
        for name in expand(token):
            name = name.strip("/")
            if not name or name in {".", ".."}:
                continue
            if "/" not in name and not re.search(r"[-_.]", name):  # a bare word ("campaign") is prose
                continue
            wanted = [prefix + name for prefix in PREFIXES]
            if "*" in name:
                if "**" in name or not re.match(r"[\w.-]{5}", name):  # no stem of its own ("*.json", "e2e-*")
                    continue
                hits = {d for d in data if any(fnmatch.fnmatchcase(d, w) for w in wanted)}
                hits |= {d for f in folders if any(fnmatch.fnmatchcase(f, w) for w in wanted)
                         for d in data if d.startswith(f + "/")}
            else:
                hits = {d for d in data if d in wanted or ("/" not in name and names[name] == 1
                                                            and PurePosixPath(d).name == name)}
                hits |= {d for w in wanted if w in folders for d in data if d.startswith(w + "/")}
            found |= hits
    return found


def test_every_data_file_is_read_or_cited():
    files = tracked()
    data = [f for f in files if f.startswith("data/")]
    assert data, "no data under data/"
    found = referenced(data, texts(files))
    while True:  # what the referenced data names in turn
        more = referenced(data, texts(sorted(found), data=True)) - found
        if not more:
            break
        found |= more
    loose = sorted(set(data) - found)
    assert loose == [], f"{len(loose)} data files nothing names (remove them or say what they hold): {loose}"


def test_the_reference_rules_resolve_what_they_should_and_no_more():
    data = ["data/bench/a-1/run1.json", "data/bench/a-1/run2.json", "data/bench/b-1/summary.json",
            "data/bench/c-1/summary.json", "data/bench/logs/x.txt", "data/bench/e2e-one.json"]
    assert referenced(data, {"d": "`data/bench/a-1/run{1,2}.json`"}) == set(data[:2])
    assert referenced(data, {"d": 'BENCH / "b-1" / "summary.json"'}) == {data[2]}  # the folder b, from data/bench
    assert referenced(data, {"d": "summary.json and logs/ and call1"}) == set()  # names shared, generic folders
    assert referenced(data, {"d": 'RESULTS.glob("e2e-o*.json")'}) == {data[5]}
    assert referenced(data, {"d": "see x.txt"}) == {data[4]}
    assert referenced(data, {"d": "**a** and `*.json` and e2e-* and **run**"}) == set()  # markdown, bare stems


def test_the_tracked_files_stay_under_ten_megabytes():
    sizes = {f: (ROOT / f).stat().st_size for f in tracked()}
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= LIMIT_BYTES, f"tracked files {total / 1e6:.2f} MB > {LIMIT_BYTES / 1e6:.0f} MB; largest {biggest}"
