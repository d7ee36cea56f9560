"""
The off-policy corrections (--loss), one small function each, its formula and source in its
docstring. Each takes per answer token (N,): logp = log pi (with gradient), old = log pi_old and
mu = log mu (no gradient), adv = A, answer = which answer of the micro-batch the token belongs
to, as loss(cfg, logp, old, mu, adv, answer); it returns the per-token loss and which tokens it
clipped or masked (their gradient is 0 or bounded). grpo.train_step weights them (token_weights)
so that the sum is a mean. LOSSES, near the end, names them for --loss; loss_settings adds what a
step decides before it trains (m2po's cutoff). Worked by hand in tests/test_losses.py.
"""

import math

import torch


def ppo_clip(logp, old, adv, eps):
    """PPO's clipped surrogate -min(r A, clip(r, 1-eps, 1+eps) A), r = pi/pi_old: once the
    policy has moved a token's probability past the band in the direction A pushes it,
    the token stops pulling (the clipped term is constant in pi). Returns it and where it binds."""
    r = torch.exp(logp - old)
    unclipped, clipped = r * adv, r.clamp(1 - eps, 1 + eps) * adv
    return -torch.min(unclipped, clipped), clipped < unclipped


def loss_none(cfg, logp, old, mu, adv, answer):
    """The naive baseline: GRPO as written for on-policy data (DeepSeekMath, arXiv
    2402.03300), PPO's clip against pi_old and mu ignored, as if the engine had sampled
    from the trained weights. One step per batch: weight 1, the REINFORCE gradient -A grad log pi."""
    return ppo_clip(logp, old, adv, cfg["clip_eps"])


def loss_tis(cfg, logp, old, mu, adv, answer):
    """Token-level truncated importance sampling, as PipelineRL weights a token: w = min(pi/mu,
    C), detached, C = --is-cap; loss -w A log pi. A token the engine found much less likely
    than the trainer does counts at most C times. (Yao et al., "Your efficient RL framework
    secretly brings you off-policy RL training", 2025, truncate pi_old/mu and keep PPO's clip
    on pi/pi_old: the same weight when a batch takes one optimizer step, pi_old = pi.)"""
    ratio = torch.exp(logp.detach() - mu)
    return -ratio.clamp(max=cfg["is_cap"]) * adv * logp, ratio > cfg["is_cap"]


def loss_ppo(cfg, logp, old, mu, adv, answer):
    """Decoupled PPO (Hilton et al., arXiv 2110.00641; AReaL, arXiv 2505.24298): PPO's clip
    against pi_old (the drift), times the uncapped weight pi_old/mu (the mismatch)."""
    surrogate, clipped = ppo_clip(logp, old, adv, cfg["clip_eps"])
    return torch.exp(old - mu) * surrogate, clipped


def loss_icepop(cfg, logp, old, mu, adv, answer):
    """IcePop (Ling team, arXiv 2510.18855): decoupled PPO whose mismatch weight k = pi_old/mu
    is kept inside [--icepop-low, --icepop-high] (0.5, 5 as published) and set to 0 outside:
    a token the two sides disagree on too much gives no gradient at all, instead of a capped one."""
    surrogate, clipped = ppo_clip(logp, old, adv, cfg["clip_eps"])
    k = (old - mu).exp()
    keep = (k >= cfg["icepop_low"]) & (k <= cfg["icepop_high"])
    return k * keep * surrogate, clipped | ~keep


def loss_geo(cfg, logp, old, mu, adv, answer):
    """Sequence masking on the geometric mean ratio (verl's rollout correction, "Geo-RS";
    Liu, Li et al., "When speed kills stability", 2025): rho = exp(mean over the answer's
    tokens of log(pi_old/mu)); an answer with rho outside [1/T, T], T = --geo-threshold
    (1.001, in verl's typical 1.0002-1.001), is left out whole; the rest train as on-policy
    with PPO's clip. The mean, not the product, so long answers are not rejected for length."""
    surrogate, clipped = ppo_clip(logp, old, adv, cfg["clip_eps"])
    rho = answer_mean(old - mu, answer).exp()
    keep = (rho >= 1 / cfg["geo_threshold"]) & (rho <= cfg["geo_threshold"])
    return keep * surrogate, clipped | ~keep


