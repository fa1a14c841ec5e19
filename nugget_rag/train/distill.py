"""Distillation from the uncompressed teacher (KV-Distill, Cartridges' context distillation).

The teacher is a frozen LLaMA (by default the student's own base model with its adapters off) reading each
example's full text in the student's layout: prompt prefix, the documents' tokens end to end, then the decoder's
tokens. The student is the decoder reading the documents' nuggets in their place. Both predict the same target
tokens; their next-token distributions are compared by a KL that joins the cross-entropy (`Distillation`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.base_model import BaseLM
from ..model.layout import decoder_positions, pad
from ..model.nugget_model import NuggetModel
from .batches import Batch
from .config import Distillation


class Teacher:
    """Next-token logits of the uncompressed model at a batch's target tokens, aligned with the student's.

    The student's own base model (the default teacher) reads each example's prompt prefix as the states
    `NuggetModel.prefix_states` keeps for the frozen model (adapters off): computed once, in a pass of their own, and
    kept from step to step, since no weight of it trains; its pass then runs only the documents' and the decoder's
    tokens, after them. `rows`: the last batch's rows as (tokens run, prefix positions read before them).
    """

    def __init__(self, student: NuggetModel, base: BaseLM | None = None):
        if base is not None and base.tokenizer.get_vocab() != student.tokenizer.get_vocab():
            raise ValueError(f"the teacher {base.name!r} has another tokenizer than the student's base model "
                             f"{student.base_name!r}; distil from a model with the same tokenizer")
        self.student, self.base = student, base
        self.rows: list[tuple[int, int]] = []

    @torch.no_grad()
    def target_logits(self, batch: Batch, soft_prompt: bool) -> torch.Tensor:
        """[targets, vocab] in the order of `NuggetModel.decode`'s target_logits: row-major over (sample, position),
        every label that is not -100 (the first token's only with a soft prompt, which alone predicts it)."""
        device = self.student.device
        first = 0 if soft_prompt else 1
        heads, bodies, targets = [], [], []  # per example: prefix, documents' tokens, decoder's targets
        for b, (prefix, docs) in enumerate(zip(batch.prefixes, batch.documents)):
            docs = batch.teacher_documents[b] if b < len(batch.teacher_documents) and batch.teacher_documents[b] else docs
            heads.append(list(prefix))
            bodies.append([t for doc in docs for t in doc])
            targets.append((batch.labels[b, first : int(batch.token_mask[b].sum())] != -100).nonzero().flatten() + first)
        limit = self.max_positions
        longest = max(len(h) + len(d) + int(n) for h, d, n in zip(heads, bodies, batch.token_mask.sum(1)))
        if longest > limit:
            raise ValueError(f"a teacher input of {longest} tokens exceeds the teacher's {limit} positions "
                             "(the data builder skips such examples; was it built without distillation?)")
        kept = self.keeps_prefixes(heads, bodies, targets)
        before = [body if kept else head + body for head, body in zip(heads, bodies)]
        rows = [b + batch.input_ids[i, : int(batch.token_mask[i].sum())].tolist() for i, b in enumerate(before)]
        self.rows = [(len(row), len(head) if kept else 0) for row, head in zip(rows, heads)]
        ids, mask = pad(rows, self.student.tokenizer.pad_token_id, device)
        if self.base is not None:
            hidden = self.base.model.model(input_ids=ids, attention_mask=mask.long(), use_cache=False).last_hidden_state
            head = self.base.model.lm_head
        elif kept:
            layout = self.student.layout([[] for _ in rows], heads, adapter=None)
            hidden = self.student.run(None, layout.reader(mask, mask.shape[1]), input_ids=ids,
                                      position_ids=decoder_positions(layout.next_positions, mask))
            head = self.student.logits
        else:
            hidden = self.student.read_text(ids, mask, adapter=None)
            head = self.student.logits
        # token j of the decoder's input sits at len(before) + j in the teacher's row; the state before it predicts it
        chosen = torch.cat([hidden[b, (index + len(ahead) - 1).to(device)]
                            for b, (ahead, index) in enumerate(zip(before, targets))])
        return head(chosen).float()

    def keeps_prefixes(self, heads: list[list[int]], bodies: list[list[int]], targets: list[torch.Tensor]) -> bool:
        """Whether the prefixes' kept states serve: the teacher is the student's base, and no prefix's last token is
        what predicts a target (a soft prompt's first token, no documents between them)."""
        return self.base is None and any(heads) and all(body or not len(t) or int(t[0]) > 0
                                                        for body, t in zip(bodies, targets))

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
