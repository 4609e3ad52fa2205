"""Qwen2: q/k/v biases; sliding windows on the layers layer_types names."""
from engine.model.families import ModelFamily, register
from engine.model.llama import NO, STRUCTURE, YES, Family

register(ModelFamily("qwen2", "Qwen2, with and without sliding-window layers", "llama",
                     Family(YES, NO, NO, windows="layer_types", required=STRUCTURE + ("sliding_window", "layer_types")),
                     ("qwen2",), qkv_bias=True))