def loss_cispo(cfg, logp, old, mu, adv, answer):
    """CISPO (MiniMax-M1, arXiv 2506.13585): the weight pi/mu clipped to [1 - eps_low,
    1 + eps_high] and detached, loss -w A log pi: clipping the weight, not the update, so
    no token loses its gradient. MiniMax sets no lower bound (eps_low large: here 1, the
    weight >= 0) and tunes eps_high (--cispo-eps-high) without publishing it."""
    ratio = torch.exp(logp.detach() - mu)
    w = ratio.clamp(1 - cfg["cispo_eps_low"], 1 + cfg["cispo_eps_high"])
    return -w * adv * logp, w != ratio


def loss_m2po(cfg, logp, old, mu, adv, answer):
    """M2PO (Zheng et al., "Prosperity before Collapse", arXiv 2510.01161) as its paper writes it, with
    AReaL's mask (_get_m2po_loss_mask): -(pi/mu) A, unclipped, on every token but those whose
    (log pi_old/mu)^2 is largest, masked until the mean of the rest, M2, is below --m2po-tau (0.04).
    The mask is decided before the step over all its tokens, every rank's (loss_settings); AReaL
    decides it per micro-batch and trains the kept tokens with its decoupled PPO. The authors' own
    code does something else: loss_m2po_authors."""
    keep = m2po_moment(old, mu) <= cfg["m2po_cutoff"]
    return -(keep * torch.exp(logp - mu) * adv), ~keep


def m2po_moment(old, mu):
    """(log pi_old - log mu)^2 per token: what M2PO's mask ranks by; one definition for the
    cutoff (loss_settings) and the mask (loss_m2po), so that the two agree bit for bit."""
    d = old - mu
    return d * d


def m2po_cutoff(m2, tau):
    """M2PO's mask over a step's tokens, m2 (N,) their m2po_moment: sorted largest first (s), the
    k largest are masked for the least k at which the mean of the rest, s[k:], is below tau (at
    least one token is kept, as in AReaL's _get_m2po_loss_mask). Returns s[k], the largest value
    kept, inf if k is 0. Tokens at or below it train: ties are read by value, so a token tied with
    s[k] trains even if k counted it (the mean of what trains can then be tau or more)."""
    s = torch.sort(m2.double().flatten(), descending=True).values
    if not len(s):
        return float("inf")
    rest_mean = s.flip(0).cumsum(0).flip(0) / torch.arange(len(s), 0, -1, dtype=torch.float64)  # mean of s[i:]
    below = torch.nonzero(rest_mean < tau)
    masked = int(below[0]) if len(below) else len(s) - 1  # how many of the largest go
    return float("inf") if masked == 0 else s[masked].item()


def loss_settings(cfg, batch, adv, gather=lambda x: [x]):
    """The settings of one optimizer step's loss on `batch` (a rank's share of the step's part):
    cfg itself, and for m2po the cutoff of its mask (m2po_cutoff) over the tokens the step trains
    (answers whose advantage is not 0; pi_old from old_logprobs), every rank's: gather(x) returns
    each rank's x (ranks.Ranks.gather). Answers with advantage 0 give no gradient, so their
    tokens would only loosen the budget of the others: they are left out of M2."""
    if cfg["loss"] != "m2po":
        return cfg
    mine = [m2po_moment(s["old_logprobs"], s["logprobs"].float()) for s, a in zip(batch, adv.tolist()) if a != 0]
    every = [x for part in gather(torch.cat(mine) if mine else torch.zeros(0)) for x in part.tolist()]
    return dict(cfg, m2po_cutoff=m2po_cutoff(torch.tensor(every, dtype=torch.float32), cfg["m2po_tau"]))


