"""Runs peer packages (kvpress, llmlingua) in their own virtual environment, for the eval harness.

kvpress pins transformers below 5.3, so the peers live in a separate environment (`scripts/install_peers.sh`
makes `.venv-peers`). This file is run there as a script, imports nothing from nugget_rag, and answers JSON
lines on stdin/stdout:

    {"model": DIR, "threads": N}                                   first line: load the base model
    {"op": "kvpress", "press": "snapkv", "context": ..., "question": ..., "compression_ratio": 0.9,
     "max_new_tokens": 64}                                          -> {"answer": ..., "kept_tokens": ...}
    {"op": "llmlingua", "text": ..., "rate": 0.1}                  -> {"text": ...}

Two shims let llmlingua 0.2.2 run here, neither changing what it computes: it counts tokens with tiktoken's
cl100k encoding, which is fetched from the network on first use, so offline the worker substitutes the base
model's own tokenizer for that count (it only sizes budgets and reports); and it passes key/value caches as
legacy (key, value) lists, which transformers 5 no longer takes, so its model is wrapped to convert the cache
format on the way in and out (documents longer than its 200-token iteration window need this).
"""

from __future__ import annotations

import json
import sys
import traceback


def main() -> None:
    import torch

    setup = json.loads(sys.stdin.readline())
    if setup.get("threads"):
        torch.set_num_threads(int(setup["threads"]))
    path = setup["model"]
    state: dict = {}

    def kv_pipeline(eager: bool):
        key = "pipe_eager" if eager else "pipe"
        if key not in state:
            import kvpress  # noqa: F401  (registers the pipeline)
            from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

            kwargs = {"attn_implementation": "eager"} if eager else {}
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True, **kwargs)
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            state[key] = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
        return state[key]

    def lingua():
        if "lingua" not in state:
            import tiktoken
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)

            class OwnTokenizer:
                def encode(self, text, **kwargs):
                    return tok(text, add_special_tokens=False)["input_ids"]

                def decode(self, ids, **kwargs):
                    return tok.decode(ids)

            tiktoken.encoding_for_model = lambda name: OwnTokenizer()
            from llmlingua import PromptCompressor
            from transformers import DynamicCache
            from transformers.cache_utils import Cache

            class LegacyCacheModel:
                """llmlingua's model, taking and returning caches as lists of (key, value) per layer."""

                def __init__(self, model):
                    self._model = model

                def __getattr__(self, name):
                    return getattr(self._model, name)

                def __call__(self, *args, past_key_values=None, **kwargs):
                    if past_key_values is not None and not isinstance(past_key_values, Cache):
                        cache = DynamicCache()
                        for index, (key, value) in enumerate(past_key_values):
                            cache.update(key, value, index)
                        past_key_values = cache
                    out = self._model(*args, past_key_values=past_key_values, **kwargs)
                    if isinstance(getattr(out, "past_key_values", None), Cache):
                        out.past_key_values = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
                    return out

            compressor = PromptCompressor(model_name=path, device_map="cpu")
            compressor.model = LegacyCacheModel(compressor.model)
            state["lingua"] = compressor
        return state["lingua"]

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            if request["op"] == "kvpress":
                import kvpress

                presses = {"snapkv": kvpress.SnapKVPress, "observed_attention": kvpress.ObservedAttentionPress,
                           "knorm": kvpress.KnormPress, "streaming_llm": kvpress.StreamingLLMPress}
                name = request["press"]
                press = presses[name](compression_ratio=float(request["compression_ratio"]))
                pipe = kv_pipeline(eager=name == "observed_attention")
                result = pipe(request["context"], question=request["question"], press=press,
                              max_new_tokens=int(request["max_new_tokens"]))
                reply = {"answer": result["answer"]}
            elif request["op"] == "llmlingua":
                result = lingua().compress_prompt([request["text"]], rate=float(request["rate"]))
                reply = {"text": result["compressed_prompt"]}
            else:
                reply = {"error": f"unknown op {request['op']!r}"}
        except Exception as err:  # noqa: BLE001  reported to the harness, which counts the example as a peer failure
            reply = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc(limit=3)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
