"""Every Note that code, tests or docs cite by name is defined (a line of the library or of a
test module that begins with it: a comment, or a docstring paragraph), so a reader can find it
by its exact name."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTE = re.compile(r"Note \[([^\]]+)\]")
# a definition begins its line, after comment or docstring markers
DEFINITION = re.compile(r"^[\s#*/\"'`-]*Note \[([^\]]+)\]", re.MULTILINE)
SOURCES = ("tiermem", "tests", "examples", "scripts", "docs")
SUFFIXES = {".py", ".md", ".c", ".h", ".sh", ".yaml"}


def _files(*dirs: str) -> list[pathlib.Path]:
    return [p for d in dirs for p in (ROOT / d).rglob("*")
            if p.suffix in SUFFIXES and "results" not in p.parts] + [ROOT / "README.md"]


def _name(raw: str) -> str:
    return " ".join(raw.split())  # a name may wrap across lines


def test_every_cited_note_is_defined():
    defined = {_name(m.group(1)) for p in _files("tiermem", "tests")
               for m in DEFINITION.finditer(p.read_text(errors="ignore"))}
    cited = {}
    for p in _files(*SOURCES):
        if p.name == "test_notes.py":
            continue
        text = p.read_text(errors="ignore")
        for m in NOTE.finditer(text):
            cited.setdefault(_name(m.group(1)), f"{p.relative_to(ROOT)}:"
                             f"{text.count(chr(10), 0, m.start()) + 1}")
    missing = {name: where for name, where in cited.items() if name not in defined}
    assert not missing, f"Notes cited but defined nowhere: {missing}"
    assert len(defined) >= 10  # the pattern finds the library's Notes


def test_no_loose_note_references():
    """A Note is cited by its name: not "note rule 6", "the note above" or a bare "see note"."""
    loose = re.compile(r"\b(see note(?! \[)|note rule|the note (above|below))\b", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            for p in _files(*SOURCES) if p.name != "test_notes.py"
            for text in [p.read_text(errors="ignore")]
            for m in loose.finditer(text)]
    assert not hits, hits
