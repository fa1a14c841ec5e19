"""The Dodo model: a frozen LLaMA with an encoder and a decoder LoRA adapter, a Scorer and a soft prompt.

Data flow: token ids -> Scorer over the frozen model's early layers -> top-k positions -> encoder pass that
records every layer's key/value states there (NuggetState) -> decoder pass whose tokens attend to the
nuggets of any number of documents and to themselves.

Position scheme (one function, `layout`, serves training and inference): a document is encoded alone, after the
document opening (with the default `placement="in_user_turn"`, the chat template up to the user's text, where
Full's prompt has the documents; nothing otherwise), and stored at positions 0..n-1. When documents are read,
the decoder first runs the prompt's prefix (by default that opening; h tokens) at 0..h-1; the nuggets follow,
renumbered in the order given, h..h+K-1 over all documents (each key's rotary phase is shifted to its new
position, an exact rotation), then the rest of the prompt at h+K, h+K+1, ... So documents compose in any number
and order, and the position budget is spent on nuggets, not on the original tokens. With r = 1, one document and
adapters off this is exactly the base model reading Full's prompt (opening, document, rest of the prompt).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .adapters import Adapters, weights_version
from .attention import CaptureNuggets, ReadNuggets, rotate_keys
from .attention import install as install_attention
from .base_model import DEFAULT_MODEL_NAME, BaseLM, load_base_model
from .config import DECODER, ENCODER, LEGACY_PLACEMENT, NuggetConfig
from .prompts import document_opening, prompt_around_documents
from .scorer import Scorer, select_nuggets
from .state import NuggetState

CONFIG_FILE = "nugget_config.json"
WEIGHTS_FILE = "nugget.safetensors"
CHECKPOINT_FORMAT = "nugget-rag/checkpoint-v1"
DEFAULT_CHECKPOINT = "default"
PREFIX_CACHE_SIZE = 8  # prompt openings kept between queries (one per system prompt in use, typically)
# The adapters and Scorer shipped for the default base model (MODEL_CARD.md); `DEFAULT_CHECKPOINT` names them.
SHIPPED_CHECKPOINT = Path(__file__).parent / "checkpoints" / "smollm2-135m-instruct-r10"


@dataclass
class DecoderOutput:
    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    # with labels: the logits that predict each target, [targets, vocab] in row-major (sample, position) order
    target_logits: torch.Tensor | None = None


@dataclass
class NuggetLayout:
    """Nuggets of a batch of samples laid out for the decoder (see the module docstring)."""

    keys: torch.Tensor  # [layers, batch, kv_heads, K, head_dim]
    values: torch.Tensor
    bias: torch.Tensor  # [batch, K]: straight-through term, -inf on padding
    counts: torch.Tensor  # [batch]: real nuggets per sample

    def reader(self, token_mask: torch.Tensor, query_len: int) -> ReadNuggets:
        return ReadNuggets(self.keys, self.values, self.bias, token_mask, query_len)


class NuggetModel(nn.Module):
    """Dodo as a context compressor (paper Sec. 2.3) on a Hugging Face LLaMA model."""

    def __init__(self, base: BaseLM, config: NuggetConfig | None = None):
        super().__init__()
        self.config = config or NuggetConfig()
        self.tokenizer = base.tokenizer
        self.base_name = base.name
        # Under in_user_turn, documents are encoded (and their nuggets read) after the chat template's opening,
        # as Full's prompt has them; the key/values of a document at r = 1 are then exactly Full's.
        self.document_opening = document_opening(self.tokenizer, self.config.placement == "in_user_turn")
        lm = base.model
        install_attention(lm.model)
        self._base_digest = _base_digest(lm)
        rope_type = (getattr(lm.config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"{base.name} uses rope_type={rope_type!r}, whose frequencies depend on the sequence "
                             "length, so nuggets encoded alone cannot be moved exactly to their place in a prompt; "
                             "use a checkpoint with fixed rotary frequencies (default, linear, llama3, yarn)")
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
        self._weights_digest: tuple[tuple | None, str] = (None, "")  # (what it hashed, its sha256)
        # prompt-prefix states computed without gradients, keyed by ids, adapter and the adapter's weight versions
        self._prefix_cache: OrderedDict[tuple, NuggetState] = OrderedDict()
        self._prefix_cache_lock = threading.Lock()
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
    def device(self) -> torch.device:
        return self.soft_prompt.device

    @property
    def dtype(self) -> torch.dtype:
        return self.soft_prompt.dtype

    @property
    def max_positions(self) -> int:
        return int(self.llama.config.max_position_embeddings)

    def adapter_parameters(self, adapter: str) -> Iterator[nn.Parameter]:
        return self.adapters.parameters(adapter)

    def named_adapter_parameters(self, adapter: str) -> list[tuple[str, nn.Parameter]]:
        return self.adapters.named_parameters(adapter)

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

    # ------------------------------------------------------------------ identity
    def fingerprint(self, ratio: float | None = None, adapter: str | None = ENCODER,
                    segment_tokens: int | None = None) -> str:
        """Digest of everything that shapes a NuggetState: base model, the compressing adapter (weights and LoRA
        settings), Scorer, r, segment length, dtype."""
        ratio = self.config.ratio if ratio is None else ratio
        segment_tokens = self.segment_length(segment_tokens)
        named = self.named_adapter_parameters(adapter) if adapter else []
        named += [(f"scorer.{n}", p) for n, p in self.scorer.named_parameters()]
        # Hashing every weight costs a device-to-host copy; redo it only when a weight changed in place
        # (an optimiser step, a load) or was replaced, which version counters, ids and storage pointers tell.
        stamp = (adapter, weights_version(p for _, p in named))
        cached = self._weights_digest  # one read: another thread may replace it meanwhile
        if cached[0] != stamp:
            h = hashlib.sha256()
            for name, p in named:
                h.update(name.encode())
                h.update(p.detach().float().cpu().numpy().tobytes())
            cached = self._weights_digest = (stamp, h.hexdigest())
        identity = [self._base_digest, ratio, self.config.scorer_layer, str(self.dtype), adapter, segment_tokens,
                    self.config.lora.model_dump(mode="json") if adapter else None, cached[1]]
        identity += [self.document_opening] if self.document_opening else []
        return self.state_tag(hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32])

    @property
    def base_digest(self) -> str:
        """Digest of the base model's weights (what a checkpoint and a NuggetState are bound to)."""
        return self._base_digest

    def state_tag(self, name: str) -> str:
        """A NuggetState fingerprint naming this base model, then `name`; the decoder reads only states whose
        fingerprint names its own base model."""
        return f"{self._base_digest[:12]}:{name}"

    # ------------------------------------------------------------------ encoder side
    def _pad(self, sequences: Sequence[Sequence[int]], left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.bool)
        for i, s in enumerate(sequences):
            span = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, span] = torch.tensor(list(s), dtype=torch.long)
            mask[i, span] = True
        return ids.to(self.device), mask.to(self.device)

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scorer over the hidden states after `scorer_layer` layers of the frozen model (adapters off)."""
        inner = self.llama.model
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        with self.use_adapter(None), torch.no_grad():
            hidden = inner.embed_tokens(input_ids)
            rotary = inner.rotary_emb(hidden, position_ids=positions)
            for layer in inner.layers[: self.config.scorer_layer]:
                hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)
        return self.scorer(hidden)

    def compress(
        self,
        token_ids: Sequence[Sequence[int]],
        ratio: float | None = None,
        adapter: str | None = ENCODER,
        segment_tokens: int | None = None,
    ) -> list[NuggetState]:
        """Encode each document (a list of token ids) into its nuggets, in one right-padded batch.

        A document longer than `segment_tokens` (default: the model's positions less the document opening) is cut
        into segments that are compressed independently and joined into one state (each keeps its own last token).
        """
        ratio = self.config.ratio if ratio is None else NuggetConfig(ratio=ratio).ratio
        segment_tokens = self.segment_length(segment_tokens)
        if not token_ids or min(len(t) for t in token_ids) == 0:
            raise ValueError("every document must have at least one token")
        pieces, owners = [], []
        for doc, ids in enumerate(token_ids):
            for start in range(0, len(ids), segment_tokens):
                pieces.append(list(ids[start : start + segment_tokens]))
                owners.append((doc, start))
        with self.lock:
            states = self._compress_segments(pieces, ratio, adapter, self.fingerprint(ratio, adapter, segment_tokens))
        joined: list[list[tuple[int, NuggetState]]] = [[] for _ in token_ids]
        for (doc, start), state in zip(owners, states):
            joined[doc].append((start, state))
        return [parts[0][1] if len(parts) == 1 else self._join_segments(parts) for parts in joined]

    def segment_length(self, segment_tokens: int | None = None) -> int:
        """Tokens per independently compressed segment: `segment_tokens`, at most (and by default) the model's
        positions less the document opening."""
        if segment_tokens is not None and segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
        room = self.max_positions - len(self.document_opening)
        return min(segment_tokens or room, room)

    def encoder_input(self, token_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, int]:
        """Right-padded ids of each document after the document opening, and the opening's length h."""
        opening = self.document_opening
        return self._pad([opening + list(t) for t in token_ids])[0], len(opening)

    def to_document_positions(self, keys: torch.Tensor, opening: int) -> torch.Tensor:
        """Keys ([..., k, head_dim]) encoded after an opening of that many tokens, moved to positions from 0."""
        if not opening:
            return keys
        shift = torch.full((keys.shape[-2],), -opening, device=keys.device)
        return rotate_keys(keys, shift, self.llama.model.rotary_emb.inv_freq)

    def _compress_segments(self, token_ids: list[list[int]], ratio: float, adapter: str | None,
                           fingerprint: str) -> list[NuggetState]:
        lengths = [len(t) for t in token_ids]
        input_ids, opening = self.encoder_input(token_ids)
        scores = self.score(input_ids)[:, opening:]
        chosen = select_nuggets(scores, lengths, ratio)
        width = max(len(c) for c in chosen)
        padded = torch.stack([F.pad(c, (0, width - len(c)), value=int(c[-1])) for c in chosen])
        capture = CaptureNuggets(padded + opening)
        with self.use_adapter(adapter):
            self.llama.model(input_ids=input_ids, nuggets=capture, use_cache=False)
        keys, values = capture.stacked()
        keys = self.to_document_positions(keys, opening)
        states = []
        for b, (positions, n) in enumerate(zip(chosen, lengths)):
            k = len(positions)
            tokens = self.tokenizer.convert_ids_to_tokens([token_ids[b][i] for i in positions.tolist()])
            states.append(
                NuggetState(keys[:, b, :, :k], values[:, b, :, :k], positions, scores[b, positions],
                            tokens, n, fingerprint)
            )
        return states

    def _join_segments(self, parts: list[tuple[int, NuggetState]]) -> NuggetState:
        """One state for a segmented document: keys move to their document-wide positions."""
        inv_freq = self.llama.model.rotary_emb.inv_freq
        keys = [rotate_keys(s.keys, torch.full_like(s.positions, start), inv_freq) for start, s in parts]
        return NuggetState(
            keys=torch.cat(keys, dim=2),
            values=torch.cat([s.values for _, s in parts], dim=2),
            positions=torch.cat([s.positions + start for start, s in parts]),
            scores=torch.cat([s.scores for _, s in parts]),
            tokens=[t for _, s in parts for t in s.tokens],
            n=sum(s.n for _, s in parts),
            fingerprint=parts[0][1].fingerprint,
        )

    # ------------------------------------------------------------------ decoder side
    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
        """The decoder's token ids before and after the nuggets, for a chat whose last user turn asks about them."""
        return prompt_around_documents(self.tokenizer, messages, self.config.placement == "in_user_turn")

    def prefix_states(
        self, prefixes: Sequence[Sequence[int]], adapter: str | None = DECODER
    ) -> list[NuggetState | None]:
        """Every layer's key/value states of each prompt prefix as the decoder computes them (positions 0..h-1).

        None for an empty prefix; equal prefixes run once. Under autograd the states carry the adapter's gradient;
        without it they are kept (the last few) and reused until the adapter's weights change.
        """
        unique = list(dict.fromkeys(tuple(p) for p in prefixes if len(p)))
        if not unique:
            return [None] * len(prefixes)
        stamp = self._weights_stamp(adapter) if not torch.is_grad_enabled() else None
        with self._prefix_cache_lock:
            states = {u: self._prefix_cache[(u, stamp)] for u in unique if stamp and (u, stamp) in self._prefix_cache}
        missing = [u for u in unique if u not in states]
        if missing:
            states.update(self._run_prefixes(missing, adapter))
        if stamp:
            with self._prefix_cache_lock:
                for u in unique:
                    self._prefix_cache[(u, stamp)] = states[u]
                    self._prefix_cache.move_to_end((u, stamp))
                while len(self._prefix_cache) > PREFIX_CACHE_SIZE:
                    self._prefix_cache.popitem(last=False)
        return [states[tuple(p)] if len(p) else None for p in prefixes]

    def _weights_stamp(self, adapter: str | None) -> tuple:
        """Changes whenever an adapter weight is changed in place or replaced (as in `fingerprint`)."""
        return (adapter, str(self.dtype), str(self.device), self.adapters.version(adapter))

    def _run_prefixes(self, unique: list[tuple[int, ...]], adapter: str | None) -> dict[tuple[int, ...], NuggetState]:
        input_ids, _ = self._pad(unique)
        lengths = [len(u) for u in unique]
        steps = torch.arange(max(lengths), device=self.device)
        capture = CaptureNuggets(torch.stack([steps.clamp(max=n - 1) for n in lengths]))
        with self.lock, self.use_adapter(adapter):
            self.llama.model(input_ids=input_ids, nuggets=capture, use_cache=False)
        keys, values = capture.stacked()
        return {
            u: NuggetState(keys[:, b, :, :n], values[:, b, :, :n], steps[:n], torch.zeros(n, device=self.device),
                           self.tokenizer.convert_ids_to_tokens(list(u)), n, self.state_tag("prompt-prefix"))
            for b, (u, n) in enumerate(zip(unique, lengths))
        }

    def layout(
        self,
        samples: Sequence[Sequence[NuggetState]],
        prefixes: Sequence[Sequence[int] | None] | None = None,
        adapter: str | None = DECODER,
    ) -> NuggetLayout:
        """Compose each sample's prompt prefix and documents in order, at positions 0, 1, ...

        A prefix of None (the default) is the document opening for a sample with documents, else nothing.
        """
        prefixes = [None] * len(samples) if prefixes is None else prefixes
        if len(prefixes) != len(samples):
            raise ValueError(f"got {len(prefixes)} prompt prefixes for {len(samples)} samples")
        wanted = [(self.document_opening if docs else []) if p is None else p for p, docs in zip(prefixes, samples)]
        heads = self.prefix_states(wanted, adapter)
        samples = [docs if head is None else [head, *docs] for head, docs in zip(heads, samples)]
        keys, values, biases, shifts = zip(*(self._concatenate(docs) for docs in samples))
        width = max(1, max(len(d) for d in shifts))
        keys = torch.stack([F.pad(k, (0, 0, 0, width - k.shape[2])) for k in keys], dim=1)
        shift = torch.stack([F.pad(d, (0, width - len(d))) for d in shifts])  # padding: not moved
        return NuggetLayout(
            # every key of the batch moved to its new position in one rotation
            keys=rotate_keys(keys, shift[None, :, None, :], self.llama.model.rotary_emb.inv_freq),
            values=torch.stack([F.pad(v, (0, 0, 0, width - v.shape[2])) for v in values], dim=1),
            bias=torch.stack([F.pad(b, (0, width - len(b)), value=float("-inf")) for b in biases]),
            counts=torch.tensor([len(d) for d in shifts], device=self.device),
        )

    def _concatenate(self, docs: Sequence[NuggetState]) -> tuple[torch.Tensor, ...]:
        """One sample's nuggets in order: keys, values [layers, kv_heads, K, head_dim] at their stored positions,
        bias [K], and the shift [K] that moves each key to its new position 0..K-1."""
        cfg = self.llama.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        empty = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, 0, head_dim, dtype=self.dtype, device=self.device)
        origin = self.state_tag("")
        for state in docs:
            if not state.fingerprint.startswith(origin):
                raise ValueError(f"a NuggetState with fingerprint {state.fingerprint!r} was made by another base model "
                                 f"than {self.base_name!r} (fingerprints start {origin!r}); compress the document "
                                 "with this model")
        docs = [state.to(self.device, self.dtype) for state in docs]
        keys = torch.cat([empty, *(state.keys for state in docs)], dim=2)
        values = torch.cat([empty, *(state.values for state in docs)], dim=2)
        scores = torch.cat([torch.zeros(0, device=self.device), *(state.scores.float() for state in docs)])
        stored = torch.cat([torch.zeros(0, dtype=torch.long, device=self.device), *(state.positions for state in docs)])
        return keys, values, scores - scores.detach(), torch.arange(len(stored), device=self.device) - stored

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
        if states + tokens > self.max_positions:
            raise ValueError(
                f"{states} states (prompt opening and nuggets) plus {tokens} prompt tokens exceed the model's "
                f"{self.max_positions} positions; pass fewer documents, a shorter prompt, or compress at a larger r"
            )

    def decode(
        self,
        samples: Sequence[Sequence[NuggetState]],
        input_ids: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        soft_prompt: bool = False,
        adapter: str | None = DECODER,
        return_logits: bool = True,
        prefixes: Sequence[Sequence[int] | None] | None = None,
    ) -> DecoderOutput:
        """Decoder pass over `input_ids` after each sample's prompt prefix and documents' nuggets (and soft prompt).

        `labels` align with `input_ids` (-100 = ignored); the loss predicts each label from everything before it
        (with the soft prompt, the first token too). Logits (over `input_ids`) are left out with return_logits=False,
        and the loss then runs the output layer only where there are labels.
        """
        token_mask = torch.ones_like(input_ids, dtype=torch.bool) if token_mask is None else token_mask.bool()
        layout = self.layout(samples, prefixes, adapter)
        embeds, full_mask = self.embed(input_ids, token_mask, soft_prompt)
        self.check_positions(int(layout.counts.max()), embeds.shape[1])
        positions = layout.counts[:, None] + full_mask.long().cumsum(1) - 1
        with self.lock, self.use_adapter(adapter):
            hidden = self.llama.model(
                inputs_embeds=embeds, position_ids=positions.clamp(min=0), nuggets=layout.reader(full_mask, embeds.shape[1]),
                use_cache=False,
            ).last_hidden_state
        extra = embeds.shape[1] - input_ids.shape[1]
        logits = self.llama.lm_head(hidden[:, extra:]) if return_logits else None
        loss = target_logits = None
        if labels is not None:
            labels = labels.to(hidden.device)
            # hidden at position i predicts the token at i + 1; with a soft prompt its last vector predicts token 0
            predictors, targets = (hidden[:, extra - 1 : -1], labels) if extra else (hidden[:, :-1], labels[:, 1:])
            kept = targets != -100
            if not kept.any():
                raise ValueError("labels has no target (every label is -100)")
            target_logits = self.llama.lm_head(predictors[kept]).float()
            loss = F.cross_entropy(target_logits, targets[kept])
        return DecoderOutput(logits=logits, loss=loss, target_logits=target_logits)

    def read_text(self, input_ids: torch.Tensor, token_mask: torch.Tensor, adapter: str | None = None) -> torch.Tensor:
        """Last hidden states of a plain forward over right-padded `input_ids` (no nuggets; adapters off by default:
        the uncompressed teacher of distillation)."""
        with self.lock, self.use_adapter(adapter):
            return self.llama.model(input_ids=input_ids, attention_mask=token_mask.long(), use_cache=False).last_hidden_state

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.float32,
                        training: dict | None = None) -> Path:
        """Write the nugget parts (adapters, Scorer, soft prompt) as safetensors and the config as JSON.

        `dtype=torch.bfloat16` halves the file (what the package ships); loading casts to the model's dtype.
        `training` (JSON) records how the parts were trained, such as the ratios (`read_checkpoint_meta` shows it).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for adapter in (ENCODER, DECODER):
            for name, t in self.adapters.state_dict(adapter).items():
                tensors[f"{adapter}/{name}"] = t.detach().to("cpu", dtype).contiguous()
        for name, t in self.scorer.state_dict().items():
            tensors[f"scorer/{name}"] = t.detach().to("cpu", dtype).contiguous()
        tensors["soft_prompt"] = self.soft_prompt.detach().to("cpu", dtype).contiguous()
        save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": CHECKPOINT_FORMAT})
        meta = {"format": CHECKPOINT_FORMAT, "base_model": self.base_name, "base_digest": self._base_digest,
                "config": self.config.model_dump()}
        if training:
            meta["training"] = training
        (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        return directory

    def load_parts(self, directory: str | Path) -> None:
        """Load weights written by save_pretrained into this model (same config and base model)."""
        meta = read_checkpoint_meta(directory)
        if meta["base_digest"] != self._base_digest:
            raise ValueError(
                f"the checkpoint in {directory} was trained on base model {meta['base_model']!r}, whose weights "
                f"differ from the loaded {self.base_name!r}; load it with that base model"
            )
        tensors = load_file(Path(directory) / WEIGHTS_FILE, device="cpu")
        for adapter in (ENCODER, DECODER):
            prefix = f"{adapter}/"
            part = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            try:
                self.adapters.load_state_dict(adapter, part)
            except ValueError as err:
                raise ValueError(f"{directory}: {err}") from None
        self.scorer.load_state_dict({k[len("scorer/"):]: v for k, v in tensors.items() if k.startswith("scorer/")})
        with torch.no_grad():
            self.soft_prompt.copy_(tensors["soft_prompt"])

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path | None = DEFAULT_CHECKPOINT,
        base_model: str | Path | BaseLM | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        config: NuggetConfig | None = None,
    ) -> NuggetModel:
        """Load nugget parts from `directory` onto their base model.

        `directory="default"`: the checkpoint shipped for the default base model (MODEL_CARD.md), or a fresh model
        on any other base; `None`: a fresh (untrained) model.
        """
        if directory == DEFAULT_CHECKPOINT:
            directory = default_checkpoint_for(base_model)
        meta = read_checkpoint_meta(directory) if directory is not None else None
        if config is None:
            config = checkpoint_config(directory) if meta else NuggetConfig()
        if not isinstance(base_model, BaseLM):
            if base_model is None and meta and meta["base_model"] != DEFAULT_MODEL_NAME:
                raise ValueError(
                    f"the checkpoint in {directory} belongs to base model {meta['base_model']!r}; "
                    "pass base_model=<its checkpoint directory>"
                )
            base_model = load_base_model(base_model, device=device, dtype=dtype)
        model = cls(base_model, config)
        if directory is not None:
            model.load_parts(directory)
        return model


def default_checkpoint_for(base_model: str | Path | BaseLM | None) -> Path | None:
    """The shipped checkpoint when `base_model` is the default model (None or its name), else None (untrained)."""
    if base_model is None:
        name = DEFAULT_MODEL_NAME
    else:  # a directory of that name may hold other weights: load_parts compares the base digest
        name = base_model.name if isinstance(base_model, BaseLM) else Path(base_model).name
    return SHIPPED_CHECKPOINT if name == DEFAULT_MODEL_NAME and SHIPPED_CHECKPOINT.is_dir() else None


def checkpoint_config(directory: str | Path) -> NuggetConfig:
    """The nugget settings a checkpoint was trained with (one without `placement` predates it: before_prompt)."""
    return NuggetConfig.model_validate({"placement": LEGACY_PLACEMENT, **read_checkpoint_meta(directory)["config"]})


def read_checkpoint_meta(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} is not a nugget-rag checkpoint (save_pretrained writes one)")
    meta = json.loads(path.read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} has format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    return meta


def _base_digest(model: nn.Module) -> str:
    """A dtype-independent digest of the frozen base weights (a strided sample of every tensor)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 4096)][:4096].to(torch.bfloat16).float().cpu()
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]
