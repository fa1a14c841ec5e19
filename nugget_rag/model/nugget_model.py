"""The Dodo model: a frozen LLaMA with an encoder and a decoder LoRA adapter, a Scorer and a soft prompt.

Data flow: token ids -> Scorer over the frozen model's early layers -> top-k positions -> encoder pass that records
every layer's key/value states there (NuggetState) -> decoder pass whose tokens attend to the nuggets of any number of
documents and to themselves. Where everything sits: layout.py; fingerprints: identity.py; checkpoints: persistence.py.
`NuggetModel.run` is the one caller of the inner LLaMA model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DECODER, ENCODER, Decoding, MergedFormat, NuggetConfig
from ..state.nugget_state import UNIDENTIFIED, NuggetState
from . import layout as positions
from .adapters import Adapters
from .attention import CaptureNuggets, ReadNuggets
from .attention import install as install_attention
from .base_model import BaseLM
from .identity import Identity, base_digest
from .int8 import check_int8_support
from .layout import NuggetLayout
from .packing import EncoderRows
from .persistence import Persistence
from .prefix_cache import PrefixCache, PromptPrefixes
from .prefix_rows import PrefixRows
from .scorer import Scorer, rank_nuggets, select_nuggets

PREFIX_CACHE_SIZE = 8  # prompt openings kept between queries (one per system prompt in use, typically)


@dataclass
class DecoderOutput:
    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    # with labels: the logits that predict each target, [targets, vocab] in row-major (sample, position) order
    target_logits: torch.Tensor | None = None


class NuggetModel(Identity, Persistence, PromptPrefixes, nn.Module):
    """Dodo as a context compressor (paper Sec. 2.3) on a Hugging Face LLaMA model."""

    def __init__(self, base: BaseLM, config: NuggetConfig | None = None):
        super().__init__()
        self.config = config or NuggetConfig()
        self.tokenizer = base.tokenizer
        self.base_name = base.name
        # Under in_user_turn, documents are encoded (and their nuggets read) after the chat template's opening,
        # as Full's prompt has them; the key/values of a document at r = 1 are then exactly Full's.
        self.document_opening = positions.document_opening(self.tokenizer, self.config.placement == "in_user_turn")
        lm = base.model
        install_attention(lm.model)
        self._base_digest = base_digest(lm)
        positions.check_fixed_rotary(lm.config, base.name)
        if not 1 <= self.config.scorer_layer <= lm.config.num_hidden_layers:
            raise ValueError(
                f"scorer_layer={self.config.scorer_layer} is outside the model's 1..{lm.config.num_hidden_layers} layers"
            )
        hidden = lm.config.hidden_size
        # Seeded init of every new part: an untrained model is the same (same fingerprint) in every process,
        # and the caller's random stream is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            self.adapters = Adapters(lm, self.config.lora)
            self.peft = self.adapters.peft  # a submodule: moves, trains and saves with the model
            self.scorer = Scorer(hidden, self.config.scorer_hidden or hidden)
            std = float(lm.get_input_embeddings().weight.float().std())
            self.soft_prompt = nn.Parameter(torch.randn(self.config.soft_prompt_tokens, hidden) * std)
        param = next(lm.parameters())
        self.scorer.to(param.device, param.dtype)
        self.soft_prompt.data = self.soft_prompt.data.to(param.device, param.dtype)
        # Adapter switches are global: one pass at a time. A plain Lock, since a stream may resume in another thread.
        self.lock = threading.Lock()
        self._weights_digests: dict[str | None, tuple[tuple, str]] = {}  # adapter -> (what it hashed, its sha256)
        self.prefix_cache = PrefixCache(PREFIX_CACHE_SIZE)
        # How decoder passes that fit it (right-padded, one pass: training) attend to nuggets: "fused" without a float
        # mask (attention.BiasChannelNuggets), "reference" under one, "auto" fused on CUDA.
        self.attention: Literal["auto", "fused", "reference"] = "auto"
        self.decoding: Decoding = "dynamic"  # how generation decodes after the prompt (static_decoding.py)
        self.set_trainable()
        self.eval()

    # ------------------------------------------------------------------ parts and switches
    @property
    def llama(self) -> nn.Module:
        """The LlamaForCausalLM inside the PEFT wrapper."""
        return self.peft.get_base_model()

    @property
    def merged_adapters(self) -> tuple[str, ...]:
        """Adapters that passes without autograd run as merged weights (default: the decoder); () saves the memory
        of the merged copy (106 MB for the default model in float32)."""
        return self.adapters.merged

    @merged_adapters.setter
    def merged_adapters(self, adapters: tuple[str, ...]) -> None:
        self.adapters.merged = tuple(adapters)

    @property
    def merged_format(self) -> MergedFormat:
        """How the merged adapters' passes run: "float" (the model's dtype) or "int8" (int8 weights in each linear
        layer of the decoder stack and the output layer: 1.8x faster decoding on a CPU; float32 CPU only; int8.py)."""
        return self.adapters.merged_format

    @merged_format.setter
    def merged_format(self, value: MergedFormat) -> None:
        if value not in get_args(MergedFormat):
            raise ValueError(f"merged_format={value!r}: choose one of {', '.join(get_args(MergedFormat))}")
        if value == "int8":
            check_int8_support(self.device, self.dtype)
        self.adapters.merged_format = value

    @property
    def device(self) -> torch.device:
        return self.soft_prompt.device

    @property
    def dtype(self) -> torch.dtype:
        return self.soft_prompt.dtype

    @property
    def max_positions(self) -> int:
        return int(self.llama.config.max_position_embeddings)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers of the base model (to hook, not to call: `run` and `run_layers` do that)."""
        return self.llama.model.layers

    @property
    def inv_freq(self) -> torch.Tensor:
        """The rotary frequencies, which move a key to another position (attention.rotate_keys)."""
        return self.llama.model.rotary_emb.inv_freq

    def run(self, adapter: str | None, nuggets: CaptureNuggets | ReadNuggets | None = None,
            inner: nn.Module | None = None, **inputs: torch.Tensor | object) -> torch.Tensor:
        """One pass of the inner LLaMA model with `adapter` active (None: the frozen base model), under the lock;
        returns the last hidden states. `inputs`: input_ids or inputs_embeds, and position_ids, attention_mask or a KV
        `cache`. The only caller of the inner model (or `inner`, its compiled wrapper): adapter switches are global."""
        use_cache = inputs.get("cache") is not None
        with self.lock, self.use_adapter(adapter):
            inner = self.llama.model if inner is None else inner
            return inner(nuggets=nuggets, use_cache=use_cache, **inputs).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer (never adapted; in int8 without autograd when `merged_format` is "int8")."""
        return self.adapters.output_layer(self.llama.lm_head)(hidden)

    def adapter_parameters(self, adapter: str) -> Iterator[nn.Parameter]:
        return self.adapters.parameters(adapter)

    def set_trainable(self, encoder: bool = True, decoder: bool = True, scorer: bool = True, soft_prompt: bool = True):
        """Choose which nugget parts train; the base model stays frozen."""
        for p in self.llama.parameters():
            p.requires_grad_(False)
        for p in self.adapter_parameters(ENCODER):
            p.requires_grad_(encoder)
        for p in self.adapter_parameters(DECODER):
            p.requires_grad_(decoder)
        self.scorer.requires_grad_(scorer)
        self.soft_prompt.requires_grad_(soft_prompt)

    def use_adapter(self, adapter: str | None):
        """Context: run with one adapter active, or none (adapter=None: the frozen base model); both keep training
        (PEFT's own switch would freeze the inactive one). Entered without autograd, an adapter in
        `merged_adapters` runs as merged weights."""
        return self.adapters.use(adapter)

    def enable_gradient_checkpointing(self) -> None:
        """Checkpoint every decoder layer; the replay runs under the adapter that was active in the forward pass."""
        self.adapters.enable_gradient_checkpointing(self.llama)

    # ------------------------------------------------------------------ encoder side
    def pad(self, sequences: Sequence[Sequence[int]], left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids padded into one batch on the model's device (layout.pad), and the mask of real tokens."""
        return positions.pad(sequences, self.tokenizer.pad_token_id, self.device, left)

    def score(self, input_ids: torch.Tensor, steps: torch.Tensor | None = None, mask: torch.Tensor | None = None,
              holding_lock: bool = False, scorer: Scorer | None = None) -> torch.Tensor:
        """Scorer over the hidden states after `scorer_layer` layers of the frozen model (adapters off); causal, or
        at positions `steps` under a boolean `mask` ([batch, 1, tokens, tokens]: packed rows, packing.py).
        `holding_lock`: the caller holds `lock` (the compiled training step, which traces this). `scorer`: another
        Scorer over the same states (`scorer_from`; default the model's)."""
        steps = torch.arange(input_ids.shape[1], device=input_ids.device)[None] if steps is None else steps
        with nullcontext() if holding_lock else self.lock, torch.no_grad():
            hidden = self.run_layers(None, self.llama.model.embed_tokens(input_ids), steps, mask=mask,
                                     layers=self.config.scorer_layer, norm=False)
        return (scorer or self.scorer)(hidden)

    def run_layers(self, adapter: str | None, hidden: torch.Tensor, steps: torch.Tensor, nuggets=None,
                   mask: torch.Tensor | None = None, layers: int | None = None, norm: bool = True) -> torch.Tensor:
        """The first `layers` (default all) layers of the base model over input embeddings `hidden` at positions
        `steps` under `adapter`, then the final norm: tensors in and out, no mask built, no lock taken (the compiled
        training step traces it, holding the lock; `run` is the general pass)."""
        inner = self.llama.model
        with self.use_adapter(adapter):
            rotary = inner.rotary_emb(hidden, position_ids=steps)
            for layer in inner.layers[:layers]:
                hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=steps,
                               nuggets=nuggets)
            return inner.norm(hidden) if norm else hidden

    def compress(self, token_ids: Sequence[Sequence[int]], ratio: float | None = None, adapter: str | None = ENCODER,
                 segment_tokens: int | None = None, ranked: bool = False, packed: bool = False,
                 identify: bool = True) -> list[NuggetState]:
        """Encode each document (a list of token ids) into its nuggets, in one right-padded batch (`packed`: several
        documents a row, packing.py).

        A document longer than `segment_tokens` (default: the model's positions less the document opening) is cut
        into segments that are compressed independently and joined into one state (each keeps its own last token).
        `ranked`: states in resolution order with floor `ratio`, readable at any coarser ratio (NuggetState.at_ratio);
        else in reading order. `identify=False` (a training pass, whose weights change every step) skips hashing the
        weights into the states' fingerprint: they are tagged UNIDENTIFIED, which a NuggetStore refuses.
        """
        ratio = self.config.ratio if ratio is None else NuggetConfig(ratio=ratio).ratio
        segment_tokens = self.segment_length(segment_tokens)
        if not token_ids or min(len(t) for t in token_ids) == 0:
            raise ValueError("every document must have at least one token")
        pieces, owners = positions.split_segments(token_ids, segment_tokens)
        fingerprint = (self.fingerprint(ratio, adapter, segment_tokens, ranked) if identify
                       else self.state_tag(UNIDENTIFIED))
        states = self._compress_segments(pieces, ratio, adapter, fingerprint, ranked, packed)
        joined: list[list[tuple[int, NuggetState]]] = [[] for _ in token_ids]
        for (doc, start), state in zip(owners, states):
            joined[doc].append((start, state))
        return [parts[0][1] if len(parts) == 1 else positions.join_segments(parts, self.inv_freq) for parts in joined]

    def segment_length(self, segment_tokens: int | None = None) -> int:
        """Tokens per independently compressed segment (layout.segment_length)."""
        return positions.segment_length(self.max_positions, len(self.document_opening), segment_tokens)

    def encoder_input(self, token_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, int]:
        """Right-padded ids of each document after the document opening, and the opening's length h."""
        opening = self.document_opening
        return self.pad([opening + list(t) for t in token_ids])[0], len(opening)

    def to_document_positions(self, keys: torch.Tensor, opening: int) -> torch.Tensor:
        """Keys ([..., k, head_dim]) encoded after an opening of that many tokens, moved to positions from 0."""
        return positions.to_document_positions(keys, opening, self.inv_freq)

    def _compress_segments(self, token_ids: list[list[int]], ratio: float, adapter: str | None,
                           fingerprint: str, ranked: bool, packed: bool = False) -> list[NuggetState]:
        lengths, opening = [len(t) for t in token_ids], len(self.document_opening)
        rows = EncoderRows.of([self.document_opening + t for t in token_ids], self.tokenizer.pad_token_id,
                              self.device, packed)
        scores = rows.unpack(self.score(rows.ids, rows.steps, rows.mask))[:, opening:]
        chosen = (rank_nuggets if ranked else select_nuggets)(scores, lengths, ratio)
        capture = CaptureNuggets(rows.gather_positions([c + opening for c in chosen]), mask=rows.mask)
        self.run(adapter, capture, input_ids=rows.ids, position_ids=rows.steps)
        keys, values = (rows.per_sequence(t, [len(c) for c in chosen]) for t in capture.stacked())
        keys = self.to_document_positions(keys, opening)
        states = []
        for b, (chosen_b, n) in enumerate(zip(chosen, lengths)):
            k = len(chosen_b)
            tokens = self.tokenizer.convert_ids_to_tokens([token_ids[b][i] for i in chosen_b.tolist()])
            states.append(NuggetState(keys[:, b, :, :k], values[:, b, :, :k], chosen_b, scores[b, chosen_b],
                                      tokens, n, fingerprint, floor=ratio if ranked else None))
        return states

    # ------------------------------------------------------------------ decoder side
    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
        """The decoder's token ids before and after the nuggets, for a chat whose last user turn asks about them."""
        return positions.prompt_around_documents(self.tokenizer, messages, self.config.placement == "in_user_turn")

    def layout(self, samples: Sequence[Sequence[NuggetState]], prefixes: Sequence[Sequence[int] | None] | None = None,
               adapter: str | None = DECODER, in_pass: bool = False) -> NuggetLayout:
        """Each sample's prompt prefix and documents composed in order at positions 0, 1, ... (layout.compose).

        A prefix of None (the default) is the document opening for a sample with documents, else nothing. States
        made by another base model are refused. `in_pass`: the prefixes run as rows of the pass that reads the layout
        (NuggetLayout.inputs; prefix_rows.py), not in a pass of their own.
        """
        prefixes = [None] * len(samples) if prefixes is None else prefixes
        if len(prefixes) != len(samples):
            raise ValueError(f"got {len(prefixes)} prompt prefixes for {len(samples)} samples")
        self.check_origin(state for docs in samples for state in docs)
        wanted = [(self.document_opening if docs else []) if p is None else p for p, docs in zip(prefixes, samples)]
        empty = positions.no_states(self.llama.config, self.dtype, self.device)
        rows = PrefixRows.of(wanted, self.tokenizer.pad_token_id, self.device) if in_pass else None
        heads = rows.placeholders(wanted, empty) if rows else self.prefix_states(wanted, adapter)
        samples = [docs if head is None else [head, *docs] for head, docs in zip(heads, samples)]
        return positions.compose(samples, empty, self.inv_freq, self.config.nugget_positions, rows)

    def embed(self, input_ids: torch.Tensor, token_mask: torch.Tensor, soft_prompt: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings, with the soft prompt put before each row's first real token when asked."""
        embeds = self.llama.get_input_embeddings()(input_ids)
        if not soft_prompt or self.soft_prompt.shape[0] == 0:
            return embeds, token_mask
        soft = self.soft_prompt[None].expand(input_ids.shape[0], -1, -1).to(embeds.dtype)
        ones = torch.ones(soft.shape[:2], dtype=torch.bool, device=token_mask.device)
        return torch.cat([soft, embeds], dim=1), torch.cat([ones, token_mask], dim=1)

    def check_positions(self, states: int, tokens: int) -> None:
        """Refuse a decoder input of `states` prefix and nugget states and `tokens` tokens that cannot fit."""
        positions.check_positions(self.max_positions, states, tokens)

    def decode(self, samples: Sequence[Sequence[NuggetState]], input_ids: torch.Tensor,
               token_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None, soft_prompt: bool = False,
               adapter: str | None = DECODER, return_logits: bool = True,
               prefixes: Sequence[Sequence[int] | None] | None = None,
               logit_labels: torch.Tensor | None = None) -> DecoderOutput:
        """Decoder pass over `input_ids` after each sample's prompt prefix and documents' nuggets (and soft prompt).

        `labels` align with `input_ids` (-100 = ignored); the loss predicts each label from everything before it
        (with the soft prompt, the first token too). Logits (over `input_ids`) are left out with return_logits=False,
        and the loss then runs the output layer only where there are labels. `target_logits` are those predicting
        `logit_labels` (default: `labels`), which then must cover every label; the loss stays on `labels`.
        """
        token_mask = torch.ones_like(input_ids, dtype=torch.bool) if token_mask is None else token_mask.bool()
        # under autograd no prefix state is kept: the prefixes run as rows of this pass rather than in one of their own
        layout = self.layout(samples, prefixes, adapter, in_pass=torch.is_grad_enabled())
        embeds, full_mask = self.embed(input_ids, token_mask, soft_prompt)
        width = embeds.shape[1]
        self.check_positions(int(layout.next_positions.max()), width)
        fused = self.attention == "fused" or (self.attention == "auto" and embeds.device.type == "cuda")
        embeds, full_mask, steps = layout.inputs(embeds, full_mask, self.llama.get_input_embeddings())
        hidden = self.run(adapter, layout.reader(full_mask, embeds.shape[1], fused), inputs_embeds=embeds,
                          position_ids=steps)[: len(samples), :width]
        extra = width - input_ids.shape[1]
        logits = self.logits(hidden[:, extra:]) if return_logits else None
        loss = target_logits = None
        if labels is not None:
            labels = labels.to(hidden.device)
            shown = labels if logit_labels is None else logit_labels.to(hidden.device)
            # hidden at position i predicts the token at i + 1; with a soft prompt its last vector predicts token 0
            predictors, targets, shown = ((hidden[:, extra - 1 : -1], labels, shown) if extra
                                          else (hidden[:, :-1], labels[:, 1:], shown[:, 1:]))
            kept = shown != -100
            if not (targets != -100).any():
                raise ValueError("labels has no target (every label is -100)")
            target_logits = self.logits(predictors[kept]).float()
            targets = targets[kept]
            labelled = targets != -100  # all of them unless logit_labels shows more positions
            loss = F.cross_entropy(target_logits[labelled], targets[labelled])
        return DecoderOutput(logits=logits, loss=loss, target_logits=target_logits)

    def read_text(self, input_ids: torch.Tensor, token_mask: torch.Tensor, adapter: str | None = None) -> torch.Tensor:
        """Last hidden states of a plain forward over right-padded `input_ids` (no nuggets; adapters off by default:
        the uncompressed teacher of distillation)."""
        return self.run(adapter, input_ids=input_ids, attention_mask=token_mask.long())
