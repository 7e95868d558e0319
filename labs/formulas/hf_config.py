"""Any model from its Hugging Face ``config.json``: the `ModelShape` the planner and the calculators take.

The fields read, by the architectures that name them (Hugging Face transformers' configuration classes):
- every decoder: ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``
  (absent: as many as the heads, no GQA), ``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``,
  ``head_dim`` where the heads are wider than hidden / heads (Qwen3);
- Mixtral (``MixtralConfig``): ``num_local_experts``, ``num_experts_per_tok``, every layer an MoE of experts
  ``intermediate_size`` wide;
- Qwen3-MoE and Qwen2-MoE: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``
  (``mlp_only_layers`` and ``decoder_sparse_step`` other than 1 are refused: the shape has one run of
  dense layers only);
- DeepSeek-V2/V3: ``n_routed_experts``, ``n_shared_experts``, ``moe_intermediate_size``,
  ``first_k_dense_replace`` and multi-head latent attention (``kv_lora_rank``, ``q_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``).
The sequence is the training run's, not the config's ``max_position_embeddings``: it is an argument.
A field the architecture needs and the file lacks is one sentence naming it.
"""
import json

from labs.formulas.shape import ModelShape


def _need(cfg, key, name):
    if key not in cfg:
        raise ValueError(f"{name}: config.json has no {key!r}, which the model's shape needs.")
    return cfg[key]


def shape_from_config(cfg, seq, name=None):
    """The `ModelShape` of a config.json's dict, trained at sequence ``seq``."""
    name = name or cfg.get("_name_or_path") or "/".join(cfg.get("architectures", [])) or "model from config"
    need = lambda key: _need(cfg, key, name)   # noqa: E731 (reads as the sentence it raises)
    heads = need("num_attention_heads")
    shape = dict(layers=need("num_hidden_layers"), hidden=need("hidden_size"), heads=heads,
                 kv_heads=cfg.get("num_key_value_heads") or heads, ffn=need("intermediate_size"),
                 vocab=need("vocab_size"), seq=seq, tied=bool(cfg.get("tie_word_embeddings", False)))
    if cfg.get("head_dim") and cfg["head_dim"] * heads != shape["hidden"]:
        shape["head_width"] = cfg["head_dim"]
    if "num_local_experts" in cfg:                                  # Mixtral
        shape.update(experts=cfg["num_local_experts"], top_k=need("num_experts_per_tok"),
                     expert_ffn=shape["ffn"])
    elif "num_experts" in cfg and cfg["num_experts"]:               # Qwen3-MoE, Qwen2-MoE
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{name}: dense layers between the MoE layers (mlp_only_layers, "
                             "decoder_sparse_step) are not a shape the planner takes.")
        shape.update(experts=cfg["num_experts"], top_k=need("num_experts_per_tok"),
                     expert_ffn=need("moe_intermediate_size"))
    elif "n_routed_experts" in cfg:                                 # DeepSeek-V2, V3
        shape.update(experts=cfg["n_routed_experts"], top_k=need("num_experts_per_tok"),
                     expert_ffn=need("moe_intermediate_size"),
                     dense_layers=cfg.get("first_k_dense_replace", 0),
                     shared_experts=cfg.get("n_shared_experts") or 0)
        if "kv_lora_rank" in cfg:
            shape["mla"] = (need("kv_lora_rank"), need("q_lora_rank"), need("qk_nope_head_dim"),
                            need("qk_rope_head_dim"))
    return ModelShape(name, **shape)


def load(path, seq, name=None):
    """`shape_from_config` of the config.json at ``path``; an unreadable file is one sentence."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path} as a config.json: {exc}.") from None
    return shape_from_config(cfg, seq, name)
