"""Chapter 14: the planner as a command. The planner itself, every layout of a job ranked or refused, is
`labs.formulas.planning.planner` (torch-free: the site runs it in the browser, through the same form,
`labs.formulas.form_planner`, that this command fills in, so both answer and refuse alike).

    python -m labs.planning.planner --model 405B --world-size 16384 --batch-tokens 16777216
    python -m labs.planning.planner --config path/to/config.json --world-size 64 --seq 8192 --json
"""
from labs.formulas import fields, form_planner, hf_config

GPUS = {"h100": "H100 80GB (DGX H100)", "a100": "A100 80GB (DGX A100)",
        "h100-96gb": "H100 96GB (Grand Teton)"}
STACKS = {"any": "any", "megatron-core": "Megatron-Core", "torchtitan": "torchtitan"}


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Which layout? Every layout of a training job ranked by its estimated step time, with "
                   "memory, headroom and step-time terms, or the reason none fits (one process; "
                   "--world-size is the number of GPUs).", None)
    for action in p._actions:  # the contract's options, as they read for a plan of GPUs
        if action.dest == "world_size":
            action.help = "number of GPUs to plan for, in nodes of 8 (default 64)"
        elif action.dest == "timeout":
            action.help = "kept for the command-line contract; the planner starts no process (default 120)"
    p.add_argument("--model", choices=list(form_planner.MODELS), default="70B",
                   help="a preset (default 70B: Llama 2 70B)")
    p.add_argument("--config", help="a Hugging Face config.json (Llama, Mixtral, Qwen3-MoE, DeepSeek-V3 "
                                    "shapes); replaces --model")
    p.add_argument("--gpu", choices=list(GPUS), default="h100",
                   help="the GPUs and their links (default h100)")
    p.add_argument("--batch-tokens", default="4194304", help="tokens in one global batch (default 4,194,304)")
    p.add_argument("--seq", help="the training sequence length (default: the preset's; 4096 with --config)")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16", help="the matmuls' (default bf16)")
    p.add_argument("--stack", choices=list(STACKS), default="any",
                   help="what the planner may choose and what it overlaps (default any)")
    p.add_argument("--eta", type=lambda t: cli.positive_float(t, 1.0), default=None,
                   help="matmul efficiency, above 0 and at most 1 (default: the fit for the GPU's generation "
                        "and precision, labs/formulas/planning/calibrated.py)")
    p.add_argument("--top", type=cli.positive_int, default=5,
                   help="how many of the fastest layouts to print (default 5)")
    args = cli.parse(p, argv)
    default_seq = form_planner.MODELS[args.model].seq if not args.config else 4096
    values = {"model": args.model, "gpus": str(args.world_size or 64), "cluster": GPUS[args.gpu],
              "batch_tokens": args.batch_tokens, "seq": args.seq or str(default_seq),
              "precision": args.precision, "stack": STACKS[args.stack]}
    model = None
    if args.config:
        model = hf_config.load(args.config, fields.whole(values, form_planner.F["seq"]))
    result = form_planner.answer(values, model, args.eta, args.top)
    cli.report({"summary": result["summary"], "table": result["table"]}, args, fields.text(result))


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
