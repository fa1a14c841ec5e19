"""The LangChain components: NuggetCompressor (documents -> cached nugget states) and NuggetLLM / NuggetStreamLLM
(the decoder reading them), each a Runnable."""
