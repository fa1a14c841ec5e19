"""Long documents summarised: nugget readings against what a user would do instead, side by side in one run.

    python benchmarks/long_documents.py --split dev --digests 2 --topics compound --threads 1 \
        --systems outline_r10 sections_r10 nuggets_r10 outline_r4 map_reduce --out benchmarks/results/long-dev

Documents (nugget_rag/eval/long_documents.py): digests of CNN/DailyMail articles of one split (reference: their
highlights in order; coverage: the share of the digest's articles the summary names) and topics of Python's
language reference longer than the model's positions (coverage: the share of the topic's key terms it names).

Systems, each timed from the text to the summary with nothing cached:
- outline_rR, sections_rR, nuggets_rR (R = 10 or 4): NuggetSummarizer's readings at r = R. The document's sections
  are compressed once, at a floor of 4, into a fresh store: every reading and ratio reads them from there, and its
  first summary's time is that compression plus its own reading;
- autoregressive: NuggetStreamLLM reads the document and the instruction left to right (window 128);
- map_reduce and refine: LangChain's recipes (langchain_classic's load_summarize_chain) over the same frozen model
  as a chat model (langchain-huggingface's ChatHuggingFace), chunks of 1,500 tokens; map_reduce asks for two
  sentences a chunk, then combines;
- truncation: the frozen model reads the document's first tokens that fit its positions, then the instruction;
- full: the frozen model reads the whole document where it fits;
- floor: not a summary, the least any of them can take: one pass of the frozen model over the document (pieces of
  2,048 tokens), which reading every token once costs.
A nugget system's time from its store (`second_s`) is its reading alone. Tokens read count every
prompt token and nugget each call reads; tokens decoded every generated token.

`--predictions DIR/NAME` also writes the digests' summaries as a harness run (NAME.json, NAME-predictions.jsonl; task
`long_documents`, with the digest of the weights scored), which benchmarks/default_decision.py pairs and scores by
ROUGE-L: the decision rule's summary measure (scripts/score_candidate.sh `summaries`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from langchain_core.callbacks import BaseCallbackHandler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import run_meta, write_report  # noqa: E402

from nugget_rag import NuggetCompressor, NuggetStore, NuggetStreamLLM  # noqa: E402
from nugget_rag.components.compressor import as_documents  # noqa: E402
from nugget_rag.eval.long_documents import LongDocument, digests, reference_topics  # noqa: E402
from nugget_rag.eval.metrics import rouge  # noqa: E402
from nugget_rag.eval.resume import weights_sha256  # noqa: E402
from nugget_rag.integrations.retrieval.summary_chain import NuggetSummarizer  # noqa: E402
from nugget_rag.prompts import SUMMARY_OF_DOCUMENT  # noqa: E402

NUGGET_SYSTEMS = {f"{reading}_r{ratio}": (reading, ratio) for ratio in (10, 4)
                  for reading in ("outline", "sections", "nuggets")}  # name -> (reading, ratio)
TEXT_SYSTEMS = ["map_reduce", "refine", "truncation", "full"]
SYSTEMS = ["floor", *NUGGET_SYSTEMS, "autoregressive", *TEXT_SYSTEMS]
TASK = "long_documents"  # the task name of --predictions' harness run
FLOOR_PIECE = 2048
CHUNK_TOKENS = 1500
MAP_PROMPT = "Write a summary of the following text in two sentences:\n\n{text}"
COMBINE_PROMPT = ("The following are summaries of consecutive parts of one document:\n\n{text}\n\n"
                  "Write a summary of the whole document in a few sentences.")


class TokenCounter(BaseCallbackHandler):
    """Counts the tokens a LangChain chat model reads (its chat-formatted prompts) and writes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.read, self.decoded = tokenizer, 0, 0

    def on_chat_model_start(self, serialized, messages, **kwargs) -> None:
        for chat in messages:
            turns = [{"role": "user" if m.type == "human" else m.type, "content": m.text} for m in chat]
            self.read += len(self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                                return_dict=True)["input_ids"])

    def on_llm_end(self, response, **kwargs) -> None:
        for generations in response.generations:
            for g in generations:
                self.decoded += len(self.tokenizer(g.text, add_special_tokens=False)["input_ids"])


