"""The nugget model: a LLaMA base with encoder/decoder LoRA adapters and the Scorer, the attention readers that
capture and read nuggets, the positions they are composed at, the checkpoint files of its trained parts, and the
frozen model's pass over documents with the training-free importance of their positions."""

from .nugget_model import NuggetModel

__all__ = ["NuggetModel"]
