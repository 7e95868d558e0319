"""Chapter 6: Megatron sequence parallelism equals TP and one process, moves TP's bytes as an
all-gather plus a reduce-scatter, and keeps Table 2's activations per rank (Korthikanti et al. 2022)."""
import json
import os
import subprocess
import sys

import pytest

from labs.launcher import launch
from labs.context_parallel import sequence_parallel as sp

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32: TP and TP+SP sum t partial products where one process sums one long dot product, and the
# LayerNorm gradients add t partial sums: the same additions in another order, a few ulps of
# values of order 1. A wrong token slice, a missing reduce-scatter or an unsynced LayerNorm
# gradient errs by order 1.
TOL = 1e-5
FORWARD = ["g forward all-gather", "g-bar forward reduce-scatter"] * 2
BACKWARD = ["g-bar backward all-gather", "g backward reduce-scatter", "backward re-gather of the input"] * 2


@pytest.fixture(scope="module")
def job():
    """t = 3, the odd degree the notebook skips: the block, Table 2, the gathered input kept, and
    PyTorch's SequenceParallel, in one job. t = 2 and 4 run in the notebook, whose cells assert the
    same equalities, counts and table rows (nbval runs them natively and under OTHER_CPU)."""
    return launch.spawn(sp.lab, 3, 2, 12, 48, True, True, timeout=300)


def test_sp_block_equals_tp_and_one_process_and_keeps_table_2(job):
    b, s, h, t = 2, 12, 48, 3
    bsh4 = b * s * h * 4                                      # one fp32 activation of the whole sequence
    for r in job:
        c = r["check"]
        assert max(c["max_abs_error"], c["max_abs_error_grad"]) < TOL, c
        assert max(c["max_abs_error_vs_tp"], c["max_abs_error_grad_vs_tp"]) < TOL, c
        # 2 all-gathers + 2 reduce-scatters in forward, the conjugates in backward, read from the
        # tensors handed over: an all-gather sends its s/t-token shard, a reduce-scatter takes all s
        assert c["forward_ops"] == FORWARD and c["backward_ops"] == BACKWARD
        assert c["forward_payloads"] == [bsh4 // t, bsh4] * 2
        assert c["tp_payloads"] == [bsh4] * 4
        # counted messages of the hand rings: SP's forward sends exactly what TP's all-reduces send,
        # 2 x 2(t-1)/t x bsh; backward adds the two re-gathers, (t-1)/t x bsh each
        sent = c["counted_bytes_sent"]
        assert sent["sp_forward"] == sent["tp_forward"] == 2 * 2 * (t - 1) * bsh4 // t
        assert sent["sp_backward"] - sent["tp_backward"] == 2 * (t - 1) * bsh4 // t
        # the formula the book applies at GPT-3 scale, checked here against both counts
        formula = sp.forward_bytes_per_layer(b, s, h, t, bytes_per_elem=4)
        assert (sent["sp_forward"], sent["tp_forward"]) == (formula["sp"], formula["tp"])
        # the LayerNorm weights and biases and the two row-parallel biases: h fp32 values each
        assert c["param_ops"] == ["parameter-gradient all-reduce"] * 6 and c["param_payloads"] == [h * 4] * 6
        table = r["table"]
        for row, v in table.items():
            assert v["measured"] == v["formula"] + v["layernorm_stats"], (row, v)
        # written out here rather than through labs.memory_budget.activations: TP+SP with selective recompute
        # keeps 34 bytes per token and hidden unit, split t ways; saving the gathered input would not
        assert table["tp_sp_selective"]["measured"] == 34 * s * b * h // t + 2 * (s * b // t) * 4
        # TP alone with the attention core recomputed: 10 bytes per token and hidden unit stay whole
        assert table["tp_selective"]["measured"] == 10 * s * b * h + 24 * s * b * h // t + 2 * (s * b) * 4
        assert table["tp_sp_keep_gathered"]["measured"] > table["tp_sp"]["measured"]
        assert table["tp_sp_full"]["measured"] * t == table["tp_full"]["measured"] == 2 * s * b * h


def test_keeping_the_gathered_input_makes_backward_exactly_tps(job):
    for c in (r["keep_gathered"] for r in job):
        assert max(c["max_abs_error"], c["max_abs_error_grad"]) < TOL, c
        assert c["backward_ops"] == ["g-bar backward all-gather", "g backward reduce-scatter"] * 2
        assert c["counted_bytes_sent"]["sp_backward"] == c["counted_bytes_sent"]["tp_backward"]


def test_pytorch_sequence_parallel_matches_the_hand_version(job):
    for r in (x["dtensor"] for x in job):
        assert r["max_abs_error"] < TOL and r["max_abs_error_grad"] < TOL, r["grad_errors"]
        # DTensor leaves the LayerNorm gradients as unsummed partials, the sum `sync_grads` does
        assert r["partial_grads"] == ["ln1.bias", "ln1.weight", "ln2.bias", "ln2.weight"]
        assert r["placements"]["attn.qkv.weight"] == "(Shard(dim=0),)"


def test_a_sequence_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="s = 10 is not divisible by tp = 3"):   # before any collective
        sp.check_block(0, 3, 2, 10)


def test_command_line_contract():
    run = [sys.executable, "-m", "labs.context_parallel.sequence_parallel"]
    out = subprocess.run(run + ["--world-size", "2", "--json"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["max_abs_error"] < TOL and r["max_abs_error_grad"] < TOL and r["forward_ops"] == FORWARD
    assert {row: v["measured"] - v["layernorm_stats"] for row, v in r["activation_bytes"].items()} == \
        {row: v["formula"] for row, v in r["activation_bytes"].items()}
    bad = subprocess.run(run + ["--world-size", "2", "--seq", "7"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--seq 7 must be divisible" in bad.stderr and "Traceback" not in bad.stderr
