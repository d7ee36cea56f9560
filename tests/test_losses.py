"""
The off-policy corrections (losses.LOSSES), each on three tokens worked by hand: the loss
per token, its gradient with respect to log pi, and which tokens it clips or masks, as
numbers written here, not computed by the code under test. Then the step's diagnostics
(ESS, clipped share, KL) on two tokens, also by hand.

    .venv/bin/python -m pytest -q tests/test_losses.py

The three tokens. Tokens 0 and 1 belong to answer 0 (advantage +1), token 2 to answer 1
(advantage -1). log pi = (-1, -2, -0.5). The ratios are chosen, and mu and pi_old follow:

    token                     0      1      2
    R = pi / mu               3.0    0.6    0.25     (what the engine sampled from vs now)
    D = pi / pi_old           1.5    1.0    0.7      (the policy's drift since the batch began)
    K = pi_old / mu = R / D   2.0    0.6    0.357143 (the sampler-trainer mismatch)

PPO's clip (eps 0.2) on D: token 0 pushes up (A = +1) past 1.2, so min(1.5, 1.2) = 1.2 and
its gradient is 0; token 1 sits at 1, loss -1, gradient -D A = -1; token 2 pushes down
(A = -1) past 0.8, so min(-0.7, -0.8) = -0.8: loss 0.8, gradient 0.
"""

import math

import pytest
import torch

import grpo
import losses

LOGP = [-1.0, -2.0, -0.5]
R, D = [3.0, 0.6, 0.25], [1.5, 1.0, 0.7]
ADV, ANSWER = [1.0, 1.0, -1.0], [0, 0, 1]
CFG = dict(
    clip_eps=0.2,
    is_cap=2.0,
    icepop_low=0.5,
    icepop_high=5.0,
    geo_threshold=1.5,
    cispo_eps_low=0.5,
    cispo_eps_high=1.0,
    gspo_eps_low=0.2,
    gspo_eps_high=0.5,
    m2po_tau=0.5,
)
K2 = 0.25 / 0.7  # token 2's pi_old/mu
S0 = math.sqrt(3.0 * 0.6)  # answer 0's GSPO ratio: the geometric mean of its tokens' R

# name -> (loss per token, d loss / d log pi per token, clipped or masked)
BY_HAND = {
    # PPO's clip on D, mu ignored (see the docstring)
    "none": ([-1.2, -1.0, 0.8], [0.0, -1.0, 0.0], [True, False, True]),
    # w = min(R, 2) = (2, 0.6, 0.25); loss -w A log pi = (-2*1*-1, -0.6*1*-2, -0.25*-1*-0.5); gradient -w A
    "tis": ([2.0, 1.2, -0.125], [-2.0, -0.6, 0.25], [True, False, False]),
    # K times PPO's clipped term: (2 * -1.2, 0.6 * -1, K2 * 0.8); gradient K times (0, -1, 0)
    "ppo": ([-2.4, -0.6, K2 * 0.8], [0.0, -0.6, 0.0], [True, False, True]),
    # as ppo, but token 2's K = 0.357 is below 0.5: masked, no loss, no gradient
    "icepop": ([-2.4, -0.6, 0.0], [0.0, -0.6, 0.0], [True, False, True]),
    # answer 0: exp(mean(log 2, log 0.6)) = sqrt(1.2) = 1.095, inside [1/1.5, 1.5]: PPO's clip on D;
    # answer 1: 0.357 < 0.667: masked whole
    "geo": ([-1.2, -1.0, 0.0], [0.0, -1.0, 0.0], [True, False, True]),
    # w = clip(R, 0.5, 2) = (2, 0.6, 0.5); loss -w A log pi = (2, 1.2, -0.25); gradient -w A
    "cispo": ([2.0, 1.2, -0.25], [-2.0, -0.6, 0.5], [True, False, True]),
    # answer 0: s = sqrt(3 * 0.6) = 1.342 < 1.5, unclipped: loss -s, gradient -s A on each token;
    # answer 1: s = 0.25 pushed down past 0.8: loss 0.8, gradient 0
    "gspo": ([-S0, -S0, 0.8], [-S0, -S0, 0.0], [False, False, True]),
    # (log K)^2 = (ln 2)^2, (ln 0.6)^2, (ln 0.357)^2 = 0.4805, 0.2609, 1.0601: mean 0.6005 >= 0.5, so the largest,
    # token 2's, goes; the rest's mean (0.4805 + 0.2609) / 2 = 0.3707 < 0.5: kept. Loss -R A, unclipped; gradient -R A
    "m2po": ([-3.0, -0.6, 0.0], [-3.0, -0.6, 0.0], [False, False, True]),
    # harmful: token 0 (A > 0, R = 3 > 1) and token 2 (A < 0, R = 0.25 < 1), (log R)^2 = 1.2069, 1.9218; token 1
    # (A > 0, R < 1) is not. Capped at the smaller, 1.2069, their mean is still >= 0.5: cap 0, both clipped at
    # r = exp(0) = 1: loss -A, no gradient. Token 1: -R A, unclipped
    "m2po-authors": ([-1.0, -0.6, 1.0], [0.0, -0.6, 0.0], [True, False, True]),
}


