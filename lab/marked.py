"""
Marked tables and values: every experimental table in README.md, docs/course.md and RESULTS.md is
written by one function, its builder, from a committed data file alone, between two lines:

    <!-- table: NAME -->
    (the builder's text)
    <!-- end -->

and every number a sentence of the pages quotes from the data is a value, marked inside the
sentence (the words around it are the page's own, edited there):

    ... `stale` - `recompute` is <!--NAME-->-0.3 [-1.2, +0.6], cannot tell<!----> (5 seeds) ...

An experiment tool appends one JSON line per run (or per row of seeds, where it says so) to
lab/data/<tool>.jsonl, the data outliving the machine that ran it, and then rewrites every
block and value of its own in the pages. tests/test_marked.py rebuilds every block and value from
the data and fails on a digit that differs, so neither can drift from its data, nor a copy from its
original. A tool registers its tables with a TABLES dict and its values with a VALUES dict,
{NAME: builder}, each builder a function of no arguments that reads lab/data/<tool>.jsonl (a
value's: one short line); adding a tool is its name in TOOLS.

    .venv/bin/python lab/marked.py            # every marked block and value of the pages, and its builder's tool
    .venv/bin/python lab/marked.py --write    # rewrite every block and value from the data (what each tool does)
"""

import argparse
import importlib
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PAGES = ("README.md", "docs/course.md", "lab/RESULTS.md", "lab/frontier.md")
# lab/<name>.py, each with TABLES (and VALUES, if its numbers stand in sentences); its data is lab/data/<name>.jsonl
TOOLS = ("course", "stress", "frontier", "sweep", "study", "fidelity", "equivalence", "sitting", "walkthrough")
# a block: its opening line, its text (lines, possibly none), its closing line
BLOCK = re.compile(r"^<!-- table: ([\w.-]+) -->\n(.*?)^<!-- end -->$", re.M | re.S)
# a value: its name in an HTML comment, its text (within one line), an empty comment (short: the README counts them)
VALUE = re.compile(r"<!--([\w.]+(?:-[\w.]+)*)-->(.*?)<!---->")


def blocks(text):
    """[(name, its text)] for every marked block of a page's text, in order."""
    return [(m.group(1), m.group(2).removesuffix("\n")) for m in BLOCK.finditer(text)]


def values(text):
    """[(name, its text)] for every marked value of a page's text, in order."""
    return [(m.group(1), m.group(2)) for m in VALUE.finditer(text)]


def replace(text, name, body):
    """The page's text with every block called `name` holding `body` (KeyError if there is none)."""
    if name not in [b for b, _ in blocks(text)]:
        raise KeyError(f"no block '{name}' in this page")
    return BLOCK.sub(
        lambda m: m.group(0) if m.group(1) != name else f"<!-- table: {name} -->\n{body}\n<!-- end -->", text
    )


def replace_value(text, name, body):
    """The page's text with every value called `name` reading `body`, one short line (ValueError otherwise)."""
    if "\n" in body or "<!--" in body:
        raise ValueError(f"value '{name}' must be one line without a comment: {body!r}")
    return VALUE.sub(lambda m: m.group(0) if m.group(1) != name else f"<!--{name}-->{body}<!---->", text)


def data_path(tool):
    return os.path.join(ROOT, "lab", "data", f"{tool}.jsonl")


def read(tool):
    """The tool's committed lines, oldest first (a builder takes the last line for each run)."""
    path = data_path(tool)
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def append(tool, line):
    """One run's (or one row's) summary onto lab/data/<tool>.jsonl."""
    os.makedirs(os.path.dirname(data_path(tool)), exist_ok=True)
    with open(data_path(tool), "a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")


def registry(kind="TABLES"):
    """NAME -> (tool, builder) of every tool in TOOLS, its TABLES or its VALUES (a name registered twice,
    as tables or values, is an error)."""
    out, seen = {}, {}
    for tool in TOOLS:
        module = importlib.import_module(tool)
        for k in ("TABLES", "VALUES"):
            for name, build in getattr(module, k, {}).items():
                if name in seen:
                    raise ValueError(f"'{name}' registered by {seen[name]} and {tool}")
                seen[name] = tool
                if k == kind:
                    out[name] = (tool, build)
    return out


