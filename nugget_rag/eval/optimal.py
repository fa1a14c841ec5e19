"""The Scorer against a greedy-optimal nugget selection (paper App. A, Algorithm 1), on the LM task.

For each example, the history is encoded once with the encoder adapter and every position's keys/values kept;
any selection is then a subset of them. Starting from the Scorer's selection I, for each i in I every unchosen
i' is tried in its place (one batched decoder pass per i), and the swap that lowers the target perplexity most
is kept when it lowers it. Reported: the share of the Scorer's nuggets replaced, and the perplexity before and
after. Cost: k batched decoder passes of (n - k) rows per example, so keep the window small (the paper: 128
tokens compressed at r = 10, 64 explicit, 64 predicted).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import DECODER, ENCODER
from ..model.attention import CaptureNuggets
from ..model.scorer import select_nuggets
from ..state.nugget_state import NuggetState
from .systems.base import Env
from .tasks import load_task

TRIALS_PER_PASS = 8  # candidate selections decoded together


def _encode_all(model, ids: list[int]):
    input_ids, opening = model.encoder_input([ids])
    capture = CaptureNuggets(torch.arange(opening, opening + len(ids), device=input_ids.device)[None])
    model.run(ENCODER, capture, input_ids=input_ids)
    keys, values = capture.stacked()
    return model.to_document_positions(keys[:, 0], opening), values[:, 0], model.score(input_ids)[0, opening:]


def _nll(model, keys, values, selections: list[list[int]], tail: list[int], targets: int) -> torch.Tensor:
    """Summed target NLL for each selection (one batched decoder pass)."""
    samples = []
    for sel in selections:
        pos = torch.tensor(sorted(sel), device=keys.device)
        samples.append([NuggetState(keys[:, :, pos], values[:, :, pos], pos, torch.zeros(len(pos), device=keys.device),
                                    [""] * len(pos), keys.shape[2], model.state_tag("optimal-study"))])
    ids = torch.tensor([tail] * len(selections), device=keys.device)
    logits = model.decode(samples, ids, adapter=DECODER).logits.float()
    pred = logits[:, -targets - 1 : -1]
    gold = ids[:, -targets:]
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), gold.reshape(-1), reduction="none").view(len(selections), -1).sum(1)


@torch.inference_mode()
def run_optimal(env: Env, cfg) -> dict:
    model = env.model
    ratio = cfg.ratios[len(cfg.ratios) // 2]
    small = cfg.model_copy(update={"limit": cfg.optimal_examples, "task_limits": {}, "lm": cfg.optimal_lm})
    task = load_task("lm", small, model)
    replaced = total = 0
    nll_before = nll_after = 0.0
    tokens = 0
    for ex in tqdm(task.examples, desc="App. A greedy-optimal", disable=not cfg.progress):
        history = ex.query.document_ids[0]
        tail = ex.query.context_ids + ex.query.target_ids
        t = len(ex.query.target_ids)
        keys, values, scores = _encode_all(model, history)
        chosen = select_nuggets(scores[None], [len(history)], ratio)[0].tolist()
        start = list(chosen)
        best = float(_nll(model, keys, values, [chosen], tail, t)[0])
        first = best
        for slot in range(len(chosen)):
            options = [j for j in range(len(history)) if j not in chosen]
            if not options:
                break
            for begin in range(0, len(options), TRIALS_PER_PASS):
                part = options[begin : begin + TRIALS_PER_PASS]
                trials = [chosen[:slot] + [j] + chosen[slot + 1 :] for j in part]
                values_nll = _nll(model, keys, values, trials, tail, t)
                i = int(values_nll.argmin())
                if float(values_nll[i]) < best:
                    best, chosen = float(values_nll[i]), trials[i]
        replaced += len(set(start) - set(chosen))
        total += len(start)
        nll_before += first
        nll_after += best
        tokens += t
    return {"ratio": ratio, "examples": len(task.examples), "replaced_share": replaced / max(total, 1),
            "ppl_scorer": math.exp(nll_before / tokens), "ppl_optimal": math.exp(nll_after / tokens),
            "window": cfg.optimal_lm.model_dump()}