@pytest.mark.fast
def test_every_loss_is_worked_by_hand():
    assert sorted(BY_HAND) == sorted(losses.LOSSES)


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_loss_by_hand(name):
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    mu = logp.detach() - torch.tensor(R, dtype=torch.float64).log()
    old = logp.detach() - torch.tensor(D, dtype=torch.float64).log()
    cfg = dict(CFG, m2po_cutoff=losses.m2po_cutoff(losses.m2po_moment(old, mu), CFG["m2po_tau"]))  # m2po's mask
    per_token, clipped = losses.LOSSES[name](
        cfg, logp, old, mu, torch.tensor(ADV, dtype=torch.float64), torch.tensor(ANSWER)
    )
    per_token.sum().backward()
    want_loss, want_grad, want_clipped = BY_HAND[name]
    assert per_token.tolist() == pytest.approx(want_loss, abs=1e-9)
    assert logp.grad.tolist() == pytest.approx(want_grad, abs=1e-9)
    assert clipped.dtype == torch.bool, f"the mask of the tokens clipped or capped must be bool, got {clipped.dtype}"
    assert clipped.tolist() == want_clipped


@pytest.mark.fast
def test_m2po_masks_the_largest_until_the_rest_is_under_tau():
    """Six tokens, log(pi_old/mu) = 0.3, 0.1, -0.5, 0.2, 0, 0.4: (log)^2 = 0.09, 0.01, 0.25, 0.04, 0, 0.16,
    mean 0.55 / 6 = 0.0917 >= tau 0.04. Masked in order: 0.25 (the rest's mean 0.30 / 5 = 0.06, still
    >= 0.04), then 0.16 (0.14 / 4 = 0.035 < 0.04): two masked, the largest kept 0.09, M2 0.035."""
    log_k = torch.tensor([0.3, 0.1, -0.5, 0.2, 0.0, 0.4], dtype=torch.float64)
    m2 = losses.m2po_moment(log_k, torch.zeros(6, dtype=torch.float64))
    cut = losses.m2po_cutoff(m2, 0.04)
    assert cut == pytest.approx(0.09) and (m2 <= cut).tolist() == [True, True, False, True, True, False]
    assert m2[m2 <= cut].mean().item() == pytest.approx(0.035)
    assert losses.m2po_cutoff(m2, 0.1) == float("inf")  # 0.0917 < 0.1: nothing masked
    assert losses.m2po_cutoff(m2, 0.0) == 0.0  # no mean is below 0: all but the smallest go
    # the rest's mean must fall *below* tau: once 1.0 goes, (0.5 + 0) / 2 = 0.25 is not below 0.25, so 0.5 goes too
    assert losses.m2po_cutoff(torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64), 0.25) == 0.0
    # ties are read by value: sorted 0.25, 0.16, 0.09, 0.09, 0.01, 0, the rest's mean falls below 0.04 once three
    # go (0.10 / 3), so k = 3 and s[3] = 0.09 is returned; the mask (m2 <= 0.09) keeps both 0.09s, though the four
    # kept then have the mean 0.19 / 4 = 0.0475, not below tau
    assert losses.m2po_cutoff(torch.tensor([0.25, 0.16, 0.09, 0.09, 0.01, 0.0]), 0.04) == pytest.approx(0.09)


