"""Llama (engine.model.llama's defaults: biases where the config's attention_bias / mlp_bias say)."""
from engine.model.families import ModelFamily, register
from engine.model.llama import Family, flag

register(ModelFamily("llama", "Llama (also llama3 rope scaling)", "llama",
                     Family(flag("attention_bias"), flag("attention_bias"), flag("mlp_bias")), ("llama",)))
