"""Chapter 13: how often a job fails, how often to checkpoint, and what it costs.

Symbols (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 22(3)): M the job's mean time between failures, delta the time to write one
checkpoint, R the time to restart, tau the compute time between checkpoints. With failures a
Poisson process of rate 1/M, one segment of tau + delta takes in expectation (Daly 2006, his wall-time model)

    E[T_seg] = M e^{R/M} (e^{(tau + delta)/M} - 1)

and goodput (useful compute / wall time) is tau / E[T_seg]. Young 1974 (CACM 17(9)) gives the
first-order optimum tau = sqrt(2 delta M); Daly's higher-order estimate is
tau = sqrt(2 delta M) [1 + sqrt(delta/(2M))/3 + (delta/(2M))/9] - delta for delta < 2M, else M.
Hours throughout.
"""
import math
import random


def job_mtbf(per_gpu_mtbf_h, n_gpus):
    """Independent failures add their rates: N GPUs fail N times as often as one."""
    return per_gpu_mtbf_h / n_gpus


def young(delta, M):
    return math.sqrt(2 * delta * M)


def daly(delta, M):
    if delta >= 2 * M:
        return M
    x = delta / (2 * M)
    return math.sqrt(2 * delta * M) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def segment_time(tau, delta, M, R):
    """Expected wall time of one checkpointed segment of tau compute (formula in the docstring)."""
    return M * math.exp(R / M) * math.expm1((tau + delta) / M)


def goodput(tau, delta, M, R=0.0):
    return tau / segment_time(tau, delta, M, R)


def best_interval(delta, M, R=0.0):
    """The exact optimum of ``goodput`` (golden-section search: the function is unimodal in tau)."""
    lo, hi = 1e-9 * M, 10 * M
    for _ in range(200):
        a, b = hi - (hi - lo) / 1.618034, lo + (hi - lo) / 1.618034
        if goodput(a, delta, M, R) < goodput(b, delta, M, R):
            lo = a
        else:
            hi = b
    return (lo + hi) / 2


def gap_sampler(M, shape, rng):
    """Times between failures with mean M: exponential for shape 1 (Daly's Poisson process),
    otherwise Weibull of that shape (shape < 1: a decreasing hazard, failures that cluster, the
    form Schroeder & Gibson 2006 fitted to the LANL failure logs). Weibull's mean is
    scale * Gamma(1 + 1/shape), so the scale is M / Gamma(1 + 1/shape)."""
    if shape == 1.0:
        return lambda: rng.expovariate(1 / M)
    scale = M / math.gamma(1 + 1 / shape)
    return lambda: rng.weibullvariate(scale, shape)


def simulate(tau, delta, M, R, work, rng, shape=1.0):
    """Wall time to finish ``work`` hours of compute in segments of ``tau`` + a checkpoint of
    ``delta``, failures arriving as a renewal process with mean gap M (also during checkpoints and
    restarts; Poisson for shape 1); a failure loses the segment in progress and costs a restart of R."""
    gap = gap_sampler(M, shape, rng)
    wall, done = 0.0, 0.0
    next_failure = gap()
    need_restart = False
    while done < work - 1e-12:
        length = R if need_restart else min(tau, work - done) + delta
        if wall + length <= next_failure:
            wall += length
            done += 0 if need_restart else length - delta
            need_restart = False
        else:
            wall = next_failure
            next_failure = wall + gap()
            need_restart = True
    return wall


def monte_carlo(taus, delta, M, R, work, trials, seed=0, shape=1.0):
    """For each tau: goodput = work / mean wall time over ``trials`` runs, and its standard error
    (delta method: se(work / mean) = work * sd(wall) / (sqrt(trials) mean^2))."""
    rng = random.Random(seed)
    out = []
    for tau in taus:
        walls = [simulate(tau, delta, M, R, work, rng, shape) for _ in range(trials)]
        mean = sum(walls) / trials
        sd = math.sqrt(sum((w - mean) ** 2 for w in walls) / (trials - 1))
        out.append({"tau": tau, "goodput": work / mean, "se": work * sd / (math.sqrt(trials) * mean ** 2),
                    "formula": goodput(tau, delta, M, R)})
    return out


