"""Distillation from the uncompressed teacher (KV-Distill, Cartridges' context distillation).

The teacher is a frozen LLaMA (by default the student's own base model with its adapters off) reading each
example's full text in the student's layout: prompt prefix, the documents' tokens end to end, then the decoder's
tokens. The student is the decoder reading the documents' nuggets in their place. Both predict the same target
tokens; their next-token distributions are compared by a KL that joins the cross-entropy (`Distillation`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base_model import BaseLM
from ..layout import pad
from ..model import NuggetModel
from .config import Distillation
from .data import Batch


class Teacher:
    """Next-token logits of the uncompressed model at a batch's target tokens, aligned with the student's."""

    def __init__(self, student: NuggetModel, base: BaseLM | None = None):
        if base is not None and base.tokenizer.get_vocab() != student.tokenizer.get_vocab():
            raise ValueError(f"the teacher {base.name!r} has another tokenizer than the student's base model "
                             f"{student.base_name!r}; distil from a model with the same tokenizer")
        self.student, self.base = student, base

    @torch.no_grad()
    def target_logits(self, batch: Batch, soft_prompt: bool) -> torch.Tensor:
        """[targets, vocab] in the order of `NuggetModel.decode`'s target_logits: row-major over (sample, position),
        every label that is not -100 (the first token's only with a soft prompt, which alone predicts it)."""
        device = self.student.device
        rows, picks = [], []
        for b, (prefix, docs) in enumerate(zip(batch.prefixes, batch.documents)):
            docs = batch.teacher_documents[b] if b < len(batch.teacher_documents) and batch.teacher_documents[b] else docs
            n = int(batch.token_mask[b].sum())
            head = list(prefix) + [t for doc in docs for t in doc]
            rows.append(head + batch.input_ids[b, :n].tolist())
            first = 0 if soft_prompt else 1
            targets = (batch.labels[b, first:n] != -100).nonzero().flatten() + first
            # token j of the decoder's input sits at len(head) + j in the teacher's; the state before it predicts it
            picks.append((b, targets + len(head) - 1))
        limit = self.max_positions
        if max(map(len, rows)) > limit:
            raise ValueError(f"a teacher input of {max(map(len, rows))} tokens exceeds the teacher's {limit} positions "
                             "(the data builder skips such examples; was it built without distillation?)")
        ids, mask = pad(rows, self.student.tokenizer.pad_token_id, device)
        if self.base is None:
            hidden = self.student.read_text(ids, mask, adapter=None)
            head = self.student.logits
        else:
            hidden = self.base.model.model(input_ids=ids, attention_mask=mask.long(), use_cache=False).last_hidden_state
            head = self.base.model.lm_head
        chosen = torch.cat([hidden[b, index.to(device)] for b, index in picks])
        return head(chosen).float()

    @property
    def max_positions(self) -> int:
        model = self.student.llama if self.base is None else self.base.model
        return int(model.config.max_position_embeddings)


def kl_loss(student: torch.Tensor, teacher: torch.Tensor, settings: Distillation) -> torch.Tensor:
    """Mean KL per target token between the student's and the teacher's distributions ([targets, vocab] logits)."""
    t = settings.temperature
    student, teacher = student.float() / t, teacher.float() / t
    if settings.top_k:  # both distributions restricted to the teacher's top-k tokens
        teacher, index = teacher.topk(min(settings.top_k, teacher.shape[-1]), dim=-1)
        student = student.gather(-1, index)
    log_s, log_t = F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)
    forward = (log_t.exp() * (log_t - log_s)).sum(-1)
    if settings.direction == "forward":
        per_token = forward
    else:
        reverse = (log_s.exp() * (log_s - log_t)).sum(-1)
        per_token = reverse if settings.direction == "reverse" else (forward + reverse) / 2
    return per_token.mean() * t * t