@pytest.mark.fast
def test_m2po_moment_is_over_the_steps_trained_tokens():
    """loss_settings: the cutoff over every answer whose advantage is not 0, from pi_old and mu;
    with two 'ranks' (gather), over both ranks' tokens: the same cutoff as one process."""
    answers = [
        dict(old_logprobs=torch.tensor([-1.0, -1.0]), logprobs=torch.tensor([-1.3, -1.1])),  # m2 0.09, 0.01
        dict(old_logprobs=torch.tensor([-2.0]), logprobs=torch.tensor([-1.5])),  # 0.25
        dict(old_logprobs=torch.tensor([-1.0, -1.0]), logprobs=torch.tensor([-0.8, -1.0])),  # 0.04, 0
        dict(old_logprobs=torch.tensor([-3.0]), logprobs=torch.tensor([-2.6])),  # 0.16
        dict(logprobs=torch.tensor([-9.0, -9.0])),  # advantage 0: not trained, not counted
    ]
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0])
    cfg = dict(CFG, loss="m2po", m2po_tau=0.04)
    whole = losses.loss_settings(cfg, answers, adv)["m2po_cutoff"]
    assert whole == pytest.approx(0.09, rel=1e-6)
    halves = [(answers[:2], adv[:2]), (answers[2:], adv[2:])]
    shares = [
        [losses.m2po_moment(s["old_logprobs"], s["logprobs"]) for s, a in zip(b, ad) if a != 0] for b, ad in halves
    ]
    gather = lambda mine: [torch.cat(x) for x in shares]  # what Ranks.gather returns: each rank's
    assert all(losses.loss_settings(cfg, b, ad, gather)["m2po_cutoff"] == whole for b, ad in halves)
    assert losses.loss_settings(dict(cfg, loss="tis"), answers, adv) == dict(cfg, loss="tis")  # others: cfg itself


# M2PO as its authors' code runs it (losses.loss_m2po_authors), on six tokens of budget 0.05:
#
#     token            0      1      2      3      4      5
#     A               +1     +1     +1     -1     -1     -1
#     log(pi/mu)      0.1    0.3   -0.5   -0.2    0.4   -0.6
#     (log)^2         0.01   0.09   0.25   0.04   0.16   0.36
#     harmful         yes    yes    no     yes    no     yes     (A and log(pi/mu) of one sign)
#
# The harmful (log)^2, sorted: 0.01, 0.04, 0.09, 0.36; mean 0.125 > 0.05. Capped at each in turn, their mean:
# 0.01 | (0.01 + 3 x 0.04) / 4 = 0.0325 | (0.05 + 2 x 0.09) / 4 = 0.0575. The largest under 0.05 is 0.04: the
# cap c = 0.04, sqrt c = 0.2 (not the exact root 0.075 of (0.05 + 2c) / 4 = 0.05). Harmful and at or above
# the cap: tokens 1, 3 (the cap itself), 5, clipped at r = exp(+0.2) (A > 0) or exp(-0.2) (A < 0). Token 0
# is under the cap; tokens 2 and 4 pull toward mu and are never clipped, however far r is from 1.
SIX_ADV = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
SIX_LOG_R = [0.1, 0.3, -0.5, -0.2, 0.4, -0.6]
E = math.exp
SIX_BY_HAND = (
    [-E(0.1), -E(0.2), -E(-0.5), E(-0.2), E(0.4), E(-0.2)],  # loss: -r A, or -exp(+-0.2) A where clipped
    [-E(0.1), 0.0, -E(-0.5), 0.0, E(0.4), 0.0],  # d loss / d log pi: -r A, 0 where clipped
    [False, True, False, True, False, True],
)


def m2po_authors_on(tokens, budget=0.05):
    """loss_m2po_authors on some of the six tokens (one micro-batch): loss, gradient, clipped."""
    logp = torch.tensor([-1.0 - 0.1 * i for i in tokens], dtype=torch.float64, requires_grad=True)
    mu = logp.detach() - torch.tensor([SIX_LOG_R[i] for i in tokens], dtype=torch.float64)
    adv = torch.tensor([SIX_ADV[i] for i in tokens], dtype=torch.float64)
    old = logp.detach() + 0.3  # pi_old apart from pi and mu: the authors' loss does not read it
    per_token, clipped = losses.loss_m2po_authors(dict(CFG, m2po_tau=budget), logp, old, mu, adv, None)
    per_token.sum().backward()
    return per_token.tolist(), logp.grad.tolist(), clipped.tolist()


def check_m2po_authors_by_hand():
    """The six tokens' loss, gradient and clipped, against the numbers worked above."""
    loss, grad, clipped = m2po_authors_on(range(6))
    assert clipped == SIX_BY_HAND[2]
    assert loss == pytest.approx(SIX_BY_HAND[0], abs=1e-9)
    assert grad == pytest.approx(SIX_BY_HAND[1], abs=1e-9)


