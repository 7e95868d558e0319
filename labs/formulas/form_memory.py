"""Chapter 1's calculator: will this model's training state and activations fit one GPU?

The answer is `memory.budget` (chapter 1's formulas: a recipe's bytes per parameter sharded by
ZeRO stage, the Llama activation formula) for a preset of `memory.MODELS` or a model given by its
shapes. Not counted, as the chapter says: the logits, temporary buffers and the allocator's
fragmentation, so a thin margin is no margin.
"""
from labs.formulas import fields, memory
from labs.formulas.fields import Field
from labs.formulas.shape import ModelShape

CUSTOM = "custom"
SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
_70B = memory.MODELS["70B"]
FIELDS = (
    Field("model", "model", "choice", "70B", tuple(memory.MODELS) + (CUSTOM,),
          help="a Llama preset, or custom: the six shapes below"),
    Field("layers", "layers L", "int", str(_70B.layers), help="custom model only"),
    Field("hidden", "hidden size h", "int", str(_70B.hidden), help="custom model only"),
    Field("heads", "heads a", "int", str(_70B.heads), help="custom model only"),
    Field("kv_heads", "KV heads", "int", str(_70B.kv_heads), help="custom model only"),
    Field("ffn", "MLP width f", "int", str(_70B.ffn), help="custom model only (SwiGLU)"),
    Field("vocab", "vocabulary V", "int", str(_70B.vocab), help="custom model only"),
    Field("recipe", "precision recipe", "choice", "mixed", tuple(memory.RECIPES)),
    Field("zero", "ZeRO stage", "choice", "1", ("0", "1", "2", "3")),
    Field("dp", "data-parallel GPUs", "int", "8"),
    Field("tp", "tensor-parallel GPUs", "int", "8"),
    Field("pp", "pipeline stages", "int", "1"),
    Field("seq", "sequence length s", "int", "4096"),
    Field("micro_batch", "micro-batch b", "int", "1"),
    Field("recompute", "recomputation", "choice", "selective", ("none", "selective", "full")),
    Field("attention", "attention kernel", "choice", "flash", ("flash", "materialized")),
    Field("gpu_gib", "GPU memory (GiB)", "float", "80"),
)
F = {f.name: f for f in FIELDS}
TERMS = (("parameters", "weights"), ("gradients", "gradients"), ("optimizer_state", "optimizer state"),
         ("activations", "activations"))


def model_of(values):
    """The preset named, or the custom shapes (trained at the form's sequence length)."""
    name = fields.choice(values, F["model"])
    if name != CUSTOM:
        return name
    shape = {k: fields.whole(values, F[k]) for k in SHAPE}
    return ModelShape("custom model", **shape, seq=fields.whole(values, F["seq"]))


def answer(values):
    model = model_of(values)
    tp, pp, dp = (fields.whole(values, F[k]) for k in ("tp", "pp", "dp"))
    gib = fields.number(values, F["gpu_gib"])
    r = memory.budget(model, dp * tp * pp, tp=tp, pp=pp, zero_stage=int(fields.choice(values, F["zero"])),
                      recipe=fields.choice(values, F["recipe"]), seq=fields.whole(values, F["seq"]),
                      micro_batch=fields.whole(values, F["micro_batch"]),
                      recompute=fields.choice(values, F["recompute"]), sp=tp > 1,
                      attention=fields.choice(values, F["attention"]), gpu_gib=gib)
    g = r["gib_per_device"]
    gap = gib - g["total"]
    name = memory.MODELS[model].name if isinstance(model, str) else model.name
    verdict = (f"fits, with {gap:,.1f} GiB to spare" if gap >= 0 else
               f"does not fit: {-gap:,.1f} GiB over")
    rows = [[label, f"{g[key]:,.1f}", f"{g[key] / g['total']:.0%}"] for key, label in TERMS]
    rows.append(["total", f"{g['total']:,.1f}", "100%"])
    return {"ok": True,
            "summary": f"{name} ({r['params'] / 1e9:,.1f} billion parameters) on "
                       f"{r['world_size']:,} GPUs: {g['total']:,.1f} GiB per GPU against {gib:g} GiB, "
                       f"{verdict}. Not counted: the logits, temporary buffers and fragmentation.",
            "table": {"head": ["per GPU", "GiB", "share"], "rows": rows},
            "svg": fields.stacked_bars_svg([("", [(label, g[key]) for key, label in TERMS])], "GiB per GPU",
                                           gib, "the GPU's memory")}
