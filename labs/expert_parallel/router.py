"""Chapter 7: the router. Which experts each token goes to, and which pairs overflow capacity.

Top-k routing (Fedus et al. 2021, "Switch Transformers", sections 2.1-2.2; k > 1 as in GShard,
Lepikhin et al. 2020): p_i(x) = softmax(x W_r)_i over N experts, each token to its k highest, an
expert taking at most C = ceil(T k / N * capacity factor) pairs. DeepSeek-V3's balancing bias and
node-limited routing (DeepSeek-AI 2024, section 2.1.2) change the choice, never the gates. The
router z-loss of ST-MoE (Zoph et al. 2022) acts on the logits.

Every routing records how far its choices are from a tie (`choice_margin`): a choice is the same
on every CPU when that margin exceeds the rounding another CPU can add (`margin_bound`), so the
counts that follow from routing (loads, drops, bytes) are the same on every machine.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def capacity(tokens, experts, top_k, capacity_factor):
    """Switch section 2.2, eq. 3: expert capacity = tokens / experts * capacity factor, with the T*k
    routed (token, expert) pairs as the tokens (k = 1 in Switch; GShard section 2.2 gives each group
    of S tokens 2S/E slots per expert at top-2, the same count at capacity factor 1)."""
    return math.ceil(tokens * top_k / experts * capacity_factor)


@dataclass
class Routing:
    probs: torch.Tensor  # (T, N) router probabilities p_i(x)
    idx: torch.Tensor    # (T, k) chosen experts
    gates: torch.Tensor  # (T, k) their probabilities, the weights of the combine
    keep: torch.Tensor   # (T, k) False where the pair overflowed its expert's capacity
    margin: float = math.inf  # smallest gap between a chosen and an unchosen score, over tokens
    logits: torch.Tensor = None  # (T, N) the router's logits x W_r, for the z-loss


def margin_bound(experts):
    """How far the gap between two fp32 routing scores can move from one CPU to another.

    A score is an exp (about 1 ulp), a sum of N terms (N ulps), a division (1 ulp) and, with
    DeepSeek-V3's bias, an addition (1 ulp) away from exact: at most (N + 3)u for a score below 1,
    u = 2^-24. Two CPUs' values of one score are then within 2(N + 3)u, and a gap between two
    scores within 4(N + 3)u: a top-k choice whose margin exceeds that is the same on every CPU."""
    return 4 * (experts + 3) * 2.0 ** -24


def choice_margin(scores, top_k):
    """min over tokens of (k-th largest score - (k+1)-th largest): how far every top-k choice is
    from a tie. Another CPU rounds the fp32 scores differently by about 1e-7 (they lie in [0, 1]),
    so a choice is the same on every machine when this margin is well above that."""
    if top_k >= scores.shape[-1]:
        return math.inf
    top = scores.topk(top_k + 1, dim=-1).values                # (T, k+1), descending
    gap = top[:, top_k - 1] - top[:, top_k]
    return gap.min().item()


def node_mask(scores, experts_per_node, max_nodes, top_k):
    """DeepSeek-V3 section 2.1.2, node-limited routing: keep the experts of the M = ``max_nodes``
    nodes with the highest sums of their top K_r/M scores; the others are masked out."""
    if top_k % max_nodes:
        raise ValueError(f"top-k = {top_k} is not divisible by the node limit M = {max_nodes}; "
                         "choose an M that divides k.")
    t, n = scores.shape
    per_node = scores.view(t, n // experts_per_node, experts_per_node)  # (T, nodes, N/nodes)
    node_score = per_node.topk(top_k // max_nodes, dim=-1).values.sum(-1)  # (T, nodes)
    chosen = node_score.topk(max_nodes, dim=-1).indices
    allowed = torch.zeros_like(node_score, dtype=torch.bool).scatter_(1, chosen, True)
    # a node score sums K_r/M scores (K_r/M additions more), so its rounding is about K_r/M + 1
    # times a score's: its margin, divided by that, compares with `margin_bound` like a score's
    margin = choice_margin(node_score, max_nodes) / (top_k // max_nodes + 1)
    return allowed.repeat_interleave(experts_per_node, dim=1), margin  # (T, N), float


def route(logits, top_k, cap=None, bias=None, experts_per_node=None, max_nodes=None):
    """Top-k routing with capacity ``cap`` (None: no limit). ``bias`` (N,) is DeepSeek-V3's
    balancing bias b_i: added to the scores for the choice of experts only, never to the gates.

    Priority inside an expert: every first choice before any second choice, then token order, so
    a token loses its second expert before another token loses its first (GShard's Algorithm 1
    fills the buffers with all first choices, then all second choices).
    """
    probs = logits.softmax(-1)                                 # (T, N)
    scores = probs.detach() if bias is None else probs.detach() + bias
    node_margin = math.inf
    if max_nodes is not None:
        allowed, node_margin = node_mask(scores, experts_per_node, max_nodes, top_k)
        scores = scores.masked_fill(~allowed, -math.inf)
    idx = scores.topk(top_k, dim=-1).indices                   # (T, k)
    gates = probs.gather(1, idx)                               # (T, k)
    t, n = probs.shape
    onehot = F.one_hot(idx.t().reshape(-1), n)                 # (k*T, N), choice-major order
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1         # place in its expert's queue
    keep = torch.ones_like(idx, dtype=torch.bool) if cap is None else (position < cap).view(top_k, t).t()
    return Routing(probs, idx, gates, keep, min(choice_margin(scores, top_k), node_margin), logits)


def router_z_loss(logits):
    """Zoph et al. 2022 (ST-MoE), section 3: L_z = (1/T) sum_t (log sum_j exp(x_tj))^2 over the T
    tokens' router logits x (T, N). It pulls each token's log-partition toward 0; since
    max_j x_j <= logsumexp(x) <= max_j x_j + log N, that holds the largest logit near 0 (the
    exponentials the softmax sums stay small: their motivation, bf16 roundoff), not the smallest."""
    return logits.logsumexp(-1).square().mean()
