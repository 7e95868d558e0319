"""Chapter 8: bit layouts from torch.finfo, FP16 underflow, the hand scaler beside GradScaler."""
import pytest
import torch

from labs.precision import loss_scaling as ls

# compares floating-point results: `make test` runs it under another CPU's rounding
pytestmark = pytest.mark.numerics


def test_formats_match_the_published_maxima_and_layouts():
    f = ls.formats()
    # E4M3 448 and E5M2 57,344: Micikevicius et al. 2022, Table 1; FP16 65,504: IEEE 754 binary16.
    assert (f["fp8_e4m3"]["max"], f["fp8_e5m2"]["max"], f["fp16"]["max"]) == (448.0, 57344.0, 65504.0)
    assert ([(f[k]["exponent_bits"], f[k]["mantissa_bits"]) for k in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")]
            == [(5, 10), (8, 7), (4, 3), (5, 2)])
    # the notes' FP16 range starts at 6e-5, the smallest *normal*; subnormals reach 2^-24 (about 6e-8)
    assert f["fp16"]["smallest_subnormal"] == 2.0 ** -24 and f["fp16"]["smallest_normal"] == 2.0 ** -14
    assert f["bf16"]["smallest_normal"] == f["fp32"]["smallest_normal"]  # same 8-bit exponent


def test_the_cast_check_refuses_a_misread_maximum():
    # formats() asserts that max survives a cast and max + one step does not; a maximum misread as
    # E4M3's IEEE-style 240 or E5M2's 57,344 would survive the step above it and be caught
    assert ls._survives(448.0, torch.float8_e4m3fn) and not ls._survives(448.0 + 32, torch.float8_e4m3fn)
    assert ls._survives(240.0 + 16, torch.float8_e4m3fn)
    assert not ls._survives(57344.0, torch.float8_e4m3fn)
    assert not ls._survives(65504.0 + 32, torch.float16)


def test_loss_scale_rescues_fp16_gradients_and_bf16_never_loses_them():
    rows = {(r["format"], r["scale"]): r for r in ls.underflow()["rows"]}
    assert rows[("fp16", 1)]["zero"] > 0.5                    # most of the sample is below 2^-24
    assert rows[("fp16", 2 ** 16)]["zero"] < rows[("fp16", 1)]["zero"] / 10
    assert rows[("fp16", 2 ** 24)]["inf"] > 0                 # too large a scale overflows the top
    # a cast rounds correctly on every CPU; bf16's range holds the whole sample: no value becomes 0
    assert all(rows[("bf16", s)]["zero"] == 0 for s in (1, 2 ** 24))


def test_hand_scaler_follows_gradscaler_step_by_step():
    r = ls.scaler_trace(steps=14, init_scale=2.0 ** 22, growth_interval=3, spike_step=9)
    # same scales, same skips, same weights, bit for bit: both multiply by 1/S (a power of two,
    # exact) and run the same SGD step on the same shapes
    assert r["hand"] == r["torch"] and r["params_equal"]
    scales = [s["scale"] for s in r["hand"]]
    skipped = [s["skipped"] for s in r["hand"]]
    # back-off: overflowing steps are skipped and halve S; growth: 3 clean steps double it
    for i in range(len(scales) - 1):
        if skipped[i]:
            assert scales[i + 1] == scales[i] / 2
    first_clean = skipped.index(False)
    assert skipped[first_clean:first_clean + 3] == [False] * 3
    assert scales[first_clean + 3] == 2 * scales[first_clean]


class _KeepsCounting(ls.DynamicScaler):
    """The plausible bug: an overflow halves S but does not restart the clean-step count, and
    growth fires at >= interval."""

    def update(self):
        if self.found_inf:
            self.s *= self.backoff
        else:
            self.clean += 1
            if self.clean >= self.interval:
                self.s *= self.growth
                self.clean = 0


def test_a_scaler_that_keeps_counting_through_an_overflow_is_caught():
    r = ls.scaler_trace(steps=14, init_scale=2.0 ** 22, growth_interval=3, spike_step=9)
    skipped = [s["skipped"] for s in r["torch"]]
    # the outlier batch overflows one clean step into a run: the count must restart there
    assert skipped[8:10] == [False, True]
    wrong, _ = ls._run_scaler(_KeepsCounting(init_scale=2.0 ** 22, growth_interval=3), 14, spike_step=9)
    assert wrong != r["torch"]
    # GradScaler grows three clean steps after the overflow; the buggy scaler one step early
    grew = [t for t in range(10, 13) if r["torch"][t + 1]["scale"] > r["torch"][t]["scale"]]
    grew_wrong = [t for t in range(10, 13) if wrong[t + 1]["scale"] > wrong[t]["scale"]]
    assert grew == [12] and grew_wrong == [11]


def test_a_scaler_that_never_backs_off_is_caught():
    r = ls.scaler_trace(steps=6)
    wrong = ls.DynamicScaler(init_scale=2.0 ** 22, backoff_factor=1.0, growth_interval=3)
    trace, _ = ls._run_scaler(wrong, 6)
    assert trace != r["torch"]
    assert all(s["skipped"] for s in trace)  # stuck above FP16's range: no step is ever taken


def test_bf16_tracks_fp32_fp16_stalls_and_loss_scaling_recovers():
    runs = {m: ls.track(m, steps=6) for m in ls.TRACK_MODES}
    ref = torch.tensor(runs["fp32"]["losses"])
    # BF16 autocast rounds activations to 8 significant bits: losses agree to about 1e-2 relative
    torch.testing.assert_close(torch.tensor(runs["bf16"]["losses"]), ref, rtol=1e-2, atol=0)
    # FP16 loss scaling recovers the FP32 run up to FP16 rounding (11 bits): 1e-3 relative
    torch.testing.assert_close(torch.tensor(runs["fp16_scaled"]["losses"]), ref, rtol=1e-3, atol=0)
    assert runs["fp16"]["zero_grad_fraction"][0] == 1.0   # every gradient underflowed
    assert runs["fp16"]["losses"][-1] > ref[-1] + 0.1     # and the model did not learn


def test_the_loss_weight_is_invisible_to_fp32_adam_only_with_eps_scaled_too():
    r = ls.weight_invisible("fp32", steps=2)
    assert r["equal_with_eps_scaled"] and not r["equal_with_eps_fixed"]
    assert not ls.weight_invisible("fp16", steps=2)["equal_with_eps_scaled"]   # FP16 underflows


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown mode 'fp8'"):
        ls.track("fp8")


def test_exercise_answers_agree_with_a_cast():
    from labs.precision import fp8
    bound = ls.EXERCISES["2"]()
    x = torch.tensor([[1792.0, bound * 1.01, bound * 0.99]])  # amax 1792 sets the per-tensor scale
    q, _ = fp8.quantize(x, "tensor")
    assert q.float()[0, 1] != 0 and q.float()[0, 2] == 0  # the flush-to-zero bound, measured
    s = ls.EXERCISES["1"]()
    assert (torch.tensor(2.0 ** -30 * s, dtype=torch.float16).item()
            == torch.finfo(torch.float16).smallest_normal)


def test_what_bf16_autocast_keeps_in_fp32_in_the_tiny_gpt():
    # the page's claim, on this build: CPU autocast runs the matrix products in bf16; layer norm is
    # fp32 because its input, the residual stream, is fp32 (autocast does not lower it on CPU), the
    # attention softmax runs in bf16, and the loss is fp32 because the model casts its logits
    from labs import model
    cfg = model.GPTConfig()
    net = model.build(cfg)
    seen = {}
    for name, m in net.named_modules():
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.Linear)):
            m.register_forward_hook(lambda mod, i, o, name=name: seen.setdefault(name, o.dtype) and None)
    x, y = model.synthetic_batch(cfg, 2, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = net(x, y)
        scores = torch.nn.functional.linear(torch.randn(2, 8), torch.randn(8, 8))
        assert scores.dtype == torch.bfloat16 and scores.softmax(-1).dtype == torch.bfloat16
        assert torch.nn.functional.layer_norm(scores, (8,)).dtype == torch.bfloat16
    assert loss.dtype == torch.float32
    assert {seen[k] for k in seen if k.endswith(("ln1", "ln2", "ln_f"))} == {torch.float32}
    assert {seen[k] for k in seen if isinstance(net.get_submodule(k), torch.nn.Linear)} == {torch.bfloat16}
