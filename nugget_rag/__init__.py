"""nugget-rag: Dodo nugget compression for LangChain RAG.

text -> tokens -> encoder + Scorer -> NuggetState (cached in a NuggetStore) -> decoder -> text.
"""

from .components.compressor import NuggetCompressor
from .components.llm import NuggetLLM
from .components.stream_llm import NuggetStreamLLM
from .config import LoraSettings, NuggetConfig, StreamSettings
from .generation.autoregressive import NuggetStream
from .generation.decoding import GenerationSettings, generate, stream_generate
from .model.nugget_model import NuggetModel
from .prompts import QA_PROMPT, SUMMARY_PROMPT
from .state.directory_store import DirectoryByteStore
from .state.nugget_state import CorruptStateError, NuggetState
from .state.store import NuggetStore, StoreUnavailableError

__all__ = [
    "CorruptStateError", "DirectoryByteStore", "GenerationSettings", "LoraSettings", "NuggetCompressor",
    "NuggetConfig", "NuggetLLM", "NuggetModel", "NuggetState", "NuggetStore", "NuggetStream", "NuggetStreamLLM",
    "QA_PROMPT", "SUMMARY_PROMPT", "StoreUnavailableError", "StreamSettings",
    "generate", "stream_generate",
]
