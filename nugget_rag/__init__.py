"""nugget-rag: Dodo nugget compression for LangChain RAG.

text -> tokens -> encoder + Scorer -> NuggetState (cached in a NuggetStore) -> decoder -> text.
"""

from .compressor import NuggetCompressor
from .config import LoraSettings, NuggetConfig
from .generation import GenerationSettings, generate, stream_generate
from .llm import NuggetLLM
from .model import NuggetModel
from .prompts import QA_PROMPT, SUMMARY_PROMPT
from .state import CorruptStateError, NuggetState
from .store import DirectoryByteStore, NuggetStore, StoreUnavailableError

__all__ = [
    "CorruptStateError", "DirectoryByteStore", "GenerationSettings", "LoraSettings", "NuggetCompressor",
    "NuggetConfig", "NuggetLLM", "NuggetModel", "NuggetState", "NuggetStore", "QA_PROMPT", "SUMMARY_PROMPT",
    "StoreUnavailableError",
    "generate", "stream_generate",
]
