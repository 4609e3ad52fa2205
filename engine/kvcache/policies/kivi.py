"""KIVI with a residual window (k = 0): attention reads the 1/2-bit guide, the sinks and the exact
recent window; nothing is fetched. SpeCache's k = 0 limit (a test)."""
from __future__ import annotations

from engine.kvcache.guided import GuidedLayer
from engine.kvcache.registry import register


@register("kivi")
class KiviLayer(GuidedLayer):
    listed = 2  # its place in --cache's list (engine.kvcache.registry)
    fixed_settings = {"k": 0}  # SpeCache's k = 0 limit: nothing is ever fetched (GuidedLayer.layout is kivi's)
    decode_launches = (77, 20)  # (CacheLayer.decode_launches)
