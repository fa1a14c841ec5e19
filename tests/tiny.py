"""A tiny randomly initialised LLaMA and a character-level tokenizer, for fast unit tests."""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from nugget_rag.config import NuggetConfig
from nugget_rag.model import NuggetModel
from nugget_rag.model.base_model import BaseLM, prepare_base_model

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(string.printable)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|im_end|>",
        bos_token="<|im_start|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_base(seed: int = 0, layers: int = 4, max_positions: int = 512, init_std: float = 0.02, **config) -> BaseLM:
    """`config`: further LlamaConfig fields (rope scaling, head_dim, biases...)."""
    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        **{"tie_word_embeddings": True, "initializer_range": init_std, **config},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    return prepare_base_model(model, tok, "tiny-llama")


def tiny_nugget_model() -> NuggetModel:
    """The tests' usual NuggetModel: a tiny LLaMA, r = 4, the Scorer on layer 2, LoRA rank 4."""
    return NuggetModel(tiny_base(), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4}))


def perturb_adapters(model):
    """`model` with random LoRA B matrices (seeded), so that both adapters change what they compute."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model
