"""Loading base models: safe formats only, clear device errors, the default model's conversion cache."""

import os
import time

import pytest
import torch
from tiny import tiny_base

from nugget_rag.model.base_model import _remove_stale_conversions, load_base_model, pick_device


def test_a_pickle_checkpoint_is_refused_and_a_safetensors_one_loads(tmp_path):
    base = tiny_base(layers=2)
    (tmp_path / "bin").mkdir()
    base.model.config.save_pretrained(tmp_path / "bin")
    base.tokenizer.save_pretrained(tmp_path / "bin")
    torch.save(base.model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")  # the pickle format
    with pytest.raises(ValueError, match="no .safetensors weights; nugget-rag loads no pickle"):
        load_base_model(tmp_path / "bin")
    base.model.save_pretrained(tmp_path / "safe")
    base.tokenizer.save_pretrained(tmp_path / "safe")
    assert load_base_model(tmp_path / "safe", device="cpu").model.config.num_hidden_layers == 2


def test_bad_devices_are_named():
    with pytest.raises(ValueError, match="'gpu' is not a torch device"):
        pick_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="asked for CUDA"):
            pick_device("cuda")


def test_only_conversions_killed_long_ago_are_cleared(tmp_path):
    target = tmp_path / "Model"
    stale, running, other = tmp_path / "Model.abc123", tmp_path / "Model.def456", tmp_path / "Other.abc"
    for folder in (stale, running, other):
        folder.mkdir()
    hours_ago = time.time() - 7200
    os.utime(stale, (hours_ago, hours_ago))
    os.utime(other, (hours_ago, hours_ago))
    _remove_stale_conversions(target)
    assert not stale.exists() and running.exists() and other.exists()


def test_a_tokenizer_without_chat_template_gets_a_plain_prompt_with_bos(caplog):
    from nugget_rag.prompts import chat_text

    tok = tiny_base(layers=1).tokenizer
    tok.chat_template = None
    tok.name_or_path = "no-template-model"
    with caplog.at_level("WARNING", logger="nugget_rag.prompts"):
        text = chat_text(tok, [{"role": "user", "content": "Hi"}])
    assert text == f"{tok.bos_token or ''}user: Hi\nassistant: " and "no chat template" in caplog.text


def test_a_conversion_counts_as_current_only_for_its_gguf(tmp_path):
    import json

    from nugget_rag.model.base_model import SOURCE_FILE, _converted_from

    source = {"gguf": "m.gguf", "bytes": 10, "name": "M"}
    assert not _converted_from(tmp_path, source)
    (tmp_path / "config.json").write_text("{}")
    for recorded, current in [({"gguf": "m.gguf", "name": "M"}, True), (source, True),
                              ({**source, "bytes": 11}, False), ({**source, "gguf": "n.gguf"}, False)]:
        (tmp_path / SOURCE_FILE).write_text(json.dumps(recorded))
        assert _converted_from(tmp_path, source) is current, recorded