class TextBaselines:
    """The frozen model as a LangChain chat model, and the recipes a user would run with it."""

    def __init__(self, model_path: str, max_new_tokens: int):
        from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        pipe = pipeline("text-generation", model=model, tokenizer=self.tokenizer, max_new_tokens=max_new_tokens,
                        do_sample=False, return_full_text=False)
        self.chat = ChatHuggingFace(llm=HuggingFacePipeline(pipeline=pipe), tokenizer=self.tokenizer)
        self.positions = model.config.max_position_embeddings
        self.max_new_tokens = max_new_tokens

    def run(self, system: str, text: str) -> tuple[str, dict[str, int]] | None:
        from langchain_classic.chains.summarize import load_summarize_chain
        from langchain_core.documents import Document
        from langchain_core.prompts import PromptTemplate
        from langchain_text_splitters import RecursiveCharacterTextSplitter

        counter = TokenCounter(self.tokenizer)
        config = {"callbacks": [counter]}
        if system in ("map_reduce", "refine"):
            splitter = RecursiveCharacterTextSplitter.from_huggingface_tokenizer(self.tokenizer, chunk_size=CHUNK_TOKENS,
                                                                               chunk_overlap=0)
            chunks = [Document(page_content=c) for c in splitter.split_text(text)]
            prompts = ({"map_prompt": PromptTemplate.from_template(MAP_PROMPT),
                        "combine_prompt": PromptTemplate.from_template(COMBINE_PROMPT)} if system == "map_reduce" else {})
            chain = load_summarize_chain(self.chat, chain_type=system, **prompts)
            summary = chain.invoke({"input_documents": chunks}, config)["output_text"]
        else:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            room = self.positions - self.max_new_tokens - 64  # the chat template and the instruction
            if system == "full" and len(ids) > room:
                return None
            document = self.tokenizer.decode(ids[:room])
            summary = self.chat.invoke(f"{document}\n\n{SUMMARY_OF_DOCUMENT}", config).text
        return summary.strip(), {"tokens_read": counter.read, "tokens_decoded": counter.decoded}


class NuggetReadings:
    """Every nugget system over one document: its sections compressed once (timed), then each reading."""

    def __init__(self, model, text: str, max_new_tokens: int):
        self.compressor = NuggetCompressor(model=model, store=NuggetStore(), keep_ratio=4)
        self.text, self.max_new_tokens = text, max_new_tokens
        summarizer = NuggetSummarizer(compressor=self.compressor)
        start = time.perf_counter()
        self.compressor.lookup(summarizer.sections(as_documents(text)))
        self.compress_s = time.perf_counter() - start

    def run(self, name: str) -> dict[str, Any]:
        reading, ratio = NUGGET_SYSTEMS[name]
        summarizer = NuggetSummarizer(compressor=self.compressor, reading=reading, ratio=ratio,
                                      max_new_tokens=self.max_new_tokens)
        start = time.perf_counter()
        answer = summarizer.invoke(self.text)
        read_s = time.perf_counter() - start
        meta = answer.response_metadata
        if not meta["cached"]:
            raise RuntimeError(f"{name}: the sections were not all read from the store")
        return {"summary": answer.content.strip(), "seconds": self.compress_s + read_s, "second_s": read_s,
                "compress_s": self.compress_s, "tokens_read": answer.usage_metadata["input_tokens"],
                "tokens_decoded": answer.usage_metadata["output_tokens"], "n_nuggets": meta["n_nuggets"],
                **({"section_summaries": meta["section_summaries"]} if "section_summaries" in meta else {})}


def autoregressive(model, text: str, max_new_tokens: int) -> dict[str, Any]:
    llm = NuggetStreamLLM(model=model, max_new_tokens=max_new_tokens, no_repeat_ngram_size=3)
    start = time.perf_counter()
    answer = llm.invoke(f"{text}\n\n{SUMMARY_OF_DOCUMENT}")
    return {"summary": answer.text.strip(), "seconds": time.perf_counter() - start,
            "tokens_read": answer.response_metadata["tokens_read"], "tokens_decoded": answer.usage_metadata["output_tokens"]}


def floor(model, text: str) -> dict[str, Any]:
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    start = time.perf_counter()
    with torch.inference_mode():
        for piece in range(0, len(ids), FLOOR_PIECE):
            model.run(None, input_ids=torch.tensor([ids[piece : piece + FLOOR_PIECE]], device=model.device))
    return {"seconds": time.perf_counter() - start, "tokens_read": len(ids), "tokens_decoded": 0}


def scores(doc: LongDocument, summary: str) -> dict[str, Any]:
    share, named = doc.coverage(summary)
    out = {"coverage": 100 * share, "named": named}
    if doc.reference is not None:
        out.update(rouge([summary], [doc.reference]))
    return out


