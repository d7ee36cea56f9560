# tests for reward.py. run: python -m pytest -q tests/test_reward.py  (a few seconds on 2 CPU cores)
import json
import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import reward
from data import TASKS, UsageError, to_problem
from reward import score

pytestmark = pytest.mark.fast  # the tier to run after an edit (tests/conftest.py): ~20 s

DATASETS = list(TASKS)  # every task, each checked as its row says (reward.CHECKS)
PROPS = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])

# -----------------------------------------------------------------------------
# synth / gsm8k


@pytest.mark.parametrize("dataset", ["synth", "gsm8k"])
@pytest.mark.parametrize(
    "completion",
    [
        "3 + 4 = 7 #### 7 so \\boxed{8} and finally 9",  # "####" beats boxed and the last number
        "#### 1\n... #### 7 is my answer, not 9",  # the last "####"
        "3 + 4 = 7, so \\boxed{7}. Check: 9 - 2 = 5",  # boxed beats the last number
        "\\boxed{2} first, then \\boxed{7}, then 9",  # the last box
        "3 + 4 = 7",  # else the last number
        "####\n\nthe total is 7 apples, 9 minus 2",  # "####" then text: first number after it
    ],
)
def test_extraction_order(completion, dataset):
    assert score(completion, "7", dataset) == 1.0
    assert score(completion, "9", dataset) == 0.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("#### 1,234", "1234"),
        ("#### 1234", "1,234"),
        ("#### $1,000", "1000"),
        ("#### 1000", "$1,000"),
        ("#### 50%", "50"),
        ("#### 72.", "72"),
        ("#### 12.0", "12"),
        ("#### 12", "12.00"),
        ("#### 12.50", "12.5"),
        ("#### -3", "-3"),
        ("#### -3.0", "-3"),
        ("#### $-3", "-3"),
        ("#### 72", "  72\n"),
        ("\\boxed{\\$1,234.00}", "1234"),
        ("so 5 + 2 = 7.", "7"),
        ("#### " + "9" * 5000, "9" * 5000),
    ],
)
def test_normalisation(completion, answer):
    assert score(completion, answer, "gsm8k") == 1.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("#### 72", "73"),
        ("#### -3", "3"),
        ("#### 3", "-3"),
        ("#### 12.5", "12"),
        ("#### 1,234", "123"),
        ("#### 0.1", "1"),
        ("no numbers here", "7"),
        ("", "7"),
        ("#### 72", ""),
        ("#### 72", "seventy-two"),
        ("#### 7", "NaN"),
        ("#### 7", "sNaN"),
        ("#### " + "9" * 5000, "9" * 4999),
    ],
)
def test_wrong_answers(completion, answer):
    assert score(completion, answer, "gsm8k") == 0.0
    assert score(completion, answer, "synth") == 0.0


@pytest.mark.parametrize("dataset", DATASETS)
def test_format_reward(dataset):
    right, boxed_wrong, plain_wrong = "so \\boxed{7}", "so \\boxed{8}", "so 8"
    for w in (0.0, 0.3):
        assert reward.reward(right, "7", dataset, w) == 1.0  # a right answer earns 1 whatever w
        assert reward.reward(boxed_wrong, "7", dataset, w) == w  # a wrong one in a box: w
        assert reward.reward(plain_wrong, "7", dataset, w) == 0.0
    assert reward.reward("7", "7", "synth", 0.3) == 1.0  # synth needs no box to be right


HACK = "Sam has 16 + 6 = 22 books.\n\nWithin \\boxed{} within \\mathscr{SMLOM} within"  # smol's demo, trained


@pytest.mark.parametrize("dataset", ["synth", "gsm8k"])
def test_a_box_is_final(dataset):
    """The smol demo's reward hack: an empty box, the right number outside it. A box
    without a number is no answer (it used to fall back to the text's last number)."""
    assert score(HACK, "22", dataset) == 0.0
    assert score("22 so \\boxed{twenty-two}", "22", dataset) == 0.0
    assert score("16 + 6 = 22 so \\boxed{22}", "22", dataset) == 1.0


