"""Chapter 14: the planner's fitted constants, recorded: one matmul efficiency eta per GPU generation and
precision, each fitted by `labs.planning.checked.calibration` on one published row (named beside it) so
that the planner's estimate of that row equals its published TFLOP/s. The planner runs without the
checked set (on the site, from the command line) with these; tests/test_planner_model.py fits them
again and fails, naming the new values, when a change to the planner moved them.
"""
# (generation, precision): (eta, the published row it was fitted on)
ETA = {
    ("A100", "bf16"): (0.6251157556427643, "GPT 145.6B"),
    ("H100", "bf16"): (0.509375534276478, "Megatron-LM H100, GPT 177B"),
    ("H100", "fp8"): (0.4795436172513291, "NeMo 24.07 GPT3-175B, 128 GPUs"),
    ("H100 96GB 500W", "bf16"): (0.5093455171445385, "torchtitan 70B FSDP 32 TP 8, bf16, vanilla TP"),
    ("H100 96GB 500W", "fp8"): (0.4499637841479853,
                                "torchtitan 70B FSDP 32 TP 8, fp8 tensorwise, vanilla TP"),
}


def eta(generation, precision):
    """The recorded eta of a generation and precision; one sentence when none was fitted."""
    if (generation, precision) not in ETA:
        fitted = ", ".join(f"{g} {p}" for g, p in ETA)
        raise ValueError(f"no published run calibrates {generation} in {precision} (fitted: {fitted}); "
                         "give eta yourself.")
    return ETA[generation, precision][0]
