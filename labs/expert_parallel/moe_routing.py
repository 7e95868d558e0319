"""Chapter 7: what routing decides: dropped tokens, expert balance, and bytes across nodes.

- Drops (Fedus et al. 2021, Switch Transformers, section 2.2): with loads L_i of the T routed
  tokens and capacity C, an expert drops max(0, L_i - C), so the dropped fraction is
  sum_i max(0, L_i - C) / T; under a router whose choices are i.i.d. with probabilities p_i,
  L_i ~ Binomial(T, p_i) and the expected fraction is sum_i E[max(0, L_i - C)] / T.
- Balance: the Switch auxiliary loss alpha * N * sum_i f_i * P_i (section 2.2, eq. 4; f_i the
  fraction of routed tokens sent to expert i, P_i the mean router probability of expert i;
  alpha = 1e-2 in the paper) against DeepSeek-V3's auxiliary-loss-free balancing (technical report,
  arXiv 2412.19437, section 2.1.2: a bias b_i added to the scores for the top-k choice only,
  lowered by gamma after a step where expert i was overloaded, raised where it was underloaded),
  and V3's complementary sequence-wise balance loss (eqs. 17-20, alpha = 1e-4, section 4.2).
- Stability: the router z-loss (Zoph et al. 2022, ST-MoE, section 3), its effect on the logits.
"""
import contextlib
import math

import torch
import torch.nn.functional as F

from labs.expert_parallel import moe, router


