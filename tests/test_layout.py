"""
The layout a reader relies on: no import circle between the project's modules; the
lesson (the .py files at the root) imports no tool (tools/); no test file imports
another (what they share is in tests/helpers.py); every link in the README and the
documents it links resolves to a file or a heading that exists.

    .venv/bin/python -m pytest -q tests/test_layout.py
"""

import ast
import glob
import os
import re
import subprocess
import sys

import pytest

import helpers
from helpers import ROOT, graph, project_modules


@pytest.mark.fast
def test_no_import_circle():
    g = graph()
    state = {}  # module -> "open" while on the DFS path, "done" after

    def visit(m, path):
        state[m] = "open"
        for n in sorted(g.get(m, ())):
            if state.get(n) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n) :] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


ROOMS = ("system", "tools", "lab")  # beside the course at the root


def room(m):
    """The room a module lives in: "course" (the root), "system", "tools" or "lab"."""
    return m.split(".")[0] if m.split(".")[0] in ROOMS else "course"


@pytest.mark.fast
def test_no_import_runs_up():
    """The rooms stand in order, each importing only from the rooms below it (and itself): the lab
    (experiments, data, notes) on top, imported by nothing outside it; then the tools; then the
    course's programs at the root; the system (processes, ranks, devices, the run directory) under
    them, which imports no program (lesson, train, eval), no tool and nothing of the lab."""
    g = graph()
    assert {"lesson", "train", "system.handle", "tools.exercise", "lab.marked"} <= set(g), sorted(g)
    above = {"course": {"tools", "lab"}, "system": {"tools", "lab"}, "tools": {"lab"}, "lab": set()}
    bad = sorted(f"{m} imports {n}" for m in g for n in g[m] if room(n) in above[room(m)])
    bad += sorted(f"{m} imports {n}" for m in g if room(m) == "system" for n in g[m] if n in PROGRAMS)
    assert not bad, bad


PROGRAMS = ("lesson", "train", "eval")  # what a user runs at the root


