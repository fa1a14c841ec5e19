"""The CPU rehearsal of a GPU script (`DRY_RUN=1 bash scripts/gpu_session.sh OUT`): a tiny random LLaMA, tiny data
files in every format a stage reads, and the stage's config with each source moved onto them, one step long.

    python tests/dry_run.py DIR CONFIG     # writes DIR/base, DIR/data, DIR/config.yaml; prints DIR/config.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from eval_data import write_data
from tiny import tiny_base

# Where each objective's tiny data lives (eval_data's files, in the shared/data formats with their splits.json).
DATA_FOR = {"qa": "squad-dev-v1.1.json", "rag_qa": "squad-dev-v1.1.json", "summarization": "cnndm-test-250.jsonl",
            "autoencoding": "python-3.11-docs.jsonl", "continuation": "python-3.11-docs.jsonl",
            "language_modeling": "python-3.11-docs.jsonl"}
ONE_STEP = {"batch_size": 2, "grad_accum": 1, "max_steps": 1, "eval_every": 1, "eval_examples": 2, "eval_generate": 1,
            "save_every": 1, "log_every": 1, "group_by_length": 0, "init_from": None,
            "lengths": {"document": 128, "query": 6, "answer": 16, "autoencoding": 32}}


def write(folder: Path, config: Path) -> Path:
    """The tiny base model, data and one-step config of `config`'s stage, under `folder`."""
    base = tiny_base()
    base.model.save_pretrained(folder / "base")
    base.tokenizer.save_pretrained(folder / "base")
    data = write_data(folder / "data")
    stage = yaml.safe_load(config.read_text())
    for source in stage["data"]:
        source["path"] = str(data / DATA_FOR[source["objective"]])
        source.pop("dev_path", None)
        if source["objective"] == "rag_qa":
            source.setdefault("readings", {})["passages"] = 2
    stage.update(ONE_STEP, base_model=str(folder / "base"))
    stage["nugget"] = {**stage.get("nugget", {}), "lora": {"rank": 4}}
    stage.pop("output_dir", None)
    out = folder / "config.yaml"
    out.write_text(yaml.safe_dump(stage))
    return out


if __name__ == "__main__":
    print(write(Path(sys.argv[1]), Path(sys.argv[2])))