def agreement(delta, M, R=0.0, work=None, trials=400, seed=0, points=9, shape=1.0):
    """Monte Carlo against the closed form, on a grid of intervals around the closed-form optimum.

    With shape 1 the simulation makes Daly's own assumptions (Poisson failures, also during saves
    and restarts), so it checks his algebra, not his model. With shape != 1 the failures are a
    Weibull renewal process, which the formula leaves out: the rows then show by how many standard
    errors the formula misses. Returns the grid, the simulated best interval, and
    ``indistinguishable_taus``: the intervals whose simulated goodput is not distinguishable from
    the simulated best (gap below 2 standard errors of the difference)."""
    star = best_interval(delta, M, R)
    taus = sorted({star * f for f in (0.25, 0.4, 0.6, 0.8, 1.0, 1.25, 1.6, 2.5, 4.0)[:points]})
    work = work or 40 * M  # long enough for tens of failures per run
    rows = monte_carlo(taus, delta, M, R, work, trials, seed, shape)
    best = max(rows, key=lambda r: r["goodput"])
    within = [r["tau"] for r in rows
              if best["goodput"] - r["goodput"] < 2 * math.hypot(best["se"], r["se"])]
    return {"rows": rows, "closed_form_tau": star, "young_tau": young(delta, M), "daly_tau": daly(delta, M),
            "simulated_best_tau": best["tau"], "indistinguishable_taus": within,
            "closed_form_agrees": star in within, "work": work, "trials": trials, "shape": shape,
            "max_miss_in_se": max(abs(r["goodput"] - r["formula"]) / r["se"] for r in rows)}


# Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3_GPUS, LLAMA3_DAYS, LLAMA3_UNEXPECTED = 16_384, 54, 419


# the chapter's counts and checkpoint pauses (16,384, not 16,000: Llama 3's job)
def curves(per_gpu_mtbf_h, n_gpus_list=(1_000, LLAMA3_GPUS, 100_000),
           deltas=(0.5 / 60, 5 / 60, 10 / 60),
           R=10 / 60, points=60):
    """Goodput against the interval for each GPU count and checkpoint cost (for the plots)."""
    out = {}
    for n in n_gpus_list:
        M = job_mtbf(per_gpu_mtbf_h, n)
        for delta in deltas:
            star = best_interval(delta, M, R)
            taus = [star * 10 ** (k / (points - 1) * 2 - 1) for k in range(points)]  # star/10 .. 10 star
            out[(n, delta)] = {"M": M, "best_tau": star, "young_tau": young(delta, M), "daly_tau": daly(delta,
                                                                                                        M),
                               "taus": taus, "goodput": [goodput(t, delta, M, R) for t in taus],
                               "best_goodput": goodput(star, delta, M, R)}
    return out


def llama3_per_gpu_mtbf_h():
    """Per-GPU mean time between failures implied by Llama 3's count, if failures are independent."""
    return LLAMA3_DAYS * 24 / LLAMA3_UNEXPECTED * LLAMA3_GPUS


EXERCISES = {
    "1": lambda: job_mtbf(llama3_per_gpu_mtbf_h(), 100_000) * 60,          # minutes
    "2": lambda: young(1 / 60, job_mtbf(llama3_per_gpu_mtbf_h(), 16_384)) * 60,  # minutes
}

# The answers the usual mistakes give, each computed from its mistake; the checker names them.
MISTAKES = {
    "1": [(lambda: llama3_per_gpu_mtbf_h() * 60, "one GPU's MTBF: the 100,000 GPUs' rates not added"),
          # the same section's 47 planned interruptions counted too
          (lambda: job_mtbf(LLAMA3_DAYS * 24 / (LLAMA3_UNEXPECTED + 47) * LLAMA3_GPUS, 100_000) * 60,
           "the planned interruptions counted as failures too"),
          (lambda: job_mtbf(llama3_per_gpu_mtbf_h(), LLAMA3_GPUS) * 60,
           "the MTBF of Llama 3's 16,384-GPU job, not scaled to 100,000 GPUs")],
    "2": [(lambda: math.sqrt(1 / 60 * job_mtbf(llama3_per_gpu_mtbf_h(), 16_384)) * 60,
           "sqrt(delta M): Young's factor 2 left out"),
          (lambda: young(1, job_mtbf(llama3_per_gpu_mtbf_h(), 16_384)), "delta in minutes, M in hours"),
          (lambda: daly(1 / 60, job_mtbf(llama3_per_gpu_mtbf_h(), 16_384)) * 60,
           "Daly's interval, not Young's"),
          (lambda: young(1 / 60, job_mtbf(llama3_per_gpu_mtbf_h(), 16_000)) * 60,
           "16,000 GPUs for 16,384")],
}

# The tolerance: the answers are printed to 0.1 minute, a rounding of at most 0.05 / 19.3 = 0.26 %
# (exercise 2; 0.16 % for exercise 1's 30.4), so 0.5 % accepts them; the nearest slip, 16,000 GPUs
# for 16,384, moves exercise 2's answer by sqrt(16,384 / 16,000) - 1 = 1.2 %, which 0.5 % refuses.
TOLERANCE = 0.005


def check(question, answer, rel=TOLERANCE):
    from labs.measure import exercises
    return exercises.check(EXERCISES, question, answer, rel, MISTAKES)
