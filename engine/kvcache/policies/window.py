"""StreamingLLM-style window: the first S tokens (sinks) and the newest W tokens exact, nothing else.
W defaults to what gives the device bytes of specache at the planned length (a fair comparison)."""
from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.kvcache.base import ModelShape
from engine.kvcache.guided import GuidedLayer, Layout
from engine.kvcache.registry import register
from engine.kvcache.sizes import window_tokens


@register("window")
class WindowLayer(GuidedLayer):
    listed = 3  # its place in --cache's list (engine.kvcache.registry)
    # the planner sizes it as kivi (no column of its own): window's default W gives it specache's device bytes
    plan_column, plan_mode = False, "kivi"
    own_settings = ("window",)  # --window / a bench label's w<n>
    decode_launches = (54, 20)  # (CacheLayer.decode_launches)

    @classmethod
    def layout(cls, shape: ModelShape, config: CacheConfig, max_len: int, dtype: torch.dtype) -> Layout:
        """No guide: the window is exact (its width, W, is the residual), one token at a time."""
        window = config.window or window_tokens(shape, max_len, config.bits, config.group, config.fetch_k(max_len),
                                                config.residual, torch.finfo(dtype).bits // 8)
        return Layout(topk=0, use_guide=False, residual=window, group=1)