@pytest.mark.fast
def test_m2po_authors_clips_only_harmful_tokens_at_the_winsorised_cap():
    check_m2po_authors_by_hand()
    m2 = torch.tensor([0.01, 0.09, 0.04, 0.36], dtype=torch.float64)  # the harmful tokens' (log)^2
    assert losses.m2po_authors_cap(m2, 0.05) == 0.04
    assert losses.m2po_authors_cap(m2, 0.125) == math.inf  # their mean is at the budget: nothing clipped
    assert losses.m2po_authors_cap(m2, 0.03) == 0.01  # capped at 0.01: 0.01 < 0.03; at 0.04: 0.0325, not
    assert losses.m2po_authors_cap(m2, 0.005) == 0.0  # even capped at the smallest, 0.01 >= 0.005: all clipped
    assert losses.m2po_authors_cap(m2[:0], 0.05) == math.inf  # no harmful token: nothing to clip


@pytest.mark.fast
def test_m2po_authors_is_decided_per_micro_batch():
    """The same six tokens in two micro-batches, each deciding its own cap. Tokens 0, 3, 4: harmful
    (log)^2 0.01, 0.04, mean 0.025 <= 0.05, nothing clipped (token 3 now trains: -r A, gradient r).
    Tokens 1, 2, 5: harmful 0.09, 0.36; capped at 0.09 the mean is 0.09 >= 0.05: cap 0, tokens 1 and
    5 clipped at r = 1, loss -A, where the whole batch clipped them at exp(+-0.2)."""
    loss, grad, clipped = m2po_authors_on([0, 3, 4])
    assert clipped == [False, False, False]
    assert loss == pytest.approx([-E(0.1), E(-0.2), E(0.4)]) and grad == pytest.approx(loss)
    loss, grad, clipped = m2po_authors_on([1, 2, 5])
    assert clipped == [True, False, True]
    assert loss == pytest.approx([-1.0, -E(-0.5), 1.0]) and grad == pytest.approx([0.0, -E(-0.5), 0.0])


def exact_root(m2, budget):
    """A wrong cap: c solving mean(min(m2, c)) = budget exactly, between two breakpoints."""
    s = torch.sort(m2).values
    return next(c for j in range(len(s)) for c in [(budget * len(s) - s[:j].sum().item()) / (len(s) - j)] if c <= s[j])


WRONG_M2PO_AUTHORS = {
    # every token counted and cut, of either sign (as loss_m2po's mask): tokens 2 and 4 clipped too
    "both signs": ("m2po_harmful", lambda log_r, adv: adv != 0),
    # the clip set from the budget itself, not from the winsorised (log)^2: token 3 (0.04 < 0.05) kept
    "clip at the budget": ("m2po_authors_cap", lambda m2, budget: budget if m2.mean() > budget else math.inf),
    # the exact root of mean(min(m2, c)) = budget, 0.075, not a breakpoint: token 3 kept
    "exact root": ("m2po_authors_cap", exact_root),
}


@pytest.mark.fast
@pytest.mark.parametrize("wrong", sorted(WRONG_M2PO_AUTHORS))
def test_m2po_authors_by_hand_catches(wrong, monkeypatch):
    """The six tokens' hand-worked loss, gradient and clipped catch a plausible wrong version of
    the authors' M2PO, put in the place of the part it gets wrong."""
    name, fn = WRONG_M2PO_AUTHORS[wrong]
    monkeypatch.setattr(losses, name, fn)
    with pytest.raises(AssertionError):
        check_m2po_authors_by_hand()


@pytest.mark.fast
def test_gspo_averages_per_answer_by_default():
    """GSPO's paper averages its objective over answers, each answer's token mean counting the
    same. Two answers: one token at pi/mu = 1, A = +1 (loss -s A = -1); two tokens at pi/mu =
    1.0002 (s = 1.0002, inside the clip), A = -1 (loss +1.0002 each). Per answer: (-1 +
    1.0002) / 2 = 0.0001, and with the default flags that is the loss; averaged over the three
    tokens it would be (-1 + 2.0004) / 3 = 0.3335."""
    import lesson

    cfg = lesson.parse_config(["--loss", "gspo"])  # the flags' defaults, as a run fills them (config.fill)
    assert cfg["loss_agg"] == "answer" and lesson.parse_config(["--loss", "tis"])["loss_agg"] == "token"
    batch = [dict(token_ids=torch.zeros(1)), dict(token_ids=torch.zeros(2))]
    logp = torch.tensor([-1.0, -2.0, -2.0], dtype=torch.float64)
    mu = logp - torch.tensor([1.0, 1.0002, 1.0002], dtype=torch.float64).log()
    per_token, clipped = losses.loss_gspo(
        dict(CFG, gspo_eps_low=3e-4, gspo_eps_high=4e-4),
        logp,
        logp,
        mu,
        torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64),
        torch.tensor([0, 1, 1]),
    )
    weights = grpo.token_weights(cfg, batch)
    assert weights.tolist() == [0.5, 0.25]
    loss = (per_token * torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)).sum()
    assert loss.item() == pytest.approx(0.0001, abs=1e-9) and not clipped.any()
    token_mean = grpo.token_weights(dict(cfg, loss_agg="token"), batch)
    assert (per_token * token_mean[0]).sum().item() == pytest.approx(1.0004 / 3, abs=1e-6)  # the weights are float32


