"""Qwen3: an RMSNorm over each head's q and k before RoPE; sliding windows on the layers layer_types names."""
from engine.model.families import ModelFamily, register
from engine.model.llama import NO, STRUCTURE, Family, flag

register(ModelFamily("qwen3", "Qwen3", "llama",
                     Family(flag("attention_bias"), flag("attention_bias"), NO, head_norms=True, windows="layer_types",
                            required=STRUCTURE + ("head_dim", "attention_bias", "sliding_window", "layer_types")),
                     ("qwen3",)))