@pytest.mark.parametrize("dataset", DATASETS)
def test_format_reward_needs_an_answer_in_the_box(dataset):
    for empty in ("\\boxed{}", "\\boxed{ }", HACK):
        assert reward.reward(empty, "7", dataset, 0.5) == 0.0
    assert reward.reward("\\boxed{8}", "7", dataset, 0.5) == 0.5
    assert reward.reward("\\boxed{x}", "7", dataset, 0.5) == (0.5 if dataset == "math" else 0.0)


@pytest.mark.parametrize("dataset", DATASETS)
def test_truncated_answers_earn_nothing(dataset):
    for w in (0.0, 0.5):
        assert reward.reward("\\boxed{7}", "7", dataset, w, truncated=True) == 0.0
        assert reward.reward("\\boxed{7}", "7", dataset, w, truncated=False) == 1.0


def test_unknown_dataset():
    """A task nothing knows is refused by name, never read as a default (boxed_answer once read it as a number)."""
    for check in (lambda: score("#### 1", "1", "gsm8k_typo"), lambda: reward.boxed_answer("\\boxed{1}", "gsm8k_typo")):
        with pytest.raises(UsageError, match="unknown task .*'gsm8k_typo'.*synth, gsm8k, math"):
            check()


# -----------------------------------------------------------------------------
# math


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("so the answer is $\\boxed{\\frac{1}{2}}$.", "0.5"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\frac12}", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12"),
        ("\\boxed{3}", "3"),
        ("\\boxed{3.0}", "3"),
        ("\\boxed{2}\\dots\\boxed{3}", "3"),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}"),
        ("\\boxed{x^2+2x}", "2x + x^2"),
        ("\\boxed{[-2, 7]}", "[-2,7]"),
        ("\\boxed{(3, \\infty)}", "(3,\\infty)"),
        ("\\boxed{\\frac{5\\pi}{6}}", "\\frac{5\\pi}{6}"),
        ("\\boxed{1,000}", "1000"),
    ],
)
def test_math_equivalent(completion, answer):
    assert score(completion, answer, "math") == 1.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("\\boxed{4}", "3"),
        ("\\boxed{\\frac{1}{3}}", "0.5"),
        ("\\boxed{[-2, 7)}", "[-2,7]"),
        ("\\boxed{x^2-2x}", "x^2+2x"),
        ("\\boxed{3}\\dots\\boxed{2}", "3"),
        ("the answer is 3", "3"),
        ("\\boxed{3", "3"),
        ("\\boxed{}", "3"),
        ("\\boxed{3}", ""),
    ],
)
def test_math_wrong(completion, answer):
    assert score(completion, answer, "math") == 0.0


def test_math_in_thread():
    # math-verify's default timeout is signal.alarm, which raises off the main thread (this test
    # fails if reward.py drops parsing_timeout=None / timeout_seconds=None)
    out = []
    t = threading.Thread(
        target=lambda: out.append([score("\\boxed{\\frac{1}{2}}", "0.5", "math"), score("\\boxed{3}", "4", "math")])
    )
    t.start()
    t.join(30)
    assert out == [[1.0, 0.0]]


@pytest.mark.parametrize(
    "box", ["10^{10^{10}}", "9^{9^{9^{9}}}", "1000000!", "{{10^{1000}}^{1000}}^{1000}", "\\prod_{i=1}^{10^{9}} i"]
)
def test_math_huge_numbers(box):
    # sympy would compute these exactly (endless, uninterruptible): refused before verify
    t0 = time.time()
    assert score(f"\\boxed{{{box}}}", "3", "math") == 0.0
    assert time.time() - t0 < 2


def test_math_timeout(monkeypatch):
    # an input math-verify's ANTLR parser takes exponential time on: cut off at TIMEOUT_S
    monkeypatch.setattr(reward, "TIMEOUT_S", 0.5)
    t0 = time.time()
    assert score("\\boxed{" + "x^" * 30 + "x}", "3", "math") == 0.0
    assert time.time() - t0 < 3
    t0 = time.time()
    assert reward.run_with_timeout(lambda: next(x for x in iter(int, 1) if x), 0.2) == 0.0  # endless python loop
    assert time.time() - t0 < 2


# -----------------------------------------------------------------------------
# robustness: any text gives 0.0 or 1.0, never raises, never hangs

