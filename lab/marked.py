"""
Marked tables: every experimental table in README.md, docs/course.md and RESULTS.md is
written by one function, its builder, from a committed data file alone, between two lines:

    <!-- table: NAME -->
    (the builder's text)
    <!-- end -->

An experiment tool appends one JSON line per run (or per row of seeds, where it says so) to
lab/data/<tool>.jsonl, the data outliving the machine that ran it, and then rewrites every
block of its tables in the pages. tests/test_marked.py rebuilds every block from the data and
fails on a digit that differs, so a table cannot drift from its data, nor a copy from its
original. A tool registers its tables with a TABLES dict, {NAME: builder}, each builder a
function of no arguments that reads lab/data/<tool>.jsonl; adding a tool is its name in TOOLS.

    .venv/bin/python lab/marked.py            # every marked block of the pages, and its builder's tool
    .venv/bin/python lab/marked.py --write    # rewrite every block from the data (what each tool does)
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

PAGES = ("README.md", "docs/course.md", "lab/RESULTS.md")
# tools/<name>.py (lab/study.py: at the root), each with TABLES; its data is lab/data/<name>.jsonl
TOOLS = ("course", "stress", "frontier", "sweep", "study")
# a block: its opening line, its text (lines, possibly none), its closing line
BLOCK = re.compile(r"^<!-- table: ([\w.-]+) -->\n(.*?)^<!-- end -->$", re.M | re.S)


def blocks(text):
    """[(name, its text)] for every marked block of a page's text, in order."""
    return [(m.group(1), m.group(2).removesuffix("\n")) for m in BLOCK.finditer(text)]


def replace(text, name, body):
    """The page's text with every block called `name` holding `body` (KeyError if there is none)."""
    if name not in [b for b, _ in blocks(text)]:
        raise KeyError(f"no block '{name}' in this page")
    return BLOCK.sub(
        lambda m: m.group(0) if m.group(1) != name else f"<!-- table: {name} -->\n{body}\n<!-- end -->", text
    )


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


def registry():
    """NAME -> (tool, builder), over every tool in TOOLS (a name registered twice is an error)."""
    out = {}
    for tool in TOOLS:
        for name, build in importlib.import_module(tool).TABLES.items():
            if name in out:
                raise ValueError(f"table '{name}' registered by {out[name][0]} and {tool}")
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


def builders():
    """NAME -> builder, over every tool in TOOLS."""
    return {name: build for name, (_, build) in registry().items()}


def write(tables, pages=PAGES, root=ROOT):
    """Rewrite every block of `tables` ({NAME: builder}) in the pages; returns [(page, NAME)] written."""
    done = []
    for page in pages:
        path = os.path.join(root, page)
        text = open(path).read()
        new = text
        for name, _ in blocks(text):
            if name in tables:
                new = replace(new, name, tables[name]())
                done.append((page, name))
        if new != text:
            open(path, "w").write(new)
    return done


def differences(root=ROOT):
    """Every way the pages under `root` differ from the data: a block whose text is not its builder's
    (named with the first line that differs), a block with no builder, a builder with no block."""
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
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite every marked block from the committed data")
    args = p.parse_args()
    if args.write:
        for page, name in write(builders()):
            print(f"{page}: {name}")
        return
    registered = registry()
    for page in PAGES:
        for name, body in blocks(open(os.path.join(ROOT, page)).read()):
            owner = registered[name][0] if name in registered else "NO BUILDER"
            print(f"{page}: {name} ({len(body.splitlines())} lines; {owner})")


if __name__ == "__main__":
    main()
