"""`nugget-rag train` (or `python -m nugget_rag.train`): train the nugget adapters and Scorer.

Examples:
  # text continuation on Python docs and WikiText (train parts), r = 10
  nugget-rag train --output-dir runs/tc --max-steps 300 \\
      --data continuation:../shared/data/python-3.11-docs.jsonl \\
      --data continuation:../shared/data/wikitext-2-raw-test.txt
  # SQuAD fine-tuning with 3-passage examples, starting from that run
  nugget-rag train --output-dir runs/squad --init-from runs/tc/final \\
      --data "qa:../shared/data/squad-dev-v1.1.json,documents_per_example=3"
  # every option from a file (flags override it); several GPUs: accelerate launch -m nugget_rag.train ...
  nugget-rag train --config run.yaml
  # tokenise its examples once into ready sets, then train from them without a tokenizer call
  nugget-rag train --config run.yaml --write-ready ready/ && nugget-rag train --config run.yaml --ready-dir ready/

A data source is OBJECTIVE:PATH[,option=value...] with the options of Source (below). Nested settings are
flags with dots (--optim.lr, --lengths.document, --nugget.lora.rank). Re-running with the same --output-dir
resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ..corpora import DataError
from .config import TrainConfig
from .sources import Source


class _Yaml12Loader(yaml.SafeLoader):
    """YAML with 1.2's booleans (true/false only): `no`, `on`, `yes` stay strings for pydantic to read by type."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))

ALIASES = {"lr": "optim.lr", "ratio": "nugget.ratio", "warmup-steps": "optim.warmup_steps"}
_SKIP = {"data"}


def _model_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    """(dotted name, FieldInfo) of every scalar setting, nested models expanded."""
    out = []
    for name, info in model.model_fields.items():
        if name in _SKIP and not prefix:
            continue
        kind = info.annotation
        nested = next((a for a in (kind, *typing.get_args(kind)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is not None:
            out += _model_fields(nested, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", info))
    return out


def shown_default(info: FieldInfo) -> object:
    """A setting's default as help shows it: "required", a nested model's settings as JSON (as --data takes them),
    else the value (a default factory called)."""
    if info.is_required():
        return "required"
    default = info.get_default(call_default_factory=True)
    return default.model_dump_json() if isinstance(default, BaseModel) else default


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The train command's options: --config, --data and one flag per setting of TrainConfig."""
    parser.add_argument("--config", type=Path, metavar="FILE", help="YAML or JSON file with any of the settings")
    parser.add_argument("--data", action="append", metavar="OBJECTIVE:PATH[,k=v...]",
                        help="a data source (repeatable); replaces the config file's sources")
    parser.add_argument("--write-ready", type=Path, metavar="DIR",
                        help="tokenise every source's train and dev examples into ready sets in DIR (for a later "
                             "run's --ready-dir), then exit without training")
    settings = parser.add_argument_group("settings (defaults in brackets)")
    inverse = {v: k for k, v in ALIASES.items()}
    for dotted, info in _model_fields(TrainConfig):
        flags = [f"--{dotted.replace('_', '-')}"]
        if dotted in inverse:
            flags.append(f"--{inverse[dotted]}")
        help_text = f"{info.description or ''} [{shown_default(info)}]".strip()
        settings.add_argument(*flags, dest=f"set:{dotted}", metavar="V", help=help_text.replace("%", "%%"))
    options = [f"  {name} [{shown_default(info)}]: {info.description or ''}"
               for name, info in Source.model_fields.items() if name not in ("objective", "path")]
    parser.epilog = "data source options (--data OBJECTIVE:PATH,option=value,...):\n" + "\n".join(options)
    return parser


def _flag_value(text: str) -> object:
    """A flag's value: YAML for lists, mappings and null; otherwise the string itself, which pydantic converts
    to the setting's type (so `--output-dir 2026` stays a name and `--mixed-precision no` stays 'no')."""
    if text.strip()[:1] in ("[", "{") or text.strip() in ("null", "~"):
        return yaml.load(text, _Yaml12Loader)
    return text


def parse_source(text: str) -> dict:
    """'qa:path/file.json,weight=2' -> {'objective': 'qa', 'path': ..., 'weight': '2'}."""
    head, _, rest = text.partition(",")
    objective, sep, path = head.partition(":")
    if not sep or not path:
        raise ValueError(f"--data {text!r}: expected OBJECTIVE:PATH[,option=value...], such as qa:data/squad.json")
    source: dict = {"objective": objective, "path": path}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--data {text!r}: option {item!r} is not of the form name=value")
        source[key.strip()] = _flag_value(value)
    return source


def load_config(args: argparse.Namespace) -> TrainConfig:
    values: dict = {}
    if args.config:
        if not args.config.is_file():
            raise ValueError(f"config file {args.config} not found")
        text = args.config.read_text()
        values = json.loads(text) if args.config.suffix == ".json" else yaml.load(text, _Yaml12Loader) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{args.config} must hold a mapping of settings, not {type(values).__name__}")
    if args.data:
        values["data"] = [parse_source(d) for d in args.data]
    for key, value in vars(args).items():
        if key.startswith("set:") and value is not None:
            *parents, leaf = key[4:].split(".")
            node = values
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = _flag_value(value)
    return TrainConfig.model_validate(values)


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "config"
        value = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"  {where}: {e['msg']}{value}")
    return "invalid settings:\n" + "\n".join(lines)


def _write_ready(config: TrainConfig, folder: Path) -> int:
    from .run_data import write_ready_sets

    written = write_ready_sets(config, folder)
    for entry in written:
        print(f"{entry['set']}: {entry['examples']} examples, {entry['bytes'] / 1e6:.1f} MB")
    total = sum(e["bytes"] for e in written) / 1e6
    print(f"{len(written)} ready sets in {folder} ({total:.1f} MB); train with --ready-dir {folder}")
    return 0


def run_from_args(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
    except ValidationError as err:
        print(f"nugget-rag train: {_explain(err)}", file=sys.stderr)
        return 2
    except (ValueError, yaml.YAMLError) as err:
        print(f"nugget-rag train: error: {err}", file=sys.stderr)
        return 2
    from .trainer import train

    try:
        if args.write_ready:
            return _write_ready(config, args.write_ready)
        result = train(config)
    except (DataError, ValueError, FileNotFoundError) as err:
        print(f"nugget-rag train: error: {err}", file=sys.stderr)
        return 2
    print(f"trained {result.step} steps; final checkpoint: {result.final_dir}")
    return 0
