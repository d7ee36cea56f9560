"""
The first sitting of the course (docs/course.md, "The first sitting"), counted: everything it asks
a student to read, at a student's pace, and the minutes that come to. The counts are values on the
page that this module fills (lab/marked.py), so an edit to the code it lists changes them there:

    .venv/bin/python lab/marked.py --write      # the sitting's counts again, with every other value

What is counted: the sitting's own text; the README up to the section its first step names; the
course's Concepts, which the README links there; the course's sections the sitting's own text
links to (Concepts' links lead to later sittings, as the sitting says); every line (docstrings and comments included:
a reader reads them) of the functions its code steps list; and the docstrings of the functions its
last step names, met on the way (their bodies are not read); the figures those pages show; the lines
of the run's output the sitting asks to read. Prose at PROSE_PACE words a minute, code and output at
CODE_PACE lines, FIGURE_MINUTES a figure, then the install and the run. The rates are a fresh reader's
for technical prose and code (issue 76); the count says what the sitting costs, it is not a target.
"""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COURSE = os.path.join(ROOT, "docs", "course.md")
PROSE_PACE = 100  # words of technical prose a minute, read to understand
CODE_PACE = 4  # lines of code a minute, a student reading to understand (a line of the run's log too)
FIGURE_MINUTES = 5  # a figure read once: its panels, its legend and its caption (docs/regimes.png has 18 keys)
OUTPUT_LINES = 12  # the run's lines the sitting asks to read: step 0's evaluation, steps 1-10, step 60
INSTALL_MINUTES = 3  # bash install_cpu.sh from a clone: 2-3 minutes (lab/RESULTS.md, How long things take)
RUN_MINUTES = 3  # the sitting's run (187 s), lesson.py --preset long --regime stale, on 2 cores (the same table)


def part():
    """The sitting's text in docs/course.md, from its heading to the next."""
    course = open(COURSE).read()
    text = course[course.index("### The first sitting") :]
    return text[: text.index("\n#", 1)]


def steps(text=None):
    """The sitting's code steps, [(file, [names], kind)]: kind "code" (read whole) from a line
    "N. **`file.py`: `name`, `name`**", "docstrings" from "N. **Docstrings on the way: `file.py`:
    `name`, ...; `file.py`: ...**"."""
    text = part() if text is None else text
    out = [
        (path, re.findall(r"`([\w.]+)`", names), "code")
        for path, names in re.findall(r"^\d+\. \*\*`(\w+\.py)`: ([^*]+)\*\*", text, flags=re.M)
    ]
    for block in re.findall(r"^\d+\. \*\*Docstrings on the way: ([^*]+)\*\*", text, flags=re.M):
        for path, names in re.findall(r"`(\w+\.py)`: ([^;]+)", block):
            out.append((path, re.findall(r"`([\w.]+)`", names), "docstrings"))
    return out


def node(tree, qualname):
    """The function or class `qualname` ("f", "Class", "Class.method") of a parsed module."""
    for name in qualname.split("."):
        tree = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    return tree


def code_lines(path, names, kind="code"):
    """Non-blank lines of the functions and classes `names` in the file at `path` ("__doc__": the
    module's docstring), or, kind "docstrings", of their docstrings alone."""
    text = open(path).read()
    tree, lines = ast.parse(text), text.split("\n")
    total = 0
    for qualname in names:
        n = tree.body[0] if qualname == "__doc__" else node(tree, qualname)
        if kind == "docstrings" or qualname == "__doc__":
            doc = n.body[0] if qualname != "__doc__" else n
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)):
                raise ValueError(f"{path}: {qualname} has no docstring")
            first, last = doc.lineno, doc.end_lineno
        else:
            first = n.decorator_list[0].lineno if n.decorator_list else n.lineno
            last = n.end_lineno
        total += sum(1 for line in lines[first - 1 : last] if line.strip())
    return total


def prose_words(markdown):
    """The words a reader reads in markdown: a link's or an image's target is not read; its text,
    the tables, the diagrams and the commands are. Markers (<!-- ... -->) are not read."""
    markdown = re.sub(r"<!--.*?-->", "", markdown)
    return sum(1 for w in re.sub(r"\]\([^)]*\)", "]", markdown).split() if re.search(r"\w", w))


def slug(heading):
    """A markdown heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def linked_sections(text, course):
    """The course's sections (heading to the next heading) that `text` links to, Concepts apart."""
    out = []
    for anchor in dict.fromkeys(re.findall(r"\]\(#([\w-]+)\)", text)):
        for m in re.finditer(r"^(#+) (.+)$", course, flags=re.M):
            if slug(m.group(2)) == anchor and anchor != "concepts":
                rest = course[m.end() :]
                end = re.search(r"^#{1,%d} " % len(m.group(1)), rest, flags=re.M)
                out.append(rest[: end.start() if end else len(rest)])
    return out


def figures(markdown):
    """The figures a reader meets in markdown: its images."""
    return len(re.findall(r"!\[[^\]]*\]\(", markdown))


def counts():
    """{"steps": [(file, names, kind, lines)], "words", "lines", "figures", "prose", "code", "output",
    "total"}: minutes rounded up, the total with the figures', the install's and the run's."""
    text = part()
    upto = re.search(r"^1\. \*\*The README, up to \*([^*]+)\*\*\*", text, flags=re.M)
    if not upto:
        raise ValueError("the sitting's first step is not the README up to one of its sections")
    readme = open(os.path.join(ROOT, "README.md")).read()
    read = readme[: readme.index("\n## " + upto.group(1) + "\n")]
    course = open(COURSE).read()
    concepts = course[course.index("\n## Concepts\n") :]
    concepts = concepts[: concepts.index("\n## ", 1)]
    pages = [text, read, *([concepts] if "docs/course.md#concepts" in read else []), *linked_sections(text, course)]
    words = sum(prose_words(page) for page in pages)  # the sitting, the README, Concepts, what its steps link to
    counted = [(p, names, kind, code_lines(os.path.join(ROOT, p), names, kind)) for p, names, kind in steps(text)]
    lines = sum(c for *_, c in counted)
    prose, code, output = -(-words // PROSE_PACE), -(-lines // CODE_PACE), -(-OUTPUT_LINES // CODE_PACE)
    shown = sum(figures(page) for page in pages)
    return dict(
        steps=counted,
        words=words,
        lines=lines,
        figures=shown,
        prose=prose,
        code=code,
        output=output,
        total=prose + code + shown * FIGURE_MINUTES + output + INSTALL_MINUTES + RUN_MINUTES,
    )


def value(key):
    def build():
        c = counts()
        return f"{c[key]:,}"

    return build


def step_lines(path, kind="code"):
    def build():
        return f"{sum(n for p, _, k, n in counts()['steps'] if (p, k) == (path, kind)):,}"

    return build


VALUES = {
    "sitting-words": value("words"),
    "sitting-lines": value("lines"),
    "sitting-prose": value("prose"),
    "sitting-code": value("code"),
    "sitting-total": value("total"),
    "sitting-figures": lambda: f"{counts()['figures'] * FIGURE_MINUTES}",
    "sitting-output": value("output"),
    "sitting-output-lines": lambda: f"{OUTPUT_LINES}",
    "sitting-lesson": step_lines("lesson.py"),
    "sitting-regimes": step_lines("regimes.py"),
    "sitting-docstrings": lambda: f"{sum(n for *_, k, n in counts()['steps'] if k == 'docstrings'):,}",
}
TABLES = {}
