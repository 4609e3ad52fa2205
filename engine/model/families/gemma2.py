"""Gemma 2: attention-logit softcapping passed to the attention function; sliding-window layers."""
from engine.model.families import ModelFamily, register
from engine.model.gemma import GEMMA_KEYS, GemmaFamily

register(ModelFamily("gemma2", "Gemma 2 (attention-logit softcapping, sliding-window layers)", "gemma",
                     GemmaFamily(head_norms=False, rope_by_layer_type=False, passes_softcap=True, required=GEMMA_KEYS),
                     ("gemma2",)))
