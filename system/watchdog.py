"""
The generator's watchdog, on the trainer's side: how long an engine may stay silent, and what
the trainer reports when one dies, stalls, or never joins a push (GeneratorHandle holds one).
docs/reliability.md says what a user sees in each case.
"""

import os
import queue
import time

from system.generator import stack_file


class GeneratorDied(RuntimeError):
    pass


class Watchdog:
    """The engines' failure paths: every engine's death or stall becomes a GeneratorDied, returned for
    the caller to raise, that names the engine and carries its traceback or its Python stack."""

    def __init__(self, cfg, procs, samples_q, joined):
        """The engines' processes, the queue they send on, and the last push each joined (a shared int)."""
        self.cfg, self.procs, self.samples_q, self.joined = cfg, procs, samples_q, joined
        self.n = len(procs)
        self.last_seen = [time.time()] * self.n  # when each engine last sent anything (stall watchdog)
        self.last_msg, self.last_event = [(time.time(), "nothing yet")] * self.n, [None] * self.n
        self.stall_report = None  # what stop_stalled last said: a push it broke reports that (push_broke)

    def heard(self, i, kind, item):
        """Engine i sent (kind, item): it is alive; what it sent last, and its last event, go in a stall's report."""
        self.last_seen[i] = time.time()
        if kind == "alive":
            return
        self.last_msg[i] = (time.time(), kind)
        if kind == "event":
            self.last_event[i] = item

    def silent(self, bound):
        """The engines that have sent nothing for more than `bound` seconds."""
        return [i for i in range(self.n) if time.time() - self.last_seen[i] > bound]

    def late(self, version):
        """The engines that have not joined the push of `version`."""
        return [i for i in range(self.n) if self.joined[i].value < version]

    def name(self, i):
        return "generator" if self.n == 1 else f"generator engine {i}"

    def stall_bound(self, engine_stats):
        """Seconds an engine may stay silent before we call it stuck (--stall-s overrides), from each
        engine's last counters (`engine_stats`: its slowest recent step)."""
        if self.cfg.get("stall_s"):
            return self.cfg["stall_s"]
        # an answer ends within max_new_tokens steps: allow 3x that at the slowest recent step, +30 s of slack
        # (an idle engine says it is alive every second; evaluations allow a bound per wave; docs/reliability.md)
        slowest = max(s.get("max_step_s", 1.0) for s in engine_stats)  # 1 s until an engine has measured
        return 30 + 3 * self.cfg["max_new_tokens"] * slowest

    def died(self, i, how, errors=None):
        """The GeneratorDied of engine i, with the engine's own traceback when it sent one.
        With several engines, one engine's death breaks the others' weight group ("Connection
        closed by peer"), and they report that: an engine that died without a word (killed)
        is named as the cause before any engine that failed with a traceback."""
        self.procs[i].join(timeout=5)
        errors = dict(errors or {})
        while True:
            try:
                kind, item = self.samples_q.get(timeout=0.5)
            except queue.Empty:
                break
            except (EOFError, OSError):
                continue
            if kind == "error":
                errors.setdefault(item[0], item[1])
        silent = [j for j, p in enumerate(self.procs) if not p.is_alive() and j not in errors]
        if silent or not errors:
            j = i if i in silent or not silent else silent[0]
            then = f"; then {', '.join(self.name(k) for k in sorted(errors))} failed" if errors else ""
            return GeneratorDied(
                f"{self.name(j)} process died{how if j == i else ''} (exit code {self.procs[j].exitcode}){then}"
            )
        k = i if i in errors else min(errors)
        return GeneratorDied(f"{self.name(k)} process failed:\n" + errors[k])

    def stalled(self, silent_s, engines):
        """Engines alive but silent for `silent_s` seconds: stop them; the GeneratorDied with their
        last activity and Python stack."""
        return GeneratorDied(self.stop_stalled(silent_s, "silent", engines))

    def stop_stalled(self, silent_s, how, engines=None):
        """Ask each stuck engine for its Python stack (SIGUSR1, see generator_main), kill
        it, and return the report."""
        import signal

        reports = []
        for i in range(self.n) if engines is None else engines:
            path = stack_file(dict(self.cfg, engine=i))
            os.kill(self.procs[i].pid, signal.SIGUSR1)
            for _ in range(50):  # written from a signal handler: milliseconds, unless the process is frozen
                time.sleep(0.1)
                if os.path.exists(path) and os.path.getsize(path) > 0:
                    time.sleep(0.2)  # let every thread's stack land
                    break
            self.procs[i].kill()
            self.procs[i].join()
            with open(path) as f:
                stack = f.read().strip() or "(no stack: the process did not answer SIGUSR1)"
            now, e = time.time(), self.last_event[i]
            last = f"{e['what']} under v{e['version']}, {now - e['t']:.0f}s ago" if e else "no activity reported"
            reports.append(
                f"{self.name(i)} stalled: alive but {how} for {silent_s:.0f}s (last message, "
                f"{self.last_msg[i][1]}: {now - self.last_msg[i][0]:.0f}s ago; last activity it "
                f"reported: {last}); stopped it. Its Python stack ({path}):\n{stack}"
            )
        self.stall_report = "\n".join(reports)
        return self.stall_report

    def check_engines(self):
        """For wait(): raise once an engine process has exited (a dead peer never fails an NCCL
        collective; push_broke names it)."""
        if any(not p.is_alive() for p in self.procs):
            raise RuntimeError("an engine of the weight group exited")

    def push_stalled(self, silent_s, version, acknowledged):
        """The push watchdog (a timer thread of the push of `version`): the engines that have not
        joined it (they never reached the load: stuck, or still draining a stuck answer) are stopped,
        and named; if every engine joined, the push itself is stuck, and all are. A push whose
        acknowledgement is in (acknowledged()) is not stuck, however long the trainer takes to settle it."""
        if acknowledged():
            return
        self.stop_stalled(silent_s, "not taking new weights", self.late(version) or None)

    def push_broke(self, e, how):
        """The error of a push whose broadcast broke with `e`: the push watchdog's report when it
        stopped engines (which broke it), else why a peer died (lost)."""
        if not self.stall_report:
            return self.lost(e, how)
        error = GeneratorDied(self.stall_report)
        error.__cause__ = None  # as `raise ... from None`: the broken collective says nothing more
        return error

    def lost(self, e, how):
        """A collective of the weight group failed with `e`: the error naming the engine that died
        (gloo fails the collective as the peer's socket closes, which may come before its exit shows:
        5 s for it), or, every engine alive, saying that the trainer's side failed, with its error."""
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        for _ in range(50):
            if dead := [i for i, p in enumerate(self.procs) if not p.is_alive()]:
                return self.died(dead[0], f"{how} ({why})")
            time.sleep(0.1)
        error = GeneratorDied(f"weight group error on the trainer's side{how}, every engine alive: {why}")
        error.__cause__ = e  # as `raise ... from e`
        return error
