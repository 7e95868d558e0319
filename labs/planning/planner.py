"""Chapter 14: the planner as a command and as a widget. The planner itself, every layout of a job ranked
or refused, is `labs.formulas.planning.planner` (torch-free: the site runs it in the browser).

    python -m labs.planning.planner --model 405B --world-size 16384 --json
"""
from labs.formulas.planning import shapes
from labs.formulas.planning.planner import Job, markdown_table, plan, tflops_per_gpu


MODELS = {"70B": shapes.LLAMA2_70B, "405B": shapes.LLAMA3_405B}


def show(model="70B", gpus=64, batch_m_tokens=4, eta=0.5):
    """The planner behind widgets (JupyterLab): Llama 2 70B or Llama 3 405B on H100 nodes."""
    from IPython.display import Markdown, display
    job = Job(MODELS[model], shapes.DGX_H100, gpus, batch_m_tokens * 2 ** 20)
    display(Markdown(markdown_table(job, plan(job, eta))))


def main(argv=None):
    from labs.launcher import cli
    p = cli.parser("Rank every layout of Llama 2 70B or Llama 3 405B on H100 nodes (one process; "
                   "--world-size is the number of GPUs).", None)
    for action in p._actions:  # the contract's options, as they read for a plan of GPUs
        if action.dest == "world_size":
            action.help = "number of GPUs to plan for, H100s in nodes of 8 (default 64)"
        elif action.dest == "timeout":
            action.help = "kept for the command-line contract; the planner starts no process (default 120)"
    p.add_argument("--model", choices=sorted(MODELS), default="70B",
                   help="Llama 2 70B or Llama 3 405B (default 70B)")
    p.add_argument("--batch-tokens", type=cli.positive_int, default=4 * 2 ** 20,
                   help="tokens in one global batch (default 4,194,304: 4M)")
    p.add_argument("--eta", type=lambda t: cli.positive_float(t, 1.0), default=0.5,
                   help="matmul efficiency, above 0 and at most 1 (default 0.5; chapter 14 calibrates it "
                        "on a published row)")
    p.add_argument("--top", type=cli.positive_int, default=5,
                   help="how many of the fastest layouts to print (default 5)")
    args = cli.parse(p, argv)
    job = Job(MODELS[args.model], shapes.DGX_H100, args.world_size or 64, args.batch_tokens)
    result = plan(job, args.eta)
    rows = [{"degrees": r["dims"].degrees(), "zero": r["plan"].zero, "recompute": r["plan"].recompute,
             "micro_batch": r["plan"].micro_batch, "v": r["plan"].v, "step_s": r["time"]["step"],
             "tflops_per_gpu": tflops_per_gpu(job, r)} for r in result["ranked"][:args.top]]
    lines = [f"{i + 1}. {r['degrees']} ZeRO-{r['zero']} {r['recompute']} b={r['micro_batch']} v={r['v']}: "
             f"{r['step_s']:.2f} s, {r['tflops_per_gpu']:.0f} TFLOP/s" for i, r in enumerate(rows)]
    cli.report({"ranked": rows, "fit": len(result["ranked"]), "rejected": len(result["rejected"])}, args,
               "\n".join(lines) or f"no layout of {job.model.name} fits on {job.gpus:,} GPUs")


if __name__ == "__main__":
    from labs.launcher import cli
    cli.main(main)
