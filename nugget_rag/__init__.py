"""nugget-rag: Dodo nugget compression for LangChain RAG.

text -> tokens -> encoder + Scorer -> NuggetState (cached in a NuggetStore) -> decoder -> text.
"""

from .autoregressive import NuggetStream
from .compressor import NuggetCompressor
from .config import LoraSettings, NuggetConfig, StreamSettings
from .directory_store import DirectoryByteStore
from .generation import GenerationSettings, generate, stream_generate
from .llm import NuggetLLM
from .model import NuggetModel
from .prompts import QA_PROMPT, SUMMARY_PROMPT
from .state import CorruptStateError, NuggetState
from .store import NuggetStore, StoreUnavailableError
from .stream_llm import NuggetStreamLLM

__all__ = [
    "CorruptStateError", "DirectoryByteStore", "GenerationSettings", "LoraSettings", "NuggetCompressor",
    "NuggetConfig", "NuggetLLM", "NuggetModel", "NuggetState", "NuggetStore", "NuggetStream", "NuggetStreamLLM",
    "QA_PROMPT", "SUMMARY_PROMPT", "StoreUnavailableError", "StreamSettings",
    "generate", "stream_generate",
]