@contextlib.contextmanager
def one_thread():
    """Run tiny matmuls on one thread: on a shared 2-core box two threads ran 30x slower (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def zipf_probs(experts, zeta=1.0):
    """p_i proportional to 1 / i^zeta: expert 1 the most popular (a Zipf-like skew; the book writes
    the exponent zeta, keeping s for the sequence length)."""
    w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** zeta
    return w / w.sum()


def skewed_logits(tokens, probs, generator):
    """Router logits whose top-1 choice is drawn from ``probs``: log p_i plus Gumbel noise
    (the Gumbel-max trick: argmax_i (log p_i + G_i) ~ Categorical(p))."""
    u = torch.rand(tokens, len(probs), generator=generator, dtype=torch.float64)
    return (probs.log() - torch.log(-torch.log(u))).float()  # (T, N)


def expected_dropped(probs, tokens, cap):
    """sum_i E[max(0, L_i - C)] / T with L_i ~ Binomial(T, p_i), summed over the exact pmf."""
    loads = torch.arange(tokens + 1, dtype=torch.float64)
    pmf = torch.distributions.Binomial(tokens, probs[:, None]).log_prob(loads).exp()  # (N, T+1)
    return ((loads - cap).clamp(min=0) * pmf).sum().item() / tokens


def drop_curve(capacity_factors, tokens=256, experts=8, zeta=1.0, trials=40, seed=0):
    """Top-1 routing through `router.route` under a Zipf router, for each capacity factor: the dropped
    fraction measured (mean and standard error over ``trials`` batches), the fraction computed from
    each batch's measured loads (``from_loads``, which must equal it batch by batch), and the
    expectation derived from p (``predicted``)."""
    probs, g = zipf_probs(experts, zeta), torch.Generator().manual_seed(seed)
    batches = [skewed_logits(tokens, probs, g) for _ in range(trials)]
    rows = []
    for cf in capacity_factors:
        cap = router.capacity(tokens, experts, 1, cf)
        measured, from_loads, margin = [], [], math.inf
        for logits in batches:
            r = router.route(logits, 1, cap)
            margin = min(margin, r.margin)
            measured.append(1 - r.keep.float().mean().item())
            loads = torch.bincount(r.idx.reshape(-1), minlength=experts)
            from_loads.append((loads - cap).clamp(min=0).sum().item() / tokens)
        m = torch.tensor(measured, dtype=torch.float64)
        rows.append({"capacity_factor": cf, "capacity": cap, "measured": m.mean().item(),
                     "stderr": (m.std() / trials ** 0.5).item(), "per_batch": measured,
                     "from_loads": from_loads, "predicted": expected_dropped(probs, tokens, cap),
                     "routing_margin": margin})
    return rows


def switch_aux_loss(routing, experts, top_k, alpha=1e-2):
    """alpha * N * sum_i f_i P_i (Switch eq. 4): f_i from the top-k choices (no gradient), P_i
    the mean router probability (the gradient flows through it). Uniform routing gives alpha."""
    f = torch.bincount(routing.idx.reshape(-1), minlength=experts).float() / routing.idx.numel()
    return alpha * experts * (f * routing.probs.mean(0)).sum()


def sequence_balance_loss(routing, experts, top_k, seq_len, alpha=1e-4):
    """DeepSeek-V3's complementary sequence-wise balance loss (eqs. 17-20), averaged over the batch's
    sequences of ``seq_len`` tokens: alpha * sum_i f_i P_i per sequence, f_i = N/(k s) * (tokens of
    the sequence choosing i), P_i = mean over the sequence of s'_i, the scores normalised to sum 1
    (a softmax router's probabilities already do). On one sequence it is Switch's loss: same alpha,
    N f_i^Switch = f_i^V3 with f^Switch counted over the s k routed pairs."""
    t = routing.idx.shape[0]
    if t % seq_len:
        raise ValueError(f"{t} tokens do not split into sequences of {seq_len}; choose a seq_len that "
                         "divides them.")
    idx, probs = (routing.idx.view(t // seq_len, seq_len, top_k),
                  routing.probs.view(t // seq_len, seq_len, experts))
    counts = F.one_hot(idx, experts).sum((1, 2)).float()        # (sequences, N) tokens choosing i
    f = experts / (top_k * seq_len) * counts
    return alpha * (f * probs.mean(1)).sum(-1).mean()


def update_bias(layer, loads, gamma=1e-3):
    """DeepSeek-V3 section 2.1.2: b_i -= gamma if expert i was overloaded, += gamma if underloaded."""
    layer.bias -= gamma * torch.sign(loads.float() - loads.float().mean())


def train_balance(mode, steps=300, tokens=128, hidden=16, experts=8, top_k=2, alpha=1e-2, gamma=1e-3,
                  lr=1e-2, skew=1.0, seed=0, z_loss=0.0):
    """A tiny MoE layer fitted to a fixed random MLP, on tokens whose shared offset makes the
    initial router favour a few experts; ``mode`` is "none", "aux" or "bias"; ``z_loss`` adds the
    router z-loss with that coefficient. Returns per step the max/mean expert load (routed pairs,
    before any capacity), the task loss, the z-loss value L_z, the largest |logit|, and the largest
    and the smallest logit (signed: the z-loss holds the first near its log-partition, not the second)."""
    layer = moe.MoE(hidden, experts, top_k, None, seed=seed)
    torch.manual_seed(seed + 1)
    teacher = moe.expert(hidden, 2 * hidden)
    offset = skew * F.normalize(torch.randn(hidden), dim=0)  # the same for every token
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 2)
    ratios, losses, zs, biggest, top, bottom = [], [], [], [], [], []
    for _ in range(steps):
        x = torch.randn(tokens, hidden, generator=g) + offset       # (T, h)
        with torch.no_grad():
            target = teacher(x)
        loss = F.mse_loss(layer(x), target)
        losses.append(loss.item())
        z = router.router_z_loss(layer.routing.logits)
        zs.append(z.item())
        biggest.append(layer.routing.logits.abs().max().item())
        top.append(layer.routing.logits.max().item())
        bottom.append(layer.routing.logits.min().item())
        if z_loss:
            loss = loss + z_loss * z
        if mode == "aux":
            loss = loss + switch_aux_loss(layer.routing, experts, top_k, alpha)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loads = torch.bincount(layer.routing.idx.reshape(-1), minlength=experts)
        if mode == "bias":
            with torch.no_grad():
                update_bias(layer, loads, gamma)
        ratios.append((loads.max() / loads.float().mean()).item())
    return {"mode": mode, "max_over_mean": ratios, "losses": losses, "z_loss": zs, "max_logit": biggest,
            "top_logit": top, "bottom_logit": bottom}


def uniform_floor(tokens=128, experts=8, top_k=2, trials=200, seed=0):
    """max/mean load of a router with no preference at all (uniform random scores): the noise
    floor a perfectly balanced router still shows at this batch size. Returns the mean over
    ``trials`` batches and the standard deviation of one batch's value."""
    g = torch.Generator().manual_seed(seed)
    ratios = []
    for _ in range(trials):
        idx = router.route(torch.rand(tokens, experts, generator=g), top_k).idx
        loads = torch.bincount(idx.reshape(-1), minlength=experts)
        ratios.append((loads.max() / loads.float().mean()).item())
    r = torch.tensor(ratios, dtype=torch.float64)
    return r.mean().item(), r.std().item()


def balance_runs(steps=250, tokens=128, skew=1.0, alphas=(1e-2, 1e-1), gamma=1e-3, last=20):
    """No balancing, the Switch loss at each alpha, and DeepSeek-V3's bias at gamma, from the same
    start: max/mean load per step, and its mean over the ``last`` steps (``final``)."""
    runs = {"none": {}, **{f"aux {a:g}": {"alpha": a} for a in alphas}, f"bias {gamma:g}": {"gamma": gamma}}
    out = {}
    with one_thread():
        for name, kw in runs.items():
            r = train_balance(name.split()[0], steps=steps, tokens=tokens, skew=skew, **kw)
            r["final"] = sum(r["max_over_mean"][-last:]) / last
            r["final_loss"] = sum(r["losses"][-last:]) / last
            out[name] = r
    out["uniform_floor"], out["uniform_spread"] = uniform_floor(tokens)
    return out


def zloss_runs(coefficients=(0.0, 1e-3, 1e-2), steps=80, last=20, seed=0):
    """The same training (no balancing term) with the router z-loss at each coefficient c_z: per
    run, the mean over the ``last`` steps of L_z, of the largest |logit|, of the largest and the smallest
    logit and of the task loss; and L_z and the largest |logit| at the first step."""
    out = {}
    with one_thread():
        for c in coefficients:
            r = train_balance("none", steps=steps, z_loss=c, seed=seed)
            out[c] = {k: sum(r[k][-last:]) / last
                      for k in ("z_loss", "max_logit", "top_logit", "bottom_logit", "losses")}
            out[c]["first_z_loss"], out[c]["first_max_logit"] = r["z_loss"][0], r["max_logit"][0]
    return out


def zloss_seeds(seeds=(1, 2, 3, 4), c_z=1e-2, made=(), **kw):
    """``zloss_runs`` without and with ``c_z`` on each seed (``made``: runs already made, such as
    seed 0's and the suite's). Per run: L_z, the largest |logit| and the largest and smallest signed
    logit without and with, and whether L_z, the largest |logit| and the largest logit fell."""
    runs = list(made) + [zloss_runs((0.0, c_z), seed=s, **kw) for s in seeds]
    return [{"z_without": r[0.0]["z_loss"], "z_with": r[c_z]["z_loss"], "z_start": r[0.0]["first_z_loss"],
             "logit_without": r[0.0]["max_logit"], "logit_with": r[c_z]["max_logit"],
             "top_without": r[0.0]["top_logit"], "top_with": r[c_z]["top_logit"],
             "bottom_without": r[0.0]["bottom_logit"], "bottom_with": r[c_z]["bottom_logit"],
             "z_fell": r[c_z]["z_loss"] < r[0.0]["z_loss"],
             "top_fell": r[c_z]["top_logit"] < r[0.0]["top_logit"],
             "logit_fell": r[c_z]["max_logit"] < r[0.0]["max_logit"]} for r in runs]


def dispatch_bytes(tokens, top_k, ep, hidden, bytes_per_elem=2, scale_block=None, scale_bytes=4):
    """Formula bytes one rank's dispatch sends when routing is uniform and nothing is dropped:
    each of its T*k (token, expert) rows leaves with probability (ep - 1)/ep, h elements each.
    Combine sends the same back; backward repeats both. With ``scale_block`` (FP8 with 1 x 128
    tiles: the tiles in DeepSeek-V3 section 3.3.2, the FP8 dispatch in section 3.3.3) each row also
    carries h / scale_block scales of ``scale_bytes``: 4, fp32, in DeepEP's normal kernels, whose
    `Buffer.dispatch` takes (FP8 rows, fp32 scales [tokens, h / 128]); 1, a power-of-two exponent
    (UE8M0), in its low-latency kernels with ``low_latency_dispatch(..., round_scale=True,
    use_ue8m0=True)``. DeepSeek-V3 (section 3.3.3) says its scales are powers of 2, not how stored."""
    per_row = hidden * bytes_per_elem + (hidden // scale_block * scale_bytes if scale_block else 0)
    return tokens * top_k * (ep - 1) / ep * per_row


# Chapter 7's exercises: the answers are computed here, so the book never types them.
EXERCISES = {
    "1": lambda: router.capacity(4096, 64, 1, 1.25),
    "2": lambda: dispatch_bytes(4096, 8, 64, 7168) / 2**20,
    "3": lambda: 4 * 7168 * 2,
    "4": lambda: dispatch_bytes(4096, 8, 64, 7168, bytes_per_elem=1, scale_block=128) / 2**20,
    "5": lambda: 4 * zipf_probs(8)[:2].sum().item(),
    "6": lambda: 2 * (4 - 1) / 4 * (64 // 8) * 50e6 * 2 / 1e9,
}

# The wrong answer a careless reader (or a note) gives to each, which the checker must refuse.
WRONG = {
    "1": (64, "T/N = 64, without the capacity factor"),
    "2": (dispatch_bytes(4096, 8, 64, 7168) * 64 / 63 / 2**20,
          "every row counted, the one that stays included"),
    "3": (8 * 7168 * 2, "k rows of h bf16 values, the flat dispatch's bound"),
    "4": (dispatch_bytes(4096, 8, 64, 7168) / 2 / 2**20, "half of the bf16 bytes, the scales forgotten"),
    "5": (4 * zipf_probs(8)[0].item(), "ep p_1, the second expert on the slowest rank forgotten"),
    "6": (2 * (32 - 1) / 32 * (64 // 8) * 50e6 * 2 / 1e9, "the ring over all 32 ranks instead of edp = 4"),
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {q: [wrong] for q, wrong in WRONG.items()}
MISTAKES["2"].append((dispatch_bytes(4096, 8, 64, 7168) / 1e6, "MB taken for MiB"))
MISTAKES["4"].append((dispatch_bytes(4096, 8, 64, 7168) / 2**20, "FP8 dispatch forgotten: the bf16 bytes"))
MISTAKES["4"].append((dispatch_bytes(4096, 8, 64, 7168, bytes_per_elem=1, scale_block=128, scale_bytes=1)
                      / 2**20, "one-byte UE8M0 scales (DeepEP's low-latency use_ue8m0), not fp32 ones"))
# Exercise 4's UE8M0 answer lies 0.8 % above the scales-forgotten one: at the usual 1 % each would be
# taken for the other, so its answers are checked to 0.3 % (the right one is 2.3 % above the UE8M0 one).
REL = {"4": 0.003}
MISTAKES["5"].append((1.0, "uniform routing assumed: the slowest rank at the mean"))
MISTAKES["6"].append((2 * (4 - 1) / 4 * 64 * 50e6 * 2 / 1e9,
                      "every expert's gradient reduced, not the 64/ep = 8 a rank holds"))


def check(question, answer, rel=None):
    from labs.measure import exercises
    if rel is None:
        rel = REL.get(exercises.question_key(EXERCISES, question), 0.01)
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES)
