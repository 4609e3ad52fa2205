"""Gemma 3: text models in the engine's Gemma decoder (q/k norms, a rope per layer type); the multimodal
checkpoints (4B and up) in transformers' classes with the engine's attention, text prompts only."""
from engine.model.families import ModelFamily, register
from engine.model.gemma import GEMMA_KEYS, GemmaFamily

register(ModelFamily("gemma3_text", "Gemma 3 text models (sliding-window layers)", "gemma",
                     GemmaFamily(head_norms=True, rope_by_layer_type=True, passes_softcap=False,
                                 required=GEMMA_KEYS + ("use_bidirectional_attention",)),
                     ("gemma3",)))
register(ModelFamily("gemma3", "Gemma 3 multimodal checkpoints (4B and up), text prompts: the text decoder's "
                     "attention"))
