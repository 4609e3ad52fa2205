"""Mistral: no biases; a sliding window on every layer where the config sets one."""
from engine.model.families import ModelFamily, register
from engine.model.llama import NO, STRUCTURE, Family

register(ModelFamily("mistral", "Mistral, with and without a sliding window", "llama",
                     Family(NO, NO, NO, windows="config", required=STRUCTURE + ("head_dim", "sliding_window")),
                     ("mistral",)))