def loss_m2po_authors(cfg, logp, old, mu, adv, answer):
    """M2PO as its authors' code runs it (Infini-AI-Lab/M2PO, verl/trainer/ppo/core_algos.py), r = pi/mu:
    the harmful tokens' (A > 0 with r > 1, A < 0 with r < 1: m2po_harmful) (log r)^2 winsorised at the
    cap c that brings their mean below --m2po-tau (m2po_authors_cap), and a harmful token at or above
    c clipped as PPO clips, at r = exp(+-sqrt c); every other token -r A, unclipped. Per micro-batch, as
    verl computes its loss, so the clip depends on --micro-batch-tokens and the ranks. Their r is over
    the trainer's own logprobs at sampling; ours over the engine's mu. pi_old is not used."""
    log_r = logp.detach() - mu
    harmful = m2po_harmful(log_r, adv)
    cap = m2po_authors_cap(log_r[harmful] ** 2, cfg["m2po_tau"])  # a float: one host sync per micro-batch
    clipped = harmful & (log_r**2 >= cap)
    edge = log_r.clamp(-math.sqrt(cap), math.sqrt(cap)).exp()  # exp(+-sqrt c) where clipped
    return -torch.where(clipped, edge, torch.exp(logp - mu)) * adv, clipped


def m2po_harmful(log_r, adv):
    """The tokens the authors' M2PO may clip: advantage and log(pi/mu) of one sign, so that the
    step would move pi further from mu (their _get_trust_region_tokens_delta_sq)."""
    return ((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0))


def m2po_authors_cap(m2, budget):
    """The authors' winsorisation, m2 (n,) the harmful tokens' (log pi/mu)^2: inf (no clip) if
    their mean is at or below the budget; else the largest value c among them at which the mean of
    min(m2, c) is below the budget, or 0 if none is (every harmful token then clipped at r = 1).
    One of the breakpoints, not the exact root of mean(min(m2, c)) = budget: as their
    _solve_tau_from_sorted_delta2 picks it (the tokens tied with c are clipped too: their tau is
    sqrt(c - 1e-12))."""
    s = torch.sort(m2.double().flatten()).values
    if not len(s) or s.mean() <= budget:
        return math.inf
    after = torch.arange(len(s) - 1, -1, -1, device=s.device)  # how many sorted values come after each
    capped_mean = (s.cumsum(0) + s * after) / len(s)  # mean of min(m2, s[j]), rising
    under = torch.nonzero(capped_mean < budget)
    return s[int(under[-1])].item() if len(under) else 0.0


def loss_gspo(cfg, logp, old, mu, adv, answer):
    """GSPO (Qwen, arXiv 2507.18071), its token form: one ratio per answer, s = exp(mean of log(pi/mu))
    over its tokens, clipped to [1 - 3e-4, 1 + 4e-4] (--gspo-eps-low/high, as published); each token's
    gradient is s A grad log pi. Against the engine's mu: the paper's pi_old is the policy that
    sampled. Averaged as the paper does (--loss-agg answer, its default: config.DERIVED); with
    --loss-agg token an answer's gradient is scaled by its length."""
    s = answer_mean(logp.detach() - mu, answer).exp() * torch.exp(logp - logp.detach())
    unclipped, clipped = s * adv, s.clamp(1 - cfg["gspo_eps_low"], 1 + cfg["gspo_eps_high"]) * adv
    return -torch.min(unclipped, clipped), clipped < unclipped


LOSSES = {
    "none": loss_none,
    "tis": loss_tis,
    "ppo": loss_ppo,
    "icepop": loss_icepop,
    "geo": loss_geo,
    "cispo": loss_cispo,
    "gspo": loss_gspo,
    "m2po": loss_m2po,
    "m2po-authors": loss_m2po_authors,
}


def answer_mean(x, answer):
    """x (N,) per token -> each token gets the mean of x over its answer's tokens (N,)."""
    n = int(answer.max()) + 1 if len(answer) else 0
    total = torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, answer, x)
    count = torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, answer, torch.ones_like(x))
    return (total / count)[answer]