PATHOLOGICAL = [
    "9" * 20000,
    "#### " + "9" * 20000,
    "1," * 10000,
    "-" * 20000 + "1",
    "." * 20000,
    "####" * 5000,
    "\\boxed{" * 3000,
    "\\boxed{" + "{" * 10000 + "}" * 10000 + "}",
    "\\boxed{" + "1" * 20000 + "}",
    "\\boxed{" + "(" * 150 + ")" * 150 + "}",
    "\\boxed{" + "\\frac{1}{" * 30 + "2" + "}" * 31,
    "\\boxed{" + "\\left|" * 40 + "1" + "\\right|" * 40 + "}",
    ("\\boxed{1}" + "x" * 100) * 180,
    "}" * 20000 + "\\boxed{",
]


@pytest.mark.parametrize("dataset", DATASETS)
def test_pathological_fast(dataset):
    for text in PATHOLOGICAL:
        for answer in ["3", text]:
            t0 = time.time()
            assert score(text, answer, dataset) in (0.0, 1.0)
            assert time.time() - t0 < 5, (text[:40], dataset)


latex = st.lists(
    st.sampled_from(
        [
            "\\boxed{",
            "{",
            "}",
            "(",
            ")",
            "[",
            "]",
            "####",
            "\\frac",
            "\\sqrt",
            "^",
            "_",
            "!",
            "\\left(",
            "\\right)",
            "\\infty",
            "\\cup",
            "\\pi",
            "x",
            "1",
            "-",
            ",",
            ".",
            "$",
            "%",
            " ",
            "\\$",
            "\\text{",
            "\\\\",
            "=",
            "9" * 40,
            "\\begin{pmatrix}",
            "&",
        ]
    ),
    max_size=40,
).map("".join)
weird = st.text(
    st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=["Cs"]), max_size=200
)
texts = st.one_of(st.text(), weird, latex, latex.map(lambda s: "\\boxed{" + s + "}"))


@PROPS
@given(texts, st.one_of(st.text(max_size=20), latex, st.integers().map(str)), st.sampled_from(DATASETS))
def test_any_text(completion, answer, dataset):
    assert score(completion, answer, dataset) in (0.0, 1.0)


@PROPS
@given(st.text(), st.integers(), st.sampled_from(["synth", "gsm8k"]))
def test_hashes_property(prefix, n, dataset):
    assert score(f"{prefix}\n#### {n}", str(n), dataset) == 1.0
    assert score(f"{prefix}\n#### {n:,}", str(n), dataset) == 1.0
    assert score(f"{prefix}\n#### {n}", str(n + 1), dataset) == 0.0


# -----------------------------------------------------------------------------
# fixtures: each reference solution scores 1.0 against its own answer (checks fixtures and parser)


@pytest.mark.parametrize("dataset, key", [("gsm8k", "answer"), ("math", "solution")])
def test_fixtures(dataset, key):
    with open(os.path.join("fixtures", f"{dataset}.jsonl")) as f:  # tests run from the root (conftest.py)
        rows = [json.loads(line) for line in f]
    assert len(rows) >= 8
    for row in rows:
        assert score(row[key], to_problem(row, dataset)["answer"], dataset) == 1.0, row


def test_synth_lengths():
    """--synth-steps S keeps the problems every README number was measured on (the
    seed formula since the start); A-B is long-tailed, P(s) ~ 1/s, and its own stream."""
    import random
    import data

    rng = random.Random(data.SYNTH_SEEDS["test"] * 1000 + 2)
    assert data.synth_split("test", 50, "2") == [data.synth_problem(rng, 2) for _ in range(50)]
    assert data.synth_split("test", 50, 2) == data.synth_split("test", 50, "2")
    ops = [p["solution"].count("=") for p in data.synth_split("train", 4000, "1-12")]
    assert min(ops) == 1 and max(ops) == 12
    expect = sum(1 / s for s in (1, 2, 3)) / sum(1 / s for s in range(1, 13))  # 0.59
    assert abs(sum(o <= 3 for o in ops) / len(ops) - expect) < 0.03
    assert data.synth_split("train", 20, "1-12") == data.synth_split("train", 20, "1-12")
    for bad in ("0", "3-1", "1-17", "two", "1-2-3"):
        with pytest.raises(data.UsageError):
            data.steps_range(bad)
