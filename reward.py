"""
Rewards: score(completion, answer, dataset) is 1.0 when the completion's final answer is right, else 0.0.

- synth / gsm8k: the model's answer is the first number after the last "####"; else, if there is a
  \\boxed{...}, the number in the last one (the box is final, as in Qwen2.5-Math's grader and
  open-r1's: an empty box, or one without a number, is no answer, not a cue to look elsewhere);
  else the last number in the text (lm-eval's "flexible-extract"). It and the reference (gsm8k's text after
  "#### ", e.g. "72" or "1,000") lose commas, "$", "%", whitespace and a trailing "." and compare
  as decimals when both parse: "1,234" == "1234", "12.0" == "12", "$-3." == "-3".
- math: the content of the last \\boxed{...} against the reference LaTeX (MATH-500's `answer`), by
  math-verify's symbolic/numeric equivalence: 0.5 == \\frac12 == \\frac{1}{2}. No box, no reward.

grade and scored turn scores into pass@1: an evaluation's answers graded (one cut at the
length cap is wrong) for both trainers and eval.py.

Any completion text gives 0.0 or 1.0, never an exception or a hang (an unknown dataset is a ValueError).

reward(..., format_weight=w, truncated=False) is what the trainer uses: score(), except that a wrong
answer whose last \\boxed{} holds an answer (a number for synth/gsm8k, anything for math) earns w
(DeepSeek-R1's format reward; train.py --format-reward, default 0, so reward == score), and an
answer cut off at the length cap earns 0 whatever it says: it never finished, so a number in it is
not its answer (train.py --truncated).
"""

import ctypes
import re
import threading
from decimal import Decimal, InvalidOperation
from itertools import accumulate

import sympy
from math_verify import LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

from data import last_boxed

NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
TIMEOUT_S = 5.0  # per math answer (math-verify's default); real answers take milliseconds


def final_number(text):
    """The answer's number: after the last "####", else in the last \\boxed{}, else the last one."""
    if "####" in text:
        part = text.rsplit("####", 1)[1]
    elif (box := last_boxed(text)) is not None:
        part = box
    else:
        found = NUMBER.findall(text)
        return found[-1] if found else None
    m = NUMBER.search(part)
    return m.group() if m else None


def normalise(s):
    s = s.replace(",", "").replace("$", "").replace("%", "").strip().rstrip(".")
    try:
        d = Decimal(s)  # numeric compare: "12.00" == "12"
        return d if d.is_finite() else s  # NaN equals nothing, sNaN even raises on ==
    except InvalidOperation:
        return s


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


def score(completion, answer, dataset):
    if dataset in ("synth", "gsm8k"):
        pred = final_number(completion)
        return float(pred is not None and normalise(pred) == normalise(answer))
    if dataset == "math":
        box = last_boxed(completion)
        # math-verify's ANTLR parser is exponential on some short nested inputs (\boxed{{{{...}}}}), so
        # only hand it a short, shallow box; the timeout covers the rest (e.g. \boxed{x^x^x^...})
        if box is None or len(box) > 300 or max(accumulate((c in "{([") - (c in "})]") for c in box), default=0) > 10:
            return 0.0
        return run_with_timeout(lambda: check_math(box, answer), TIMEOUT_S)
    raise ValueError(f"unknown dataset {dataset!r}, expected synth, gsm8k or math")


def boxed_answer(completion, dataset):
    """Whether the last \\boxed{} holds an answer: a number (synth, gsm8k) or any text (math)."""
    box = last_boxed(completion)
    return box is not None and (bool(box.strip()) if dataset == "math" else bool(NUMBER.search(box)))


def reward(completion, answer, dataset, format_weight=0.0, truncated=False):
    if truncated:
        return 0.0
    return max(score(completion, answer, dataset), format_weight * boxed_answer(completion, dataset))


def grade(completions, problems, dataset, truncated=None):
    """1.0 for each problem answered right, else 0.0; an answer cut at the length cap (truncated) is wrong."""
    truncated = truncated or [False] * len(completions)
    return [score(c, p["answer"], dataset) * (not cut) for c, p, cut in zip(completions, problems, truncated)]


def scored(answers, tokenizer, problems, dataset, log, step, version):
    """An evaluation of both trainers: greedy answers, (token ids, finish reason) per test
    problem in order, graded (one cut at the length cap is wrong) and kept in
    eval_answers.jsonl (runlog.RunLog.evaluation); returns the step's eval metrics."""
    texts = tokenizer.batch_decode([ids for ids, _ in answers], skip_special_tokens=True)
    cut = [reason == "length" for _, reason in answers]
    right = grade(texts, problems, dataset, cut)
    log.evaluation(step, version, texts, problems, cut, right)
    return dict(eval_acc=sum(right) / max(1, len(problems)), eval_truncated_frac=sum(cut) / len(cut))