@pytest.mark.fast
def test_the_circle_check_can_fail(tmp_path, monkeypatch):
    """The check itself: a made-up circle a -> b -> a is found."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    mods = {"a": str(tmp_path / "a.py"), "b": str(tmp_path / "b.py")}
    monkeypatch.setattr(helpers, "project_modules", lambda: mods)  # what helpers.graph reads
    try:
        test_no_import_circle()
    except AssertionError as e:
        assert "a -> b -> a" in str(e) or "b -> a -> b" in str(e)
    else:
        raise AssertionError("the circle a -> b -> a was not found")


def files_of_tests():
    """Every test file: tests/*.py (helpers.py and conftest.py included) and test_smoke.py."""
    return sorted(glob.glob(os.path.join(ROOT, "tests", "*.py"))) + [os.path.join(ROOT, "test_smoke.py")]


def imported_tests(path, names):
    """The test modules `path` imports anywhere in it: a dotted name with a part that is
    test_* or one of `names` (import test_x, from test_x import f, from tests import test_x)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        dotted = []
        if isinstance(node, ast.Import):
            dotted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            dotted = [node.module or ""] + [f"{node.module or ''}.{a.name}".lstrip(".") for a in node.names]
        found |= {n for n in dotted if any(part.startswith("test_") or part in names for part in n.split("."))}
    return found


@pytest.mark.fast
def test_no_test_file_imports_another():
    """A test file takes what it shares with others from tests/helpers.py, never from
    another test file (whose import runs that module, and collects again any test
    imported by name)."""
    files = files_of_tests()
    names = {os.path.basename(p)[:-3] for p in files if os.path.basename(p).startswith("test_")}  # not helpers,
    # conftest, exercise_mutants: modules that hold what tests share, no tests
    bad = {os.path.relpath(p, ROOT): sorted(imported_tests(p, names)) for p in files}
    assert len(files) > 15 and not any(bad.values()), {p: n for p, n in bad.items() if n}


@pytest.mark.fast
def test_the_test_import_check_can_fail(tmp_path):
    """The check itself: imports of a test module, at the top or inside a function, are found."""
    (tmp_path / "a.py").write_text(
        "import os\nfrom helpers import start\n\n\ndef f():\n    from test_train import LOSS_CFG\n"
    )
    (tmp_path / "b.py").write_text("import tests.test_layout\nfrom tests import test_smoke\nimport smoke_check\n")
    assert imported_tests(str(tmp_path / "a.py"), set()) == {"test_train", "test_train.LOSS_CFG"}
    assert imported_tests(str(tmp_path / "b.py"), {"smoke_check"}) == {
        "tests.test_layout",
        "tests.test_smoke",
        "smoke_check",
    }


def slug(heading):
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def links(path):
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)  # commands, not links
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.prose
def test_every_link_resolves():
    docs = [os.path.join(ROOT, "README.md")]
    seen, broken = set(), []
    while docs:
        doc = docs.pop()
        if doc in seen:
            continue
        seen.add(doc)
        for target in links(doc):
            if re.match(r"https?://", target):
                continue
            file, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(doc), file)) if file else doc
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(doc, ROOT)}: {target} (no such file)")
                continue
            if path.endswith(".md"):
                docs.append(path)
                if anchor and anchor not in anchors(path):
                    broken.append(f"{os.path.relpath(doc, ROOT)}: {target} (no such heading)")
    assert len(seen) >= 2 and not broken, broken


@pytest.mark.fast
def test_no_test_code_on_the_production_path():
    """Faults are put into the programs from outside (tests/faults.py, through the function the
    trainer spawns with and a launcher), never read by them: no code outside tests/ names a test
    hook, an INFLIGHT_TEST_ variable or a setting kept "# tests"."""
    files = [p for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True) if "/.venv/" not in p]
    outside = [p for p in files if not os.path.relpath(p, ROOT).startswith("tests" + os.sep)]
    bad = [
        f"{os.path.relpath(p, ROOT)}:{i}: {line.strip()}"
        for p in outside
        for i, line in enumerate(open(p), 1)
        if re.search(r"INFLIGHT_TEST|_test_hook|# tests", line)
    ]
    assert len(outside) > 30 and not bad, bad


@pytest.mark.prose
def test_readme_is_a_first_page_and_cites_nothing_outside():
    """The README stays a first page: at most 12,000 characters; its first screen the trainer's,
    PyTorch's index line first, then the main job (train.py) and the tests on a CPU, then the
    design's GPU command. No file of the project cites a file the repository does not have (the
    team's design notes live outside it)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text) <= 12000, len(text)
    first = text[:2500]
    at = [first.find(s) for s in ("PIP_EXTRA_INDEX_URL=", "bash install_cpu.sh && .venv/bin/python train.py")]
    assert 0 <= at[0] < at[1], at
    assert "bash install_cpu.sh && .venv/bin/python -m pytest" in first
    assert "train.py --regime recompute --dataset gsm8k" in first
    files = [
        p
        for p in glob.glob(os.path.join(ROOT, "**", "*.*"), recursive=True)
        if p.endswith((".py", ".md", ".sh", ".txt")) and "/.venv/" not in p and "/out/" not in p
    ]
    bad = [
        os.path.relpath(p, ROOT)
        for p in files
        if re.search(r"DESIGN\.md|STYLE\.md|\.\./shared", open(p).read()) and not p.endswith("test_layout.py")
    ]
    assert len(files) > 30 and not bad, bad


def longest_chain(g):
    """The longest import chain of graph g, as a list of modules, the importer first.
    A module stands one floor above everything it imports; the floors are its length."""
    memo = {}

    def chain(m, path=()):
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m) :] + (m,)))
        if m not in memo:
            memo[m] = [m] + max((chain(n, path + (m,)) for n in sorted(g.get(m, ()))), key=len, default=[])
        return memo[m]

    return max((chain(m) for m in sorted(g)), key=len, default=[])


FLOORS = 5  # issue 42: 6 before (train -> ranks -> generator -> grpo -> reward -> data)


@pytest.mark.fast
def test_import_floors():
    """The course's modules (the root) stand on at most FLOORS floors among themselves: the longest
    chain of imports (lazy ones included) is lesson or train -> config -> grpo -> reward -> data. A
    helper lives beside what it serves, not in a module that pulls its importer up a floor."""
    g = {m: {n for n in deps if room(n) == "course"} for m, deps in graph().items() if room(m) == "course"}
    chain = longest_chain(g)
    print("longest import chain:", " -> ".join(chain))
    assert len(chain) <= FLOORS, f"{len(chain)} floors: " + " -> ".join(chain)


def drawing_names():
    """What plot.py offers to draw with: its figures (plot_* functions) and its palettes
    (upper-case constants, for a figure drawn elsewhere in the same colours)."""
    tree = ast.parse(open(os.path.join(ROOT, "plot.py")).read())
    figures = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("plot_")}
    palettes = {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name) and t.id.isupper()
    }
    return figures | palettes


@pytest.mark.fast
def test_only_drawing_imports_plot():
    """plot.py draws; reading the run directory is system/runlog.py's. A module of the lesson or a
    tool imports from plot only what draws (drawing_names: a plot_* figure or a palette),
    by name, never the module whole; so nothing that writes or reads a run pulls in the
    figures (system/runlog.py and system/checkpoint.py used to, for read_jsonl)."""
    allowed, bad = drawing_names(), []
    assert {"plot_run", "plot_answers", "plot_curves", "COLOURS"} <= allowed, allowed
    for m, path in project_modules().items():
        if m == "plot" or os.path.basename(path).startswith("test_"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import) and any(a.name == "plot" for a in node.names):
                bad.append(f"{m}: import plot")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "plot":
                bad += [f"{m}: from plot import {a.name}" for a in node.names if a.name not in allowed]
    assert not bad, bad


@pytest.mark.fast
def test_the_floor_count_can_fail():
    """The check itself: a chain a -> b -> c is three floors, and a circle is named."""
    assert longest_chain({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) == ["a", "b", "c"]
    with pytest.raises(AssertionError, match="a -> b -> a"):
        longest_chain({"a": {"b"}, "b": {"a"}})


@pytest.mark.fast
def test_style():
    """ruff, as ruff.toml configures it (line length 120, pycodestyle and pyflakes): the
    tree is formatted and lints clean. To fix: .venv/bin/ruff format . && .venv/bin/ruff check ."""
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    for args in (["format", "--check", "--quiet"], ["check", "--quiet", "--output-format", "concise"]):
        out = subprocess.run([ruff, *args, ROOT], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, f"ruff {args[0]}:\n{out.stdout}{out.stderr}"


@pytest.mark.prose
def test_the_first_sitting_is_counted_as_a_student_reads_it():
    """docs/course.md's first sitting, counted by lab/sitting.py as a fresh reader reads it (its text,
    the README to where it stops, the Concepts, the code it lists and the docstrings it meets, at 100
    words and 4 lines a minute; the README's figure; the run's lines it asks to read; the install and
    the run): it reads lesson.py, then regimes.py, then docstrings; and the counts on the page are the
    count's (the values test_marked rebuilds). No bound on the total: the count says what the sitting
    costs, and content is not cut to meet a number (issue 76)."""
    from lab import sitting

    c = sitting.counts()
    assert [(p, k) for p, _, k, _ in c["steps"] if k == "code"] == [("lesson.py", "code"), ("regimes.py", "code")]
    assert {p for p, _, k, _ in c["steps"] if k == "docstrings"} == {"pool.py", "grpo.py", "engine.py"}
    assert (sitting.PROSE_PACE, sitting.CODE_PACE, sitting.FIGURE_MINUTES) == (100, 4, 5)
    assert c["figures"] >= 1, "the README's figure is on the sitting's path"
    minutes = c["figures"] * sitting.FIGURE_MINUTES + sitting.INSTALL_MINUTES + sitting.RUN_MINUTES
    assert c["total"] == c["prose"] + c["code"] + c["output"] + minutes
    page = re.sub(r"\s+", " ", sitting.part())
    assert f"<!--sitting-total-->{c['total']}<!---->" in page, "the page's total is not the count's"


# sentences the course once said that were wrong or misleading (issue 49): each fails this test if it comes back
WRONG = {
    "docs/course.md": [
        "its gradient would push pi toward making the ratio itself larger",  # the extra term has the factor 1 + log pi
        "defaults from each source",  # CISPO's eps_high is this project's
        "bounded with its answer",  # gspo with A < 0 and s > 1 + eps is unbounded
        "no computation outside the engine reproduces it",  # hf_stale_logprobs does, with both versions
        "count as if pi had written them",  # per-token IS corrects each token given mu's prefix
        "as if pi had written\nthem",
        "When staleness bites",  # the stress experiment varies lag, the course's word for it
        # issue 60: claims stronger than their intervals, and words the data do not carry
        "recovers about half",  # tis's interval, [-8.5, +46.6], holds 0
        "leaves `gspo` far below `sync`",  # the intervals allow 14-19 points; the token mean's excludes 0
        "except with `gspo`",  # gspo at 1 against its sync: +3.1 [-16.4, +22.6]
        "from 2 on it never waits",  # the frontier's table has no idle column
        "more room paid",  # one seed; its evaluations at equal time come from different steps
        "and box it",  # the tiny tokenizer has no braces: answers end in #### N
        "leave their place to new ones",  # in train.py's ProcessGenerator, not the lesson's Generator
    ],
    "README.md": [
        "no measurable difference",  # measured where 9-13% of tokens were stale, with +-10-point intervals
        "token-level corrections hold half",  # tis's interval ran from -8.5 to +46.6
        "A stale cache undoes 45% of a step's change",  # one seed at one learning rate; seeds vary widely
        "runs the five answers side by side",  # the answers are the regimes, named 40 lines later
        "Where staleness bites",  # the stress experiment varies lag
        "room buys no steps",  # only recompute was run across --max-lag; stale went 43.1 -> 54.9 from 2 to 4
        "only `gspo` beat `sync`",  # +3.1 [-16.4, +22.6]: the seeds cannot tell
        "costs no accuracy we can measure",  # none -3.2 [-15.9, +9.6], tis -2.4 [-10.3, +5.5] at 4x the lr
        "read [`lesson.py`](lesson.py) first",  # one reading order: the first sitting's
    ],
    "lesson.py": ["Read this first"],  # the README's first sections come first
    "losses.py": ['secretly brings you off-policy RL training", 2025): w = min(pi/mu, C)'],  # theirs is pi_old/mu
}


@pytest.mark.prose
def test_the_course_says_none_of_what_was_wrong():
    """The sentences about off-policy correction that issue 49 found wrong stay out; the loss
    table says that its values are for one optimizer step per batch (pi_old = pi)."""
    found = []
    for path, sentences in WRONG.items():
        text = open(os.path.join(ROOT, path)).read()
        found += [f"{path}: {x!r}" for x in sentences if x in text or x in re.sub(r"\s+", " ", text)]
    assert not found, found
    course = re.sub(r"\s+", " ", open(os.path.join(ROOT, "docs", "course.md")).read())
    assert "**with one optimizer step per batch**, so that pi_old = pi" in course


LONGEST_DOCSTRING = 12  # lines, in the course (the root) and the system (issue 77): the why goes on its line


def long_docstrings(paths):
    """[(file, name, docstring lines, the bound)] of every docstring in `paths` longer than its bound: a
    module's LONGEST_DOCSTRING lines; a function's or a class's 6, or its own body's lines (not blank: a
    class's are its methods' too), whichever is larger, and never more than LONGEST_DOCSTRING."""
    bad = []
    for path in paths:
        text = open(path).read()
        tree, lines = ast.parse(text), text.split("\n")
        doc = ast.get_docstring(tree, clean=False)
        if doc and len(doc.strip().splitlines()) > LONGEST_DOCSTRING:
            bad.append((os.path.relpath(path, ROOT), "the module", len(doc.strip().splitlines()), LONGEST_DOCSTRING))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc:
                continue
            rest = node.body[1:]
            body = sum(1 for x in lines[rest[0].lineno - 1 : node.end_lineno] if x.strip()) if rest else 0
            bound = min(max(6, body), LONGEST_DOCSTRING)
            if len(doc.strip().splitlines()) > bound:
                bad.append((os.path.relpath(path, ROOT), node.name, len(doc.strip().splitlines()), bound))
    return bad


@pytest.mark.fast
def test_docstrings_are_a_few_lines():
    """Docstrings say what, in a sentence or a few lines; the why sits on the line it explains, and
    measurements and history go to docs/ or the commit log. In the course (the root) and the system:
    no docstring longer than 6 lines or its own body, whichever is larger, nor than 12 lines at all."""
    paths = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "system", "*.py"))
    assert len(paths) > 15
    assert not long_docstrings(paths), long_docstrings(paths)


@pytest.mark.fast
def test_the_docstring_rule_can_fail(tmp_path):
    """The check itself: a 7-line docstring over a 2-line body fails, over an 8-line body it passes; a
    13-line one fails over a body of 20 lines, and so does a module's of 13 lines."""
    doc = '    """' + "\n    ".join(["line"] * 7) + '"""\n'
    (tmp_path / "a.py").write_text("def f():\n" + doc + "    x = 1\n    return x\n")
    (tmp_path / "b.py").write_text("def f():\n" + doc + "    x = 1\n" * 8)
    assert [b[1:] for b in long_docstrings([str(tmp_path / "a.py")])] == [("f", 7, 6)]
    assert long_docstrings([str(tmp_path / "b.py")]) == []
    doc = '    """' + "\n    ".join(["line"] * 13) + '"""\n'
    (tmp_path / "c.py").write_text("def f():\n" + doc + "    x = 1\n" * 20)
    (tmp_path / "d.py").write_text('"""' + "\n".join(["line"] * 13) + '"""\n')
    assert [b[1:] for b in long_docstrings([str(tmp_path / "c.py")])] == [("f", 13, 12)]
    assert [b[1:] for b in long_docstrings([str(tmp_path / "d.py")])] == [("the module", 13, 12)]
