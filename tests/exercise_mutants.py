"""
Wrong answers a student would plausibly write to each exercise (tools/exercise.py), as
(label, file, old, new): the project's answer with `old` (there once) replaced by `new`.
tests/test_exercises.py checks that each, on its own, fails at least one of CHEAP[exercise]:
graders of the exercise that take seconds, not a run. Not in a student's copy (`make`
leaves tests/ out): the `old` lines are the answers.
"""

MUTANTS = {
    "advantages": [
        ("biased std", "grpo.py", "r.std(1, keepdim=True)", "r.std(1, keepdim=True, unbiased=False)"),
        ("no +1e-4", "grpo.py", "/ (r.std(1, keepdim=True) + 1e-4)", "/ r.std(1, keepdim=True)"),
        ("+1e-4 after the division", "grpo.py", "/ (r.std(1, keepdim=True) + 1e-4)", "/ r.std(1, keepdim=True) + 1e-4"),
        ("the batch's mean", "grpo.py", "(r - r.mean(1, keepdim=True))", "(r - r.mean())"),
        ("the batch's std", "grpo.py", "(r.std(1, keepdim=True) + 1e-4)", "(r.std() + 1e-4)"),
        ("groups of 4", "grpo.py", "r = rewards.view(-1, group_size)", "r = rewards.view(-1, 4)"),
        ("transposed groups", "grpo.py", "r = rewards.view(-1, group_size)", "r = rewards.view(group_size, -1)"),
        ("sign flip", "grpo.py", "(r - r.mean(1, keepdim=True))", "(r.mean(1, keepdim=True) - r)"),
        ("returned in float64", "grpo.py", "+ 1e-4)).view(-1)\n", "+ 1e-4)).view(-1).double()\n"),
    ],
    "loss": [
        (
            "weight not detached",
            "losses.py",
            "ratio = torch.exp(logp.detach() - mu)\n    return -ratio.clamp",
            "ratio = torch.exp(logp - mu)\n    return -ratio.clamp",
        ),
        (
            "mu/pi",
            "losses.py",
            "ratio = torch.exp(logp.detach() - mu)\n    return -ratio.clamp",
            "ratio = torch.exp(mu - logp.detach())\n    return -ratio.clamp",
        ),
        (
            "pi_old for mu",
            "losses.py",
            "ratio = torch.exp(logp.detach() - mu)\n    return -ratio.clamp",
            "ratio = torch.exp(logp.detach() - old)\n    return -ratio.clamp",
        ),
        ("no cap", "losses.py", '-ratio.clamp(max=cfg["is_cap"]) * adv * logp', "-ratio * adv * logp"),
        (
            "capped from below",
            "losses.py",
            '-ratio.clamp(max=cfg["is_cap"]) * adv * logp',
            '-ratio.clamp(min=cfg["is_cap"]) * adv * logp',
        ),
        (
            "sign flip",
            "losses.py",
            '-ratio.clamp(max=cfg["is_cap"]) * adv * logp',
            'ratio.clamp(max=cfg["is_cap"]) * adv * logp',
        ),
        (
            "no log pi",
            "losses.py",
            '-ratio.clamp(max=cfg["is_cap"]) * adv * logp',
            '-ratio.clamp(max=cfg["is_cap"]) * adv * logp.exp()',
        ),
        ("capped tokens not reported", "losses.py", 'ratio > cfg["is_cap"]', "ratio < 0"),
    ],
    "correction": [
        (
            "ppo without its clip",
            "losses.py",
            'surrogate, clipped = ppo_clip(logp, old, adv, cfg["clip_eps"])\n    k = (old - mu).exp()',
            "surrogate, clipped = -(logp - old).exp() * adv, adv != adv\n    k = (old - mu).exp()",
        ),
        ("k = mu/pi_old", "losses.py", "k = (old - mu).exp()", "k = (mu - old).exp()"),
        ("k = pi/mu", "losses.py", "k = (old - mu).exp()", "k = (logp.detach() - mu).exp()"),
        ("k not applied", "losses.py", "return k * keep * surrogate", "return keep * surrogate"),
        (
            "clamped, not masked",
            "losses.py",
            "return k * keep * surrogate",
            'return k.clamp(cfg["icepop_low"], cfg["icepop_high"]) * surrogate',
        ),
        (
            "masked tokens not reported",
            "losses.py",
            "return k * keep * surrogate, clipped | ~keep",
            "return k * keep * surrogate, clipped",
        ),
        (
            "band inverted",
            "losses.py",
            'keep = (k >= cfg["icepop_low"]) & (k <= cfg["icepop_high"])',
            'keep = (k <= cfg["icepop_low"]) | (k >= cfg["icepop_high"])',
        ),
    ],
    "m2po": [
        (
            "<= tau, not < tau",
            "losses.py",
            "below = torch.nonzero(rest_mean < tau)",
            "below = torch.nonzero(rest_mean <= tau)",
        ),
        (
            "the smallest first",
            "losses.py",
            "flatten(), descending=True).values",
            "flatten(), descending=False).values",
        ),
        ("the smallest masked value returned", "losses.py", "else s[masked].item()", "else s[masked - 1].item()"),
        (
            "every token masked when no mean is below tau",
            "losses.py",
            "if len(below) else len(s) - 1",
            "if len(below) else len(s)",
        ),
        (
            "the mean of the masked, not of the rest",
            "losses.py",
            "s.flip(0).cumsum(0).flip(0) / torch.arange(len(s), 0, -1, dtype=torch.float64)",
            "s.cumsum(0) / torch.arange(1, len(s) + 1, dtype=torch.float64)",
        ),
    ],
    "record": [
        ("no prefill note", "engine.py", "            self.note_prefill(t0, t1, version)\n", ""),
        ("no token note", "engine.py", "        self.note_tokens(n, version, stale, step, t0, t1)\n", ""),
        (
            "stale off by one",
            "engine.py",
            "stale, n = self.kv_version < version,",
            "stale, n = self.kv_version <= version,",
        ),
        (
            "stale against the last token's version",
            "engine.py",
            "stale, n = self.kv_version < version,",
            "stale, n = self.kv_version < (self.versions[-1] if self.versions else version),",
        ),
        (
            "rebuild without the prompt",
            "engine.py",
            "rebuilt = len(self.prompt_ids) + len(self.tokens)",
            "rebuilt = len(self.tokens)",
        ),
        ("rebuild not counted", "engine.py", "                self.recomputed += rebuilt\n", ""),
        (
            "the first prefill counted as a rebuild",
            "engine.py",
            "            if self.tokens:  # prompt",
            "            if True:  # prompt",
        ),
        ("kv_version never set", "engine.py", "            self.kv_version = version\n", ""),
        ("versions not kept", "engine.py", "self.versions += [version] * n", "self.versions += [version]"),
    ],
    "recompute": [
        ("kv_version kept", "regimes.py", "            r.kv_version = None  # its KV", "            pass  # its KV"),
        (
            "submitted before the load",
            "regimes.py",
            "        gen.load_weights(version, weights)\n        for r in aborted:\n"
            "            r.kv_version = None  # its KV"
            " is about to be written by v+1: Rollout.record counts it then\n            gen.submit(r)\n",
            "        for r in aborted:\n            r.kv_version = None\n            gen.submit(r)\n"
            "        gen.load_weights(version, weights)\n",
        ),
        (
            "the partial answer thrown away",
            "regimes.py",
            "            r.kv_version = None  # its KV",
            "            r.restart(gen.clock.now())  # its KV",
        ),
        (
            "not submitted again",
            "regimes.py",
            "            gen.submit(r)\n        return True\n\n\nREGIMES",
            "        return True\n\n\nREGIMES",
        ),
    ],
    "max_lag": [
        ("max_lag, not max_lag + 1", "engine.py", 'self.cfg["max_lag"] + 1)', 'self.cfg["max_lag"])'),
        (
            "the version not counted",
            "engine.py",
            'budget = (self.version + self.cfg["max_lag"]',
            'budget = (self.cfg["max_lag"]',
        ),
        (
            "answers, not groups",
            "engine.py",
            '* self.cfg["prompts_per_step"] + self.budget_offset\n',
            '* self.cfg["prompts_per_step"] * self.cfg["group_size"] + self.budget_offset\n',
        ),
        ("<= the budget", "engine.py", "self.next_group < budget", "self.next_group <= budget"),
        (
            "the offset left out",
            "engine.py",
            ' * self.cfg["prompts_per_step"] + self.budget_offset\n',
            ' * self.cfg["prompts_per_step"]\n',
        ),
        (
            "no room for the group itself",
            "engine.py",
            'len(self.inflight) + self.cfg["group_size"] <= self.kv_answers\n        )\n\n    def admit',
            "len(self.inflight) < self.kv_answers\n        )\n\n    def admit",
        ),
        (
            "admits when not admitting",
            "engine.py",
            "            self.admitting\n            and self.next_group < budget\n            and len(self.inflight)",
            "            True\n            and self.next_group < budget\n            and len(self.inflight)",
        ),
    ],
    # not an exercise: what the generator process adds to the max_lag exercise's bound
    # (system.generator.ProcessGenerator's budget_offset and queue); graded by its own by-hand test (CHEAP below)
    "process_admission": [
        (
            "rejected groups not counted",
            "system/generator.py",
            'self.start_version * self.cfg["prompts_per_step"] + self.rejected',
            'self.start_version * self.cfg["prompts_per_step"]',
        ),
        (
            "versions counted from 0 (resume)",
            "system/generator.py",
            'return self.start_group - self.start_version * self.cfg["prompts_per_step"] + self.rejected',
            "return self.start_group + self.rejected",
        ),
        (
            "groups counted from 0 (resume)",
            "system/generator.py",
            "return self.start_group - self.start_version",
            "return -self.start_version",
        ),
        (
            "outbox full at queue_size + 1",
            "system/generator.py",
            "len(self.outbox) < self.queue_size",
            "len(self.outbox) <= self.queue_size",
        ),
    ],
    "pace": [
        ("ties the other way", "pool.py", "(-eff[g], _completed(pool[g]))", "(-eff[g], -_completed(pool[g]))"),
        ("ties by group id", "pool.py", "(-eff[g], _completed(pool[g]))", "(-eff[g], g)"),
        ("freshest first", "pool.py", "(-eff[g], _completed(pool[g]))", "(eff[g], _completed(pool[g]))"),
        (
            "fewer than n left",
            "pool.py",
            "min(max(0, len(pool) - target), max(0, len(pool) - n))",
            "max(0, len(pool) - target)",
        ),
        ("budget off by one", "pool.py", "min(max(0, len(pool) - target),", "min(max(0, len(pool) - target - 1),"),
        (
            "lam ignored",
            "pool.py",
            "eff = {g: effective_staleness(pool[g], version, lam)",
            "eff = {g: effective_staleness(pool[g], version, 1.0)",
        ),
        ("left in the pool", "pool.py", "return [pool.pop(g) for g in worst]", "return [pool[g] for g in worst]"),
    ],
}

