"""Put a candidate in place of the shipped default, once the rule has chosen it (MODEL_CARD.md "Choosing the next
default"). Refused by name, before anything is copied: a decision that does not ship it, or that is about other
weights (the candidate's or the shipped default's sha256 is not the one the decision records), a candidate of another
base model or LoRA layout, one exported in float32 (the default ships bfloat16: `export_dtype: bfloat16`), one over 30
MB, or one without its lineage. The shipped `nugget_config.json` records the decision: its file, its sha256 and the
weights it compared.

    python benchmarks/default_decision.py runs/score/stage5 runs/score/candidate --out benchmarks/results/NAME
    python scripts/ship_default.py CANDIDATE --decision benchmarks/results/NAME.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from safetensors import safe_open

from nugget_rag.model.checkpoint_files import (
    CONFIG_FILE,
    SHIPPED_CHECKPOINT,
    WEIGHTS_FILE,
    checkpoint_config,
    read_checkpoint_meta,
)

MAX_BYTES = 30_000_000
SHIPPED_DTYPE = "BF16"
LAYOUT = ("scorer_layer", "scorer_hidden", "soft_prompt_tokens", "lora")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_weights(candidate: Path, decision: dict, target: Path) -> None:
    """Raise ValueError unless the decision is about `candidate`'s weights against those shipped in `target` (it
    records the harness's digests: a sha256's first 16 hex digits)."""
    decided = decision.get("weights_sha256") or {}
    if not (decided.get("candidate") and decided.get("baseline")):
        raise ValueError("the decision records no digest of the weights it compared (weights_sha256): decide again "
                         "with benchmarks/default_decision.py, which records them")
    for role, path in (("candidate", candidate / WEIGHTS_FILE), ("baseline", target / WEIGHTS_FILE)):
        digest = sha256(path)
        if not digest.startswith(decided[role]):
            which = "the candidate it chose" if role == "candidate" else "the default it was compared with"
            raise ValueError(f"{path} (sha256 {digest[:16]}) is not {which}: the decision is about weights "
                             f"{decided[role]}; ship the export that was scored, or score these weights "
                             "(scripts/score_candidate.sh) and decide again")


def check(candidate: Path, decision: dict, target: Path) -> None:
    """Raise ValueError naming what keeps `candidate` from replacing the checkpoint in `target`."""
    if not decision.get("ships"):
        raise ValueError(f"the decision on {decision.get('candidate')} does not ship it: the default stays")
    if not decision.get("rows"):
        raise ValueError("the decision holds no measures: run benchmarks/default_decision.py again")
    meta, shipped = read_checkpoint_meta(candidate), read_checkpoint_meta(target)
    if meta["base_digest"] != shipped["base_digest"]:
        raise ValueError(f"{candidate} was trained on base model {meta['base_model']!r} (digest "
                         f"{meta['base_digest']}); the default belongs to {shipped['base_model']!r} "
                         f"({shipped['base_digest']})")
    new, old = checkpoint_config(candidate), checkpoint_config(target)
    differ = [k for k in LAYOUT if getattr(new, k) != getattr(old, k)]
    if differ:
        raise ValueError(f"{candidate} has another layout than the default: "
                         + ", ".join(f"{k}={getattr(new, k)} (default {getattr(old, k)})" for k in differ))
    weights = candidate / WEIGHTS_FILE
    with safe_open(weights, framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    if dtypes != {SHIPPED_DTYPE}:
        raise ValueError(f"{weights} holds {sorted(dtypes)} tensors; the default ships bfloat16: export it with "
                         "export_dtype: bfloat16 (nugget-rag train --export-dtype bfloat16)")
    if weights.stat().st_size > MAX_BYTES:
        raise ValueError(f"{weights} is {weights.stat().st_size:,} bytes, over the {MAX_BYTES:,} a default may be")
    if not (meta.get("training") or {}).get("lineage"):
        raise ValueError(f"{candidate / CONFIG_FILE} records no lineage: ship an export of `nugget-rag train`")
    check_weights(candidate, decision, target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("candidate", type=Path, help="the candidate's export (nugget.safetensors, nugget_config.json)")
    parser.add_argument("--decision", type=Path, required=True, help="benchmarks/default_decision.py's --out JSON")
    parser.add_argument("--target", type=Path, default=SHIPPED_CHECKPOINT, help="the shipped checkpoint's folder")
    args = parser.parse_args()
    decision = json.loads(args.decision.read_text())
    try:
        check(args.candidate, decision, args.target)
    except ValueError as err:
        raise SystemExit(f"not shipped: {err}") from None
    config = json.loads((args.candidate / CONFIG_FILE).read_text())
    config["decision"] = {"file": args.decision.name, "sha256": sha256(args.decision),
                          "weights_sha256": decision["weights_sha256"]}
    shutil.copyfile(args.candidate / WEIGHTS_FILE, args.target / WEIGHTS_FILE)
    (args.target / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    print(f"{args.candidate} is now the default in {args.target}; update MODEL_CARD.md with its decision table")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
