"""What the decoder adapter costs per call: the same nuggets and question read with adapters off, with the decoder
as LoRA (three matrix products per adapted layer), as merged weights (one; the default without autograd) and, on a
CPU, with every linear layer in int8 (`NuggetModel.merged_format = "int8"`).

    python benchmarks/adapter_overhead.py                  # the default model and shipped checkpoint
    python benchmarks/adapter_overhead.py --narrow 64      # its 30 layers at hidden width 64, randomly initialised

`--narrow` keeps the base model's depth, heads' layout and vocabulary but shrinks the hidden width, so each call
costs its Python and kernel-launch overhead rather than arithmetic: what a small model pays on a GPU. Full (the
documents' text in the prompt, adapters off) is timed beside them. Medians over --repeats rounds (each times every system once) after a warm-up round.
Writes benchmarks/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reporting import add_name_options, made_by, run_meta, table, write_report  # noqa: E402

from nugget_rag.cli.options import checkpoint_arg  # noqa: E402
from nugget_rag.config import DECODER  # noqa: E402
from nugget_rag.eval.speed import QUESTION, no_eos, timed_generation  # noqa: E402
from nugget_rag.model import NuggetModel  # noqa: E402
from nugget_rag.model.base_model import BaseLM, load_base_model, prepare_base_model  # noqa: E402
from nugget_rag.prompts import QA_PROMPT, chat_token_ids, full_context_messages  # noqa: E402

MODES = {  # label: (adapter, merged_adapters, merged_format)
    "nuggets, adapters off": (None, (), "float"),
    "nuggets, decoder as LoRA": (DECODER, (), "float"),
    "nuggets, decoder merged": (DECODER, (DECODER,), "float"),
}
INT8 = {"nuggets, decoder merged, int8": (DECODER, (DECODER,), "int8")}  # CPU only


def narrowed(base: BaseLM, width: int) -> BaseLM:
    """The base model's architecture at hidden width `width` (4 query / 2 key-value heads), randomly initialised."""
    config = base.model.config.to_dict() | dict(hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
                                                num_key_value_heads=2, head_dim=width // 4)
    config = type(base.model.config).from_dict(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(base.model.dtype)
    return prepare_base_model(model, base.tokenizer, f"{base.name}-narrow{width}", base.model.device)


def documents(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """`count` different documents of `tokens` tokens (content does not change the timings)."""
    ids = tokenizer(" ".join(Path(__file__).read_text().split()), add_special_tokens=False)["input_ids"]
    ids = ids * (1 + count * tokens // len(ids))
    return [ids[i * tokens : (i + 1) * tokens] for i in range(count)]


def measure(model: NuggetModel, args) -> dict:
    docs = documents(model.tokenizer, args.documents, args.doc_tokens)
    states = model.compress(docs, ratio=args.ratio)
    instruction = QA_PROMPT.format(question=QUESTION)
    prefix, prompt = model.chat_prompt([{"role": "user", "content": instruction}])
    full_prompt = chat_token_ids(model.tokenizer, full_context_messages([model.tokenizer.decode(d) for d in docs],
                                                                        instruction))
    modes = MODES | (INT8 if model.device.type == "cpu" and model.dtype == torch.float32 else {})
    runs = {"Full (adapters off)": ([], full_prompt, None, (), (), "float")}
    runs |= {label: (states, prompt, adapter, prefix, *how) for label, (adapter, *how) in modes.items()}
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
    setting = model.merged_adapters, model.merged_format
    try:
        with no_eos():
            for _ in range(args.repeats + 1):  # rounds over all systems, so that a busy spell hits them alike
                for label, (samples, ids, adapter, pre, merged, weights) in runs.items():
                    model.merged_adapters, model.merged_format = merged, weights
                    times[label].append(timed_generation(model, samples, ids, adapter, args.steps, prefix=pre))
    finally:
        model.merged_adapters, model.merged_format = setting
    rows = {label: {"ttft_s": statistics.median(t[0] for t in measured[1:]),
                    "decode_s_per_token": statistics.median(t[1] for t in measured[1:])}
            for label, measured in times.items()}
    return {"nuggets": sum(s.k for s in states), "full_prompt_tokens": len(full_prompt), "rows": rows}


def report(result: dict, args) -> str:
    rows = result["rows"]
    lora = rows["nuggets, decoder as LoRA"]
    lines = [
        f"# Decoder adapter overhead: {result['model']}",
        "",
        *made_by(result["meta"], f"{result['device']}, {torch.get_num_threads()} threads",
                 f"torch {torch.__version__}; {args.documents} documents of {args.doc_tokens} tokens, r = "
                 f"{args.ratio:g} ({result['nuggets']} nuggets; Full's prompt {result['full_prompt_tokens']} tokens); "
                 f"medians of {args.repeats}, decode over {args.steps - 1} tokens"),
        "",
        *table(["system", "TTFT (ms)", "decode (ms/token)", "TTFT vs LoRA", "decode vs LoRA"],
               ([label, f"{row['ttft_s'] * 1e3:.1f}", f"{row['decode_s_per_token'] * 1e3:.2f}",
                 f"{lora['ttft_s'] / row['ttft_s']:.2f}x",
                 f"{lora['decode_s_per_token'] / row['decode_s_per_token']:.2f}x"] for label, row in rows.items())),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", default=None, help="LLaMA checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--checkpoint", type=checkpoint_arg, default="default", help="nugget checkpoint, or 'none'")
    parser.add_argument("--narrow", type=int, default=None, metavar="WIDTH",
                        help="rebuild the base model at this hidden width, randomly initialised (untrained adapters)")
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--ratio", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=16, help="tokens generated per run (the first times TTFT)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None)
    add_name_options(parser, "adapter-overhead")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.narrow:
        base = narrowed(load_base_model(args.base_model, device=args.device), args.narrow)
        model = NuggetModel(base)
    else:
        model = NuggetModel.from_pretrained(args.checkpoint, base_model=args.base_model, device=args.device)
    command = shlex.join(["python", "benchmarks/adapter_overhead.py", *(sys.argv[1:] if argv is None else argv)])
    meta = run_meta(command=command)
    result = {"meta": meta, **measure(model, args), "model": model.base_name, "device": str(model.device)}
    write_report(args.out_dir / args.name, result, report(result, args))


if __name__ == "__main__":
    main()
