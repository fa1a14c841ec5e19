"""The LangChain components: NuggetCompressor (documents -> cached nugget states) and NuggetLLM / NuggetStreamLLM
(the decoder reading them), each a Runnable; and the reading plan (resolution.py) that decides, per question, how
finely NuggetLLM reads each document."""
