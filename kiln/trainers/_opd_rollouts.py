"""OPD's rollouts and teacher scores, a batch of candidates at a time (``micro_batch_size``).

``draw(job, model, generator, loop, candidates, scorer)`` returns one ``Rollout`` per candidate, in order. On the
``prompts`` route the student samples the candidates' rollouts from its current policy -- one candidate alone with
``kiln.model.sample``, several together with ``sample_batch`` (one left-padded, KV-cached decode; each step's tokens
drawn row by row from the one ``rollout-sampling`` generator) -- and the teacher scores the non-empty ones, several
in one ``score_batch`` call. On the ``teacher_jsonl`` route the row's response and its recorded scores are the
rollout. A batch of one is exactly the per-candidate path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Rollout", "draw"]


@dataclass
class Rollout:
    prefix: list[int]
    action: list[int]
    truncated: bool
    observation: list[bool]
    teacher_ids: Any = None  # LongTensor [A, K] (None for an empty rollout)
    teacher_lp: Any = None  # FloatTensor [A, K]


def draw(job: Any, model: Any, generator: Any, loop: Any, candidates: list[int], scorer: Any) -> list[Rollout]:
    """The rollouts of ``candidates`` (indices into ``job.candidates``), scored by the teacher."""
    import torch

    from kiln.model import sample_batch

    cfg = job.config
    if job.route != "prompts":
        out = []
        for index in candidates:
            row = job.source.rows[job.candidates[index][0]]
            rollout = Rollout(list(row.student_prefix), list(row.action_ids), False, [False] * len(row.student_prefix))
            if rollout.action:
                k = cfg["top_k"]
                rollout.teacher_ids = torch.tensor([list(ids[:k]) for ids in row.teacher_ids], dtype=torch.long)
                rollout.teacher_lp = torch.tensor([list(lp[:k]) for lp in row.teacher_logprobs], dtype=torch.float32)
            out.append(rollout)
        return out
    items = [job.source.items[job.candidates[index][0]] for index in candidates]
    prefixes = [list(item.student_prefix) for item in items]
    t0 = time.perf_counter()
    model.eval()
    sampled = sample_batch(
        model,
        prefixes,
        max_new=[min(cfg["max_tokens"], job.max_len - len(prefix)) for prefix in prefixes],
        temperature=cfg["temperature"],
        top_p=cfg["top_p"],
        generator=generator,
        stop_ids=job.stop_ids,
    )
    loop.rollouts_sampled += len(candidates)
    loop.timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
    out = [
        Rollout(prefix, action, truncated, list(item.observation_mask))
        for prefix, (action, truncated), item in zip(prefixes, sampled, items, strict=True)
    ]
    scored = [(r, item) for r, item in zip(out, items, strict=True) if r.action]
    if scored:
        t1 = time.perf_counter()
        pairs = [(list(item.teacher_prefix), r.action) for r, item in scored]
        for (rollout, _), (ids, lp) in zip(scored, scorer.score_batch(pairs, cfg["top_k"]), strict=True):
            rollout.teacher_ids, rollout.teacher_lp = ids, lp
        loop.timings["reference_forward_ms"] += (time.perf_counter() - t1) * 1000
    return out