CHEAP = {
    "advantages": [
        "tests/test_train.py::test_advantages_by_hand",
        "tests/test_graders.py::test_advantages_of_a_group_of_two_and_of_equal_rewards",
    ],
    "loss": ["tests/test_losses.py::test_loss_by_hand[tis]"],
    "m2po": [
        "tests/test_losses.py::test_m2po_masks_the_largest_until_the_rest_is_under_tau",
        "tests/test_losses.py::test_loss_by_hand[m2po]",
    ],
    "correction": [
        "tests/test_losses.py::test_loss_by_hand[icepop]",
        "tests/test_graders.py::test_icepop_reports_a_masked_token_that_ppo_does_not_clip",
    ],
    "record": ["tests/test_graders.py::test_record_by_hand"],
    "recompute": ["tests/test_graders.py::test_recompute_switch_by_hand"],
    "max_lag": [
        "tests/test_graders.py::test_max_lag_admission_bound_by_hand",
        "tests/test_graders.py::test_max_lag_kv_cache_by_hand",
    ],
    "process_admission": ["tests/test_generator.py::test_process_admission_bound_by_hand"],
}  # pace: all its graders (tests/test_pace.py's take seconds)

# Right answers in another form than the project's, each allowed by its exercise's task
# (tools/exercise.py): tests/test_exercises.py checks that each, put alone into a copy,
# passes every grader of its exercise: a grader that rejects one of these checks more
# than the task says.
ACCEPTED = {
    "advantages": [
        (
            "a loop over the groups",
            "grpo.py",
            "    r = rewards.view(-1, group_size)\n"
            "    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)\n",
            "    import torch\n\n    out = []\n    for g in rewards.split(group_size):\n"
            "        out.append((g - g.mean()) / (g.std() + 1e-4))\n    return torch.cat(out)\n",
        ),
        (
            "the unbiased std by hand",
            "grpo.py",
            "    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)\n",
            "    d = r - r.mean(1, keepdim=True)\n    std = (d.pow(2).sum(1, keepdim=True) / (group_size - 1)).sqrt()\n"
            "    return (d / (std + 1e-4)).reshape(-1)\n",
        ),
        (
            "computed in float64, returned in the rewards' dtype",
            "grpo.py",
            "    r = rewards.view(-1, group_size)\n"
            "    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)\n",
            "    r = rewards.double().view(-1, group_size)\n"
            "    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)\n"
            "    return adv.flatten().to(rewards.dtype)\n",
        ),
    ],
    "loss": [
        (
            "torch.minimum, the flag from the weight",
            "losses.py",
            '    ratio = torch.exp(logp.detach() - mu)\n    return -ratio.clamp(max=cfg["is_cap"]) * adv * logp, '
            'ratio > cfg["is_cap"]\n',
            '    ratio = (logp - mu).exp().detach()\n    w = torch.minimum(ratio, torch.tensor(cfg["is_cap"], '
            "dtype=ratio.dtype))\n    return -(w * adv) * logp, w < ratio\n",
        ),
    ],
    "correction": [
        (
            "torch.where, the band's outside tested",
            "losses.py",
            '    k = (old - mu).exp()\n    keep = (k >= cfg["icepop_low"]) & (k <= cfg["icepop_high"])\n'
            "    return k * keep * surrogate, clipped | ~keep\n",
            '    k = torch.exp(old - mu)\n    out = (k < cfg["icepop_low"]) | (k > cfg["icepop_high"])\n'
            "    return torch.where(out, torch.zeros_like(k), k) * surrogate, clipped | out\n",
        ),
    ],
    "m2po": [
        (
            "a loop that masks one at a time",
            "losses.py",
            "    s = torch.sort(m2.double().flatten(), descending=True).values\n",
            "    kept = sorted(m2.double().flatten().tolist(), reverse=True)\n    masked = 0\n"
            "    while masked < len(kept) - 1 and sum(kept[masked:]) / (len(kept) - masked) >= tau:\n"
            '        masked += 1\n    if kept:\n        return float("inf") if masked == 0 else kept[masked]\n'
            "    s = torch.sort(m2.double().flatten(), descending=True).values\n",
        ),
    ],
    "record": [
        (
            "the rebuild from prefill_tokens, kv_version set after the note",
            "engine.py",
            "            self.kv_version = version\n"
            "            if self.tokens:  # prompt + partial answer prefilled again (counted when it runs, so once)\n"
            "                rebuilt = len(self.prompt_ids) + len(self.tokens)\n"
            "                self.recomputed += rebuilt\n"
            "            self.note_prefill(t0, t1, version)\n",
            "            if self.tokens:\n"
            "                rebuilt = self.prefill_tokens()\n"
            "                self.recomputed += rebuilt\n"
            "            self.note_prefill(t0, t1, version)\n"
            "            self.kv_version = version\n",
        ),
        (
            "token by token",
            "engine.py",
            "        self.tokens += token_ids\n        self.logprobs += logprobs\n"
            "        self.versions += [version] * n\n        self.stale += [stale] * n\n",
            "        for t, lp in zip(token_ids, logprobs):\n            self.tokens.append(t)\n"
            "            self.logprobs.append(lp)\n            self.versions.append(version)\n"
            "            self.stale.append(stale)\n",
        ),
    ],
    "recompute": [
        (
            "load before the abort",
            "regimes.py",
            "        aborted = gen.abort_all()\n        gen.load_weights(version, weights)\n        for r in aborted:\n"
            "            r.kv_version = None",
            "        gen.load_weights(version, weights)\n        aborted = gen.abort_all()\n        for r in aborted:\n"
            "            r.kv_version = None",
        ),
        (
            "kv_version reset just after the submit",
            "regimes.py",
            "            r.kv_version = None  # its KV is about to be written by v+1: Rollout.record counts it then\n"
            "            gen.submit(r)\n",
            "            gen.submit(r)\n            r.kv_version = None  # nothing steps in between\n",
        ),
        (
            "submitted again in reverse order",
            "regimes.py",
            "        for r in aborted:\n            r.kv_version = None",
            "        for r in reversed(aborted):\n            r.kv_version = None",
        ),
    ],
    "max_lag": [
        (
            "the room counted down",
            "engine.py",
            "        return (\n            self.admitting\n            and self.next_group < budget\n"
            '            and len(self.inflight) + self.cfg["group_size"] <= self.kv_answers\n        )\n',
            "        room = self.kv_answers - len(self.inflight)\n"
            '        return self.admitting and budget - self.next_group > 0 and room >= self.cfg["group_size"]\n',
        ),
        (
            "the next group's batch, as the hint counts",
            "engine.py",
            "            and self.next_group < budget\n",
            '            and (self.next_group - self.budget_offset) // self.cfg["prompts_per_step"]\n'
            '            <= self.version + self.cfg["max_lag"]\n',
        ),
    ],
    "pace": [
        (
            "the rejected returned in admission order",
            "pool.py",
            "return [pool.pop(g) for g in worst]",
            "return [pool.pop(g) for g in sorted(worst)]",
        ),
    ],
    # the silent bugs' right line, written another way
    "silent_behaviour": [
        (
            "each answer's logprobs cast before the concatenation",
            "grpo.py",
            'behaviour = torch.cat([s["logprobs"] for s in mb]).float().to(device)',
            'behaviour = torch.cat([s["logprobs"].float() for s in mb]).to(device)',
        ),
    ],
    "silent_stale": [
        (
            "the comparison the other way round",
            "engine.py",
            "stale, n = self.kv_version < version, len(token_ids)",
            "stale, n = version > self.kv_version, len(token_ids)",
        ),
    ],
}
