"""
Endurance (a soak test): does either process's memory grow over a long run? train.py with the tiny
model for --steps steps without evaluation, sampling the resident memory (RSS) of
the trainer and of the generator every --every seconds. Not a test (it takes
~20 min on 2 CPU cores); the README has its numbers.

    python tools/endurance.py                            # 1,000 steps, the synth defaults
    python tools/endurance.py --steps 300 -- --regime stale  # flags after -- go to train.py

Prints both RSS every 100 steps, then the growth per 100 steps: the least-squares
slope over the samples from step 100 on (the first steps fill caches and the
allocator's pools; that is start-up, not a leak). Samples go to <run>/endurance.jsonl.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the lesson's modules (train, generator, ...), wherever this is run from

import psutil  # noqa: E402  (after the path, as the other imports)


def generator_of(trainer):
    """The spawned generator: the trainer's child holding the most memory (the
    other child is multiprocessing's small resource tracker)."""
    kids = []
    for c in trainer.children():
        try:
            kids.append((c.memory_info().rss, c))
        except psutil.NoSuchProcess:
            pass
    return max(kids, key=lambda k: k[0])[1] if kids else None


def slope_per_100(points):
    """Least-squares slope of (step, MiB) points, in MiB per 100 steps."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    return 100 * sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--every", type=float, default=2.0, help="seconds between memory samples")
    p.add_argument("--out", default=None, help="run directory (default: out/endurance-<time>)")
    p.add_argument("train_args", nargs="*", help="more train.py flags, after --")
    args = p.parse_args()
    # stop cleanly on Ctrl-C or `kill`, even when started in the background (which ignores SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    run = args.out or os.path.join("out", f"endurance-{time.strftime('%m%d-%H%M%S')}")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--steps",
        str(args.steps),
        "--eval-every",
        "0",
        "--no-plot",
        "--out",
        run,
        *args.train_args,
    ]
    print(" ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    step = [0]

    def follow():  # the trainer prints "step N | ..." once per step
        for line in proc.stdout:
            if line.startswith("step "):
                step[0] = int(line.split()[1])
                if step[0] % 100 == 0:
                    print(line.rstrip()[:120], flush=True)

    threading.Thread(target=follow, daemon=True).start()
    trainer, gen, samples, t0 = psutil.Process(proc.pid), None, [], time.time()
    try:
        while proc.poll() is None:
            time.sleep(args.every)
            if step[0] == 0:  # before the first step: model loading, engine start
                continue
            if step[0] >= args.steps:  # the last step: saving, then both processes tear down
                break
            gen = gen or generator_of(trainer)  # once: the same process from then on
            if gen is None:
                continue
            if not gen.is_running():
                break
            try:
                s = dict(
                    step=step[0],
                    t=round(time.time() - t0, 1),
                    trainer_mib=trainer.memory_info().rss / 2**20,
                    generator_mib=gen.memory_info().rss / 2**20,
                )
            except psutil.NoSuchProcess:
                break
            if samples and s["step"] // 100 > samples[-1]["step"] // 100:
                print(
                    f"  step {s['step']}: trainer {s['trainer_mib']:.0f} MiB, generator {s['generator_mib']:.0f} MiB",
                    flush=True,
                )
            samples.append(s)
    except KeyboardInterrupt:
        proc.terminate()
    proc.wait()
    if not samples:
        sys.exit(f"endurance.py: no step finished (train.py exit code {proc.returncode})")
    with open(os.path.join(run, "endurance.jsonl"), "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    later = [s for s in samples if s["step"] >= 100] or samples
    print(
        f"train.py exit code {proc.returncode}; {len(samples)} samples, steps {samples[0]['step']}-"
        f"{samples[-1]['step']}, {samples[-1]['t']:.0f} s; samples in {run}/endurance.jsonl"
    )
    for who in ("trainer", "generator"):
        first, last = later[0][f"{who}_mib"], later[-1][f"{who}_mib"]
        growth = slope_per_100([(s["step"], s[f"{who}_mib"]) for s in later])
        print(
            f"{who}: {first:.0f} MiB at step {later[0]['step']} -> {last:.0f} MiB at step {later[-1]['step']}; "
            f"growth {growth:+.2f} MiB per 100 steps (least squares, from step {later[0]['step']})"
        )


if __name__ == "__main__":
    main()