def table(rows: list[dict[str, Any]], systems: list[str]) -> str:
    """Per system: mean ROUGE over the digests, coverage over digests and topics, time, tokens; ratios to
    map_reduce where it ran on the same documents."""
    lines = ["| system | ROUGE-1 | ROUGE-2 | ROUGE-L | coverage digests | coverage topics | first summary (s) | "
             "x map-reduce | from the store (s) | x map-reduce | tokens read | tokens decoded |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["document"]: r for r in rows if r["system"] == "map_reduce" and "summary" in r}

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    def fmt(value, digits=1):
        return "" if value is None else f"{value:,.{digits}f}"

    for system in systems:
        mine = [r for r in rows if r["system"] == system and ("summary" in r or system == "floor")]
        if not mine:
            continue
        digest_rows = [r for r in mine if "rougeL" in r]
        topic_rows = [r for r in mine if "rougeL" not in r and "coverage" in r]
        paired = [r for r in mine if r["document"] in base]
        ratio = (sum(r["seconds"] for r in paired) / sum(base[r["document"]]["seconds"] for r in paired)
                 if paired else None)
        stored = [r for r in paired if "second_s" in r]
        ratio_2 = (sum(r["second_s"] for r in stored) / sum(base[r["document"]]["seconds"] for r in stored)
                   if stored else None)
        lines.append("| " + " | ".join([
            system, *(fmt(mean(r.get(m) for r in digest_rows)) for m in ("rouge1", "rouge2", "rougeL")),
            fmt(mean(r["coverage"] for r in digest_rows), 0), fmt(mean(r["coverage"] for r in topic_rows), 0),
            fmt(mean(r["seconds"] for r in mine)), fmt(ratio, 2), fmt(mean(r.get("second_s") for r in mine)),
            fmt(ratio_2, 3), fmt(mean(r["tokens_read"] for r in mine), 0),
            fmt(mean(r["tokens_decoded"] for r in mine), 0)]) + " |")
    return "\n".join(lines) + "\n"


def write_predictions(stem: Path, args: argparse.Namespace, documents: list[LongDocument],
                      rows: list[dict[str, Any]]) -> None:
    """The digests' summaries as a harness run (STEM.json, STEM-predictions.jsonl), for the decision rule."""
    references = {d.id: d.reference for d in documents if d.reference is not None}
    records = [{"task": TASK, "system": r["system"], "ratio": NUGGET_SYSTEMS.get(r["system"], (None, None))[1],
                "id": r["document"], "output": r["summary"], "references": [references[r["document"]]]}
               for r in rows if r["document"] in references and "summary" in r]
    setup = {"source": str(args.data), "split": args.split, "examples": len(references),
             "checkpoint": str(args.checkpoint), "weights_sha256": [weights_sha256(args.checkpoint), None],
             "max_new_tokens": args.max_new_tokens}
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_name(stem.name + ".json").write_text(json.dumps(
        {"tasks": {TASK: {"split": args.split, "source": str(args.data), "setup": setup}}}, indent=1) + "\n")
    stem.with_name(stem.name + "-predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=["dev", "test"], required=True, help="which CNN/DM articles the digests use")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/cnndm-test-250.jsonl"))
    parser.add_argument("--digests", type=int, default=2, help="digests of the split (0: none)")
    parser.add_argument("--digest-size", type=int, default=12, help="articles a digest")
    parser.add_argument("--topics", nargs="*", default=["compound"], help="reference topics (pydoc_data.topics)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS)
    parser.add_argument("--checkpoint", default="default", help="nugget checkpoint (default: the shipped one)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 where other work shares the CPU)")
    parser.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.md")
    parser.add_argument("--predictions", type=Path, help="also DIR/NAME.json and DIR/NAME-predictions.jsonl: the "
                                                          "digests' summaries as a harness run (the decision rule's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from nugget_rag.model.base_model import convert_default_model
    from nugget_rag.model.nugget_model import NuggetModel

    documents = (digests(args.data, args.split, args.digest_size, args.digests) if args.digests else [])
    documents += reference_topics(args.topics) if args.topics else []
    model = NuggetModel.from_pretrained(args.checkpoint)
    text_systems = [s for s in args.systems if s in TEXT_SYSTEMS]
    baselines = TextBaselines(str(convert_default_model()), args.max_new_tokens) if text_systems else None
    meta = run_meta(threads=args.threads, checkpoint=args.checkpoint, split=args.split,
                    documents=[d.id for d in documents], max_new_tokens=args.max_new_tokens)
    rows = []
    for doc in documents:
        n_tokens = len(model.tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        readings = None
        for system in args.systems:
            row: dict[str, Any] = {"document": doc.id, "system": system, "document_tokens": n_tokens}
            if system in NUGGET_SYSTEMS:
                readings = readings or NuggetReadings(model, doc.text, args.max_new_tokens)
                row.update(readings.run(system))
            elif system == "floor":
                row.update(floor(model, doc.text))
            elif system == "autoregressive":
                row.update(autoregressive(model, doc.text, args.max_new_tokens))
            else:
                start = time.perf_counter()
                got = baselines.run(system, doc.text)
                if got is None:
                    row["skipped"] = f"{n_tokens} tokens exceed the model's positions"
                else:
                    row.update(summary=got[0], seconds=time.perf_counter() - start, **got[1])
            if "summary" in row:
                row.update(scores(doc, row["summary"]))
            print(f"{doc.id} {system}: {row.get('seconds', 0):.1f}s cov {row.get('coverage', 0):.0f} "
                  f"RL {row.get('rougeL', float('nan')):.1f} | {row.get('summary', row.get('skipped', ''))[:300]!r}",
                  flush=True)
            rows.append(row)
        write_report(args.out, {"meta": meta, "rows": rows}, table(rows, args.systems))  # after each document
    if args.predictions:
        write_predictions(args.predictions, args, documents, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
