"""
Every marked table and value of README.md, docs/course.md and RESULTS.md is what its builder makes
of the committed data (lab/data/<tool>.jsonl): a digit typed by hand, a copy that drifted from its
original, a block or value nobody builds, or a builder whose block or value was deleted, fails here.

    .venv/bin/python -m pytest -q tests/test_marked.py
"""

import json
import os
import re
import shutil
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "lab"))
import marked  # noqa: E402

pytestmark = pytest.mark.prose  # the pages against their data (tests/conftest.py)


def test_every_marked_table_and_value_is_rebuilt_from_the_data():
    assert marked.differences() == [], "\n".join(marked.differences())
    assert len(marked.values(open(os.path.join(ROOT, "README.md")).read())) > 10  # the README's sentences hold values


def copy_pages(tmp_path):
    for page in marked.PAGES:
        os.makedirs(os.path.dirname(tmp_path / page), exist_ok=True)
        shutil.copy(os.path.join(ROOT, page), tmp_path / page)


def test_one_changed_digit_fails(tmp_path):
    """On a copy of the pages: one digit of one table's last row changed is found, by its table and line."""
    copy_pages(tmp_path)
    path = tmp_path / "docs/course.md"
    text = path.read_text()
    name, body = marked.blocks(text)[0]
    last = body.splitlines()[-1]
    digit = re.search(r"\d", last.split("|")[2])  # the first digit of the row's first number
    changed = last.replace(
        last.split("|")[2],
        last.split("|")[2][: digit.start()] + str((int(digit.group()) + 1) % 10) + last.split("|")[2][digit.end() :],
        1,
    )
    path.write_text(text.replace(body, body.replace(last, changed)))
    found = marked.differences(tmp_path)
    assert len(found) == 1 and f"table '{name}', line {len(body.splitlines())}:" in found[0], found


def test_a_block_with_no_builder_and_a_builder_with_no_block_fail(tmp_path):
    copy_pages(tmp_path)
    path = tmp_path / "README.md"
    text = path.read_text()
    name = marked.blocks(text)[0][0]
    path.write_text(text.replace(f"<!-- table: {name} -->", "<!-- table: nobody-builds-this -->"))
    found = marked.differences(tmp_path)
    assert any("'nobody-builds-this' has no builder" in f for f in found), found
    assert any(f"table '{name}' has a builder and no block" in f for f in found), found


def test_write_puts_the_builders_text_between_the_markers_alone(tmp_path):
    """write() on a page whose block holds something else: the block becomes the builder's text, and
    every line outside the markers stays as it was."""
    copy_pages(tmp_path)
    path = tmp_path / "README.md"
    text = path.read_text()
    name, body = marked.blocks(text)[0]
    path.write_text(text.replace(body, "| stale | 9.999 |"))
    assert ("README.md", name) in marked.write(marked.builders(), root=tmp_path)
    assert path.read_text() == text


def test_one_changed_digit_in_a_value_fails(tmp_path):
    """On a copy of the pages: one digit of a value inside a README sentence changed is found, by its name;
    the words around a value are the page's own, and changing them is no difference."""
    copy_pages(tmp_path)
    path = tmp_path / "README.md"
    text = path.read_text()
    name, body = next((n, b) for n, b in marked.values(text) if re.search(r"\d", b))
    digit = re.search(r"\d", body)
    changed = body[: digit.start()] + str((int(digit.group()) + 1) % 10) + body[digit.end() :]
    marker = f"<!--{name}-->{body}<!---->"
    path.write_text(text.replace(marker, f"<!--{name}-->{changed}<!---->").replace("Long answers", "Long replies"))
    found = marked.differences(tmp_path)
    assert len(found) == 1 and f"README.md: value '{name}': the page has {changed!r}" in found[0], found


def test_a_value_with_no_builder_and_a_builder_with_no_value_fail(tmp_path):
    copy_pages(tmp_path)
    path = tmp_path / "README.md"
    text = path.read_text()
    elsewhere = {n for page in marked.PAGES[1:] for n, _ in marked.values((tmp_path / page).read_text())}
    name = next(n for n, _ in marked.values(text) if n not in elsewhere)  # a value of the README alone
    path.write_text(text.replace(f"<!--{name}-->", "<!--nobody-builds-this-->"))
    found = marked.differences(tmp_path)
    assert any("value 'nobody-builds-this' has no builder" in f for f in found), found
    assert any(f"value '{name}' has a builder and no place" in f for f in found), found


def test_write_puts_each_values_text_between_its_markers_alone(tmp_path):
    """write() on a page whose value reads something else: the value becomes its builder's text, and
    every character outside its markers stays as it was."""
    copy_pages(tmp_path)
    path = tmp_path / "README.md"
    text = path.read_text()
    name, body = marked.values(text)[0]
    path.write_text(text.replace(f"<!--{name}-->{body}<!---->", f"<!--{name}-->9.99 [stale]<!---->"))
    assert ("README.md", name) in marked.write({}, marked.builders("VALUES"), root=tmp_path)
    assert path.read_text() == text


def test_a_course_table_is_built_from_one_kind_of_line(tmp_path, monkeypatch):
    """lab/course.py after `course.py answers` in a fresh clone: its two runs go onto the data file, and the
    long preset's `stale` run is a row of all six experiments. The answers table is built from the two runs
    (every row has one); the other five keep the lines copied from RESULTS.md, as the page prints them, where
    mixing the two kinds had no equal time (a ValueError after the runs, issue 69)."""
    import course

    copied = [json.dumps(s) for s in marked.read("course") if "source" in s]  # the data file before its runs
    monkeypatch.setattr(marked, "data_path", lambda tool: str(tmp_path / f"{tool}.jsonl"))
    (tmp_path / "course.jsonl").write_text("\n".join(copied) + "\n")
    before = {name: build() for name, build in course.TABLES.items()}
    ends = {"default preset": 100.0, "--preset long": 85.0}  # simulated seconds, made up
    for line in marked.read("course"):
        for label in [label for name, label in line["rows"] if name == "answers"]:
            run = {k: v for k, v in line.items() if k not in ("source", "at_s")}  # as this tool records a run
            marked.append("course", run | dict(curve=[[0.0, line["start"]], [ends[label], line["final"]]]))
    assert [n for n in course.EXPERIMENTS if course.table(n) != before[f"course-{n}"]] == ["answers"]
    assert course.regime("stale") == [s for s in marked.read("course") if "source" in s][3]  # the copied line
    assert "| pass@1 at 85 s |" in course.table("answers")  # the runs' own equal time: the earliest end
    assert {name: build() for name, build in course.TABLES.items() if name != "course-answers"} == {
        name: text for name, text in before.items() if name != "course-answers"
    }
    copied, ran = dict(fresh="no"), dict(fresh="yes", curve=[[0.0, 0.5]])
    assert course.choose([("a", [copied, ran]), ("b", [copied])]) == [("a", copied), ("b", copied)]
    assert course.choose([("a", [copied, ran]), ("b", [ran]), ("c", [])]) == [("a", ran), ("b", ran)]