def record(tool, line, key):
    """Append `line` to lab/data/<tool>.jsonl unless the last line with the same values of the fields
    `key` says the same already (every field but "source"): a second pass over the same runs adds nothing."""
    line = json.loads(json.dumps(line))  # as it reads back: tuples become lists
    same = [s for s in read(tool) if all(s.get(k) == line.get(k) for k in key)]
    if not same or {k: v for k, v in same[-1].items() if k != "source"} != line:
        append(tool, line)


def commit(tree=ROOT):
    """The checkout's commit (with "+" when files differ from it), for a line to say what code made its runs."""
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=tree, capture_output=True, text=True, check=True).stdout  # noqa: E731
        return run("rev-parse", "--short", "HEAD").strip() + (
            "+" if run("status", "--porcelain", "-uno").strip() else ""
        )
    except (OSError, subprocess.CalledProcessError):
        return None


def processor():
    """The processor a run ran on: its rows are byte-reproducible there, not on another one
    (vLLM's CPU kernels and torch's sums round differently; a different draw, as a seed is)."""
    first = open("/proc/cpuinfo").read().split("\n\n")[0]  # the first core's block
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    return f"{info.get('vendor_id', '?')} family {info.get('cpu family', '?')} model {info.get('model', '?')}"


def builders(kind="TABLES"):
    """NAME -> builder, over every tool in TOOLS: the tables' ("TABLES") or the values' ("VALUES")."""
    return {name: build for name, (_, build) in registry(kind).items()}


def write(tables, values=None, pages=PAGES, root=ROOT):
    """Rewrite every block of `tables` and every value of `values` ({NAME: builder}) in the pages;
    returns [(page, NAME)] written."""
    done, values = [], values or {}
    for page in pages:
        path = os.path.join(root, page)
        text = open(path).read()
        new = text
        for name, _ in blocks(text):
            if name in tables:
                new = replace(new, name, tables[name]())
                done.append((page, name))
        for name in dict.fromkeys(name for name, _ in VALUE.findall(new) if name in values):
            new = replace_value(new, name, values[name]())
            done.append((page, name))
        if new != text:
            open(path, "w").write(new)
    return done


def differences(root=ROOT):
    """Every way the pages under `root` differ from the data: a block whose text is not its builder's
    (named with the first line that differs), a block with no builder, a builder with no block; and
    the same of values."""
    tables, seen, out = builders(), set(), []
    for page in PAGES:
        for name, body in blocks(open(os.path.join(root, page)).read()):
            seen.add(name)
            if name not in tables:
                out.append(f"{page}: table '{name}' has no builder (no tool's TABLES holds it)")
                continue
            built = tables[name]().splitlines()
            for i, (have, want) in enumerate(zip([*body.splitlines(), ""], [*built, ""])):
                if have != want:
                    out.append(
                        f"{page}: table '{name}', line {i + 1}: the page has\n  {have!r}\nthe data give\n  {want!r}"
                    )
                    break
            else:
                if len(body.splitlines()) != len(built):
                    out.append(f"{page}: table '{name}': {len(body.splitlines())} lines, the data give {len(built)}")
    out += [f"table '{name}' has a builder and no block in {', '.join(PAGES)}" for name in tables if name not in seen]
    quoted, seen = builders("VALUES"), set()
    for page in PAGES:
        for name, body in values(open(os.path.join(root, page)).read()):
            seen.add(name)
            if name not in quoted:
                out.append(f"{page}: value '{name}' has no builder (no tool's VALUES holds it)")
            elif body != (built := quoted[name]()):
                out.append(f"{page}: value '{name}': the page has {body!r}, the data give {built!r}")
    out += [f"value '{name}' has a builder and no place in {', '.join(PAGES)}" for name in quoted if name not in seen]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite every marked block and value from the committed data")
    args = p.parse_args()
    if args.write:
        for page, name in write(builders(), builders("VALUES")):
            print(f"{page}: {name}")
        return
    tables, quoted = registry(), registry("VALUES")
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        for name, body in blocks(text):
            owner = tables[name][0] if name in tables else "NO BUILDER"
            print(f"{page}: {name} ({len(body.splitlines())} lines; {owner})")
        for name, body in values(text):
            print(f"{page}: value {name} = {body!r} ({quoted[name][0] if name in quoted else 'NO BUILDER'})")


if __name__ == "__main__":
    main()
