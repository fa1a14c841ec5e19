"""The nugget model: a LLaMA base with encoder/decoder LoRA adapters and the Scorer, the attention readers that
capture and read nuggets, the positions they are composed at, and the checkpoint files of its trained parts."""

from .nugget_model import NuggetModel

__all__ = ["NuggetModel"]
