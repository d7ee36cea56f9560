"""
Rewards: score(completion, answer, task) is 1.0 when the completion's final answer is right, else 0.0,
by the check the task names (data.TASKS, CHECKS here): "number" (synth, gsm8k) compares the final
number as a decimal, "latex" (math) the last \\boxed{} by math-verify's symbolic equivalence. Any
completion gives 0.0 or 1.0, never an exception or a hang; an unknown task is a UsageError.

reward(...) is what the trainer pays: score(), or format_weight for a wrong answer whose last \\boxed{}
holds an answer (DeepSeek-R1's format reward, --format-reward), and 0 for an answer cut off at the
length cap, which never finished (--truncated). grade and scored turn scores into pass@1 for both
trainers and eval.py.
"""

import ctypes
import re
import threading
from decimal import Decimal, InvalidOperation
from itertools import accumulate
from typing import Callable, NamedTuple

import sympy
from math_verify import LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

import data
from data import UsageError, last_boxed

NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
TIMEOUT_S = 5.0  # per math answer (math-verify's default); real answers take milliseconds


def final_number(text):
    """The answer's number: after the last "####", else in the last \\boxed{}, else the last one."""
    if "####" in text:
        part = text.rsplit("####", 1)[1]
    elif (box := last_boxed(text)) is not None:  # the box is final, as in Qwen2.5-Math's grader and open-r1's:
        part = box  # an empty box, or one without a number, is no answer, not a cue to look elsewhere
    else:  # lm-eval's "flexible-extract"
        found = NUMBER.findall(text)
        return found[-1] if found else None
    m = NUMBER.search(part)
    return m.group() if m else None


def normalise(s):
    """Without commas, "$", "%", whitespace and a trailing ".", as a decimal when it parses: "1,234" == "1234"."""
    s = s.replace(",", "").replace("$", "").replace("%", "").strip().rstrip(".")
    try:
        d = Decimal(s)  # numeric compare: "12.00" == "12"
        return d if d.is_finite() else s  # NaN equals nothing, sNaN even raises on ==
    except InvalidOperation:
        return s


def number_is_right(completion, answer):
    """The completion's final number (final_number) equals the reference (gsm8k's text after "#### ")."""
    pred = final_number(completion)
    return float(pred is not None and normalise(pred) == normalise(answer))


def grows(n):  # a power / factorial with a numeric exponent / argument beyond +-1 (so not 1/x or sqrt)
    k = n.args[-1] if isinstance(n, (sympy.Pow, sympy.factorial, sympy.factorial2, sympy.subfactorial)) else sympy.S.One
    return k.is_number and not (k.is_Number and abs(k) <= 1)


def too_big(exprs):
    # verify() has sympy compute numbers exactly: 10^{10^{10}} or 10^8! is one endless C-level bigint op
    # that no timeout can interrupt, so allow only literal exponents / factorials <= 1000, not nested
    for n in (n for e in exprs if isinstance(e, sympy.Basic) for n in sympy.preorder_traversal(e)):
        if (
            isinstance(n, (sympy.Sum, sympy.Product))
            or grows(n)
            and (
                not (n.args[-1].is_Number and abs(n.args[-1]) <= 1000)
                or any(map(grows, sympy.preorder_traversal(n.args[0])))
            )
        ):
            return True
    return False


def check_math(box, answer):
    # timeouts off (None): math-verify's own timeout is signal.alarm, which only works in the main thread
    # (elsewhere parse/verify raise ValueError) and would clobber a trainer's SIGALRM; run_with_timeout replaces it
    gold = parse("\\boxed{" + answer + "}", [LatexExtractionConfig()], parsing_timeout=None)
    pred = parse("\\boxed{" + box + "}", [LatexExtractionConfig()], parsing_timeout=None)
    return 0.0 if too_big(gold) or too_big(pred) else float(verify(gold, pred, timeout_seconds=None))


def run_with_timeout(fn, seconds):
    # fn() in a worker thread; past the deadline raise TimeoutException in it at its next bytecode (what
    # signal.alarm does, in any thread), a few times as math-verify catches it per step. a worker stuck
    # in a single C call is abandoned: the caller gets 0.0 either way. any error inside is a 0.0 too.
    out = []

    def work():
        try:
            out.append(fn())
        except (Exception, TimeoutException):
            pass

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(seconds)
    for _ in range(10):
        if not t.is_alive():
            break
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(TimeoutException))
        t.join(0.1)
    return out[0] if out else 0.0


def latex_is_right(completion, answer):
    """The content of the last \\boxed{} against the reference LaTeX (MATH-500's `answer`), by math-verify's
    symbolic/numeric equivalence: 0.5 == \\frac12 == \\frac{1}{2}. No box, no reward."""
    box = last_boxed(completion)
    # math-verify's ANTLR parser is exponential on some short nested inputs (\boxed{{{{...}}}}), so
    # only hand it a short, shallow box; the timeout covers the rest (e.g. \boxed{x^x^x^...})
    if box is None or len(box) > 300 or max(accumulate((c in "{([") - (c in "})]") for c in box), default=0) > 10:
        return 0.0
    return run_with_timeout(lambda: check_math(box, answer), TIMEOUT_S)


class Check(NamedTuple):
    """How a task's answers are checked: a row of CHECKS, which data.TASKS' rows name."""

    right: Callable  # (completion, answer) -> 1.0 if the answer is right, else 0.0
    boxed: Callable  # (the last \boxed{}'s content) -> whether it holds an answer (the format reward)


CHECKS = {  # a task's `check` (data.TASKS): a new way to check answers is a function and a row here
    "number": Check(number_is_right, boxed=lambda box: bool(NUMBER.search(box))),
    "latex": Check(latex_is_right, boxed=lambda box: bool(box.strip())),
}


def check(name):
    """The check task `name` names (data.TASKS, CHECKS): a UsageError for an unknown task or check."""
    if (c := data.task(name).check) not in CHECKS:
        raise UsageError(f"task {name!r} is checked by {c!r}, which is not in reward.CHECKS ({', '.join(CHECKS)})")
    return CHECKS[c]


def score(completion, answer, task):
    return check(task).right(completion, answer)


def boxed_answer(completion, task):
    """Whether the last \\boxed{} holds an answer, as the task's check reads one (a number, any text)."""
    box = last_boxed(completion)
    return box is not None and check(task).boxed(box)


def reward(completion, answer, task, format_weight=0.0, truncated=False):
    if truncated:
        return 0.0
    return max(score(completion, answer, task), format_weight * boxed_answer(completion, task))


def grade(completions, problems, task, truncated=None):
    """1.0 for each problem answered right, else 0.0; an answer cut at the length cap (truncated) is wrong."""
    truncated = truncated or [False] * len(completions)
    return [score(c, p["answer"], task) * (not cut) for c, p, cut in zip(completions, problems, truncated)]


def scored(answers, tokenizer, problems, task, log, step, version):
    """An evaluation of both trainers: greedy answers, (token ids, finish reason) per test
    problem in order, graded (one cut at the length cap is wrong) and kept in
    eval_answers.jsonl (runlog.RunLog.evaluation); returns the step's eval metrics."""
    texts = tokenizer.batch_decode([ids for ids, _ in answers], skip_special_tokens=True)
    cut = [reason == "length" for _, reason in answers]
    right = grade(texts, problems, task, cut)
    log.evaluation(step, version, texts, problems, cut, right)
    return dict(eval_acc=sum(right) / max(1, len(problems)), eval_truncated_frac=sum(cut) / len(cut))