@pytest.mark.fast
def test_one_step_per_batch_none_is_reinforce_and_ppo_is_uncapped_is():
    """With pi_old = pi (one optimizer step per batch) nothing clips in none or ppo: none's
    gradient is -A (weight 1, mu ignored), ppo's -(pi/mu) A (importance sampling, uncapped)."""
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    mu = logp.detach() - torch.tensor(R, dtype=torch.float64).log()
    adv = torch.tensor(ADV, dtype=torch.float64)
    for name, want in (("none", [-1.0, -1.0, 1.0]), ("ppo", [-3.0, -0.6, 0.25])):
        logp.grad = None
        per_token, clipped = losses.LOSSES[name](CFG, logp, logp.detach(), mu, adv, torch.tensor(ANSWER))
        per_token.sum().backward()
        assert logp.grad.tolist() == pytest.approx(want) and not clipped.any()


@pytest.mark.fast
def test_offpolicy_metrics_by_hand():
    """Two tokens with pi/mu = 2 (fresh, lag 0, clipped) and 0.5 (stale KV, lag 3):
    ESS (2 + 0.5)^2 / (2 (4 + 0.25)) = 0.735294; k3 = (w - 1 - log w): 0.306853 and
    0.193147, mean 0.25; one of two clipped. Per split: each token alone, ESS 1; the stale
    token at lag 3 is stale_lag2's only one, the fresh one fresh_lag0's."""
    sums = grpo.offpolicy_sums(
        torch.tensor([math.log(2), math.log(0.5)]),
        torch.tensor([True, False]),
        torch.tensor([False, True]),
        torch.tensor([0, 3]),
    )
    m = grpo.offpolicy_metrics(sums)
    assert m["ess"] == pytest.approx(0.735294, abs=1e-6) and m["kl"] == pytest.approx(0.25, abs=1e-6)
    assert m["clipped_frac"] == 0.5
    assert m["ess_fresh"] == pytest.approx(1) and m["kl_fresh"] == pytest.approx(0.306853, abs=1e-6)
    assert m["clipped_frac_fresh"] == 1 and m["clipped_frac_stale"] == 0
    assert m["kl_stale"] == pytest.approx(0.193147, abs=1e-6) and m["kl_lag2"] == m["kl_stale"]
    assert m["kl_lag0"] == m["kl_fresh"] and m["ess_lag1"] is None  # no token at lag 1
    assert m["kl_fresh_lag0"] == m["kl_fresh"] and m["kl_stale_lag2"] == m["kl_stale"]
    assert m["ess_stale_lag0"] is None and m["ess_fresh_lag2"] is None and m["kl_stale_lag1"] is None


@pytest.mark.fast
def test_minibatches_cut_the_batch_in_order():
    assert grpo.minibatches(8, 1) == [list(range(8))]
    assert grpo.minibatches(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grpo.minibatches(5, 2) == [[0, 1], [2, 3, 4]]


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_every_loss_keeps_to_its_inputs_device(name):
    """Every loss makes what it makes on its inputs' device: on a GPU they are CUDA tensors, and a tensor
    made without a device (on the CPU) that meets them fails there. The same mix here, the other way round:
    CPU inputs, torch's default device the meta device (which refuses to meet the CPU), so a tensor made
    without a device fails this test. (m2po-authors' torch.arange did: "Tensor on device meta is not on
    the expected device cpu".) Six tokens whose harmful ones' (log pi/mu)^2 are over --m2po-tau, so that
    m2po-authors computes its cap."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.3, -1.2, -0.9], requires_grad=True)
    mu = torch.tensor([-1.5, -1.6, -0.2, -0.9, -1.0, -0.1])
    old = torch.tensor([-1.2, -2.0, -0.4, -0.5, -1.1, -0.8])
    adv, answer = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0, -1.0]), torch.tensor([0, 0, 1, 2, 3, 3])
    cfg = dict(CFG, m2po_cutoff=0.3, m2po_tau=0.01)
    with torch.device("meta"):
        loss, clipped = losses.LOSSES[name](cfg, logp, old, mu, adv, answer)
        loss.sum().backward()
    assert loss.device.type == clipped.device.type == logp.grad.device.type == "cpu"
    if name == "m2po-authors":  # the cap was computed: some harmful token clipped
        assert clipped.any()
