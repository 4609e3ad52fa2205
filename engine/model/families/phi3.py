"""Phi-3: one qkv_proj and one gate_up_proj; a sliding window on every layer where the config sets one."""
from engine.model.families import ModelFamily, register
from engine.model.llama import NO, STRUCTURE, Family

register(ModelFamily("phi3", "Phi-3, with and without a sliding window", "llama",
                     Family(NO, NO, NO, windows="config", required=STRUCTURE + ("sliding_window",), fused=True),
                     ("phi3",)))
