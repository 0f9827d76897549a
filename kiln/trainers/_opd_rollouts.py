"""OPD's rollouts and teacher scores, a micro-batch of candidates at a time (``micro_batch_size``), and each
candidate's share of its optimizer step's loss.

``draw(job, model, generator, loop, candidates, scorer)`` returns one ``Rollout`` per candidate, in order. On the
``prompts`` route the student samples the candidates' rollouts from its current policy -- one candidate alone with
``kiln.model.sample``, several together with ``sample_batch`` (one left-padded, KV-cached decode; each step's tokens
drawn row by row from the one ``rollout-sampling`` generator) -- and the teacher scores the non-empty ones, several
in one ``score_batch`` call. On the ``teacher_jsonl`` route the row's response and its recorded scores are the
rollout. A batch of one is exactly the per-candidate path.

``step_weights`` and ``candidate_loss``: an optimizer step's loss is the mean of the per-position reverse KL over every
action position of its candidates, plus ECHO's λ times the mean cross-entropy over all their observation tokens;
each candidate's backward carries its share (a step with one non-empty candidate is that candidate's own loss,
exactly as before steps could hold several). ``train_shares`` runs them a micro-batch at a time: the non-empty
rollouts of a micro-batch in one right-padded student forward (``kiln.trainers._forwards.selected_logits``: the
model's own head and logit post-processing, only at the rows the loss reads) and one backward; a micro-batch with a
single non-empty rollout runs it alone and dense (``candidate_loss``), as before batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Rollout", "candidate_loss", "draw", "step_weights", "train_shares"]


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


def observed_positions(rollout: Rollout) -> list[int]:
    """Prefix positions whose token is an observation (ECHO's targets)."""
    return [p for p in range(1, len(rollout.prefix)) if rollout.observation[p]]


def step_weights(rollouts: list[Rollout], echo: bool) -> list[tuple[float, float]]:
    """Per rollout of a step, ``(KL weight, ECHO weight)``: its action positions over the step's, its observation
    tokens over the step's; ``(1, 1)`` for all when at most one rollout of the step is non-empty."""
    live = [r for r in rollouts if r.action]
    if len(live) <= 1:
        return [(1.0, 1.0)] * len(rollouts)
    actions = max(sum(len(r.action) for r in live), 1)
    counts = [len(observed_positions(r)) if echo and r.action else 0 for r in rollouts]
    observed = max(sum(counts), 1)
    return [(len(r.action) / actions, n / observed) for r, n in zip(rollouts, counts, strict=True)]


def candidate_loss(
    model: Any, rollout: Rollout, echo: dict[str, Any] | None, weights: tuple[float, float], timings: dict[str, float]
) -> tuple[Any, float, tuple[float, int] | None]:
    """A non-empty rollout's share of its step's loss (``weights`` from ``step_weights``), its mean per-position KL,
    and ``(ECHO CE, observation tokens)`` (None without ECHO or without an observation)."""
    import torch

    from kiln.model import forward_logits
    from kiln.training.opd_objective import top_k_reverse_kl

    prefix, action = rollout.prefix, rollout.action
    model.train()
    ids = torch.tensor([prefix + action], dtype=torch.long)
    t0 = time.perf_counter()
    logits = forward_logits(model, ids)
    timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
    start = len(prefix) - 1
    loss, per_position = top_k_reverse_kl(logits[start : start + len(action)], rollout.teacher_ids, rollout.teacher_lp)
    if weights[0] != 1.0:
        loss = loss * weights[0]
    mean_kl = float(per_position.detach().mean())
    observed = observed_positions(rollout)
    env = None
    if echo is not None and observed:
        positions = torch.tensor(observed, dtype=torch.long)
        term, env = _echo_share(logits[positions - 1], ids[0, positions], echo, weights[1])
        loss = loss + term
    return loss, mean_kl, env


def _echo_share(rows: Any, targets: Any, echo: dict[str, Any], weight: float) -> tuple[Any, tuple[float, int] | None]:
    """ECHO's part of a step's loss from the logits ``rows`` of a rollout's observation targets: λ times their mean
    cross-entropy, times ``weight``; and ``(CE, tokens)``."""
    import torch

    from kiln.training import grpo_objective as grpo_obj

    taken = torch.log_softmax(rows.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    term, env_ce = grpo_obj.echo_loss(taken, torch.ones_like(taken, dtype=torch.bool), float(echo["lambda"]))
    return (term if weight == 1.0 else term * weight), (None if env_ce is None else (env_ce, len(targets)))


def batch_loss(
    model: Any,
    head: Any,
    rollouts: list[Rollout],
    weights: list[tuple[float, float]],
    echo: dict[str, Any] | None,
    timings: dict[str, float],
) -> tuple[Any, list[tuple[float, tuple[float, int] | None]]]:
    """The summed shares of several non-empty rollouts from one right-padded forward, and per rollout its mean KL and
    ``(ECHO CE, observation tokens)``."""

    from kiln.trainers._forwards import selected_logits
    from kiln.training.opd_objective import top_k_reverse_kl

    wanted, observed = [], []
    for rollout in rollouts:
        p, a = len(rollout.prefix), len(rollout.action)
        rows = [False] * (p + a - 1)
        rows[p - 1 :] = [True] * a  # row q predicts token q + 1: the action rows
        seen = observed_positions(rollout) if echo is not None else []
        for position in seen:
            rows[position - 1] = True  # observations lie in the prefix, before every action row
        wanted.append(rows)
        observed.append(len(seen))
    model.train()
    t0 = time.perf_counter()
    found = selected_logits(model, head, [r.prefix + r.action for r in rollouts], wanted)
    timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
    total, out = None, []
    for rollout, (kl_weight, echo_weight), rows, targets, n in zip(
        rollouts, weights, found.split(found.rows), found.split(found.targets), observed, strict=True
    ):
        loss, per_position = top_k_reverse_kl(rows[n:], rollout.teacher_ids, rollout.teacher_lp)
        loss = loss * kl_weight
        env = None
        if n:
            term, env = _echo_share(rows[:n], targets[:n], echo, echo_weight)
            loss = loss + term
        total = loss if total is None else total + loss
        out.append((float(per_position.detach().mean()), env))
    return total, out


def train_shares(
    model: Any,
    head: Any,
    rollouts: list[Rollout],
    echo: dict[str, Any] | None,
    width: int,
    timings: dict[str, float],
    backward: Any,
) -> tuple[list[float], list[tuple[float, int] | None], list[float | None]]:
    """Forward and ``backward`` of every non-empty rollout's share of its step's loss, ``width`` rollouts (a
    micro-batch) at a time; returns what ``backward`` returned for each backward, the ECHO ``(CE, tokens)`` of each
    non-empty rollout, and each rollout's mean KL (None for an empty one)."""
    weights = step_weights(rollouts, echo is not None)
    values: list[float] = []
    envs: list[tuple[float, int] | None] = []
    kls: list[float | None] = [None] * len(rollouts)
    for start in range(0, len(rollouts), width):
        live = [i for i in range(start, min(start + width, len(rollouts))) if rollouts[i].action]
        if len(live) > 1:
            loss, found = batch_loss(
                model, head, [rollouts[i] for i in live], [weights[i] for i in live], echo, timings
            )
            values.append(backward(loss))
            for i, (kl, env) in zip(live, found, strict=True):
                kls[i] = kl
                envs.append(env)
            continue
        for i in live:
            loss, kls[i], env = candidate_loss(model, rollouts[i], echo, weights[i], timings)
            values.append(backward(loss))
            envs.append(env)
    return values, envs, kls
