"""Scored GRPO groups sampled by a behaviour policy: tasks and a request template in, groups with
``kiln.rollout-provenance.v1`` out -- what ``kiln rollout-generate`` publishes and an online GRPO step trains on.

A task (one JSON line) is an object with ``messages`` (a chat conversation) or ``prompt`` (one user message), an
optional ``id`` and any other fields its scorer reads (``answer``, ``pattern``, ``schema``...). The request template
(``RequestTemplate``) holds the sampling settings -- ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``max_tokens`` -- and optional ``messages`` put before every task's (a
system prompt); any other member is refused.

Sampling: every completion of every task decodes in one batched ``kiln.model.decode``; completion j of a task draws
with ``DrawKey(seeds[j], 0, position)`` -- the draws ``kiln serve`` makes for a request with ``seed: seeds[j]`` --
so a completion does not depend on which others decode beside it. The prompt is the tokenization a GRPO trainer
reads for the group, and each completion goes through the trainer's own group reader (``kiln.data.read_groups``):
its action tokens are what the policy sampled (``forced: false``, the sampler's log-probability) followed by what
the chat template adds after the text (the end-of-turn token's newline, or the end-of-turn itself after a
completion cut at ``max_tokens``; ``forced: true``, the log-probability one forward of the whole sequence gives).
A completion whose text does not re-tokenize to the ids it was sampled as (a non-canonical split) keeps the
re-tokenized ids; its tokens past the agreeing prefix are forced and it is counted as ``retokenized``.

With the invariant forward (``generation_backend`` names it) every recorded log-probability is what a GRPO
trainer's forward of the same weights recomputes, bit for bit: trained with ``behavior_policy: recorded``, the
importance ratios of the first step are exactly 1.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.documents.digests import base_model_content_aggregate, file_sha256, json_sha256, prefixed
from kiln.errors import RequestError
from kiln.rollouts._scorers import Scorer, ScoreRequest

__all__ = [
    "PROVENANCE_SCHEMA",
    "SUMMARY_TYPE",
    "BehaviourPolicy",
    "RequestTemplate",
    "RolloutGroup",
    "Task",
    "Timings",
    "read_request_template",
    "read_tasks",
    "sample_groups",
    "summary_of",
    "tasks_of",
]

PROVENANCE_SCHEMA = "kiln.rollout-provenance.v1"
SUMMARY_TYPE = "kiln.rollout-summary.v1"
DRAW_RULE = "kiln.counter-draws.splitmix64.v1"
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "min_tokens", "max_tokens")
DEFAULT_MAX_TOKENS = 64


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Task:
    """One task: its id, its prompt conversation (the template's messages first) and its line as given."""

    id: str
    messages: list[dict[str, Any]]
    fields: dict[str, Any]


def _message_list(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RequestError(f"{where}: messages must be a non-empty list of chat messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"{where}: message {i + 1} must be an object with a role and content")
        if not isinstance(message.get("content"), str):
            raise RequestError(f"{where}: message {i + 1} needs its content as a string")
    return [dict(m) for m in value]


def read_tasks(path: str | Path, template: RequestTemplate) -> list[Task]:
    """The tasks of a JSONL file, in order (blank lines skipped); the first bad line is refused naming it."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(f"tasks file {source}: cannot be read: {exc}") from None
    values: list[tuple[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            values.append((where, json.loads(line)))
        except ValueError as exc:
            raise RequestError(f"{where}: not JSON ({exc})", hint="write one task object per line") from None
    if not values:
        raise RequestError(f"tasks file {source} has no tasks", hint="write one task object per line")
    return _tasks(values, template)


def tasks_of(values: Sequence[Any], template: RequestTemplate) -> list[Task]:
    """Tasks given as JSON values (a request's inline ``online.tasks``), in order."""
    if not values:
        raise RequestError("online.tasks is empty: give at least one task")
    return _tasks([(f"online.tasks[{i}]", v) for i, v in enumerate(values)], template)


def _tasks(values: list[tuple[str, Any]], template: RequestTemplate) -> list[Task]:
    tasks: list[Task] = []
    seen: set[str] = set()
    for where, value in values:
        if not isinstance(value, dict):
            raise RequestError(
                f"{where}: a task must be a JSON object", hint='{"messages": [...]} or {"prompt": "..."}'
            )
        if ("messages" in value) == ("prompt" in value):
            raise RequestError(f"{where}: a task has messages or prompt (exactly one)")
        if "messages" in value:
            messages = _message_list(value["messages"], where)
        elif isinstance(value["prompt"], str) and value["prompt"]:
            messages = [{"role": "user", "content": value["prompt"]}]
        else:
            raise RequestError(f"{where}: prompt must be a non-empty string")
        task_id = value.get("id", f"task-{len(tasks) + 1}")
        if not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
            raise RequestError(f"{where}: id must be a string or an integer")
        task_id = str(task_id)
        if task_id in seen:
            raise RequestError(f"{where}: task id {task_id!r} is used twice")
        seen.add(task_id)
        tasks.append(Task(task_id, [*template.messages, *messages], value))
    return tasks


@dataclass(frozen=True)
class RequestTemplate:
    """The sampling settings every completion uses and the messages put before every task's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    max_tokens: int = DEFAULT_MAX_TOKENS
    messages: tuple[dict[str, Any], ...] = ()

    def sampling(self) -> Any:
        from kiln.model import Sampling

        return Sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            min_tokens=min(self.min_tokens, self.max_tokens),
        )

    def as_json(self) -> dict[str, Any]:
        """The sampling block of the provenance (the draw rule named)."""
        return {**{key: getattr(self, key) for key in _SAMPLING_KEYS}, "draw_rule": DRAW_RULE}


def _number(body: dict[str, Any], key: str, low: float, high: float, *, integer: bool = False) -> Any:
    value = body[key]
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or not low <= value <= high:
        span = f"an integer from {low:g}" if integer else f"a number from {low:g}"
        raise RequestError(f"request template: {key} must be {span} to {high:g}, got {value!r}")
    return value


def read_request_template(value: dict[str, Any] | None) -> RequestTemplate:
    """The template of a parsed request-template object (None: sampling at temperature 1, 64 tokens)."""
    if value is None:
        return RequestTemplate()
    if not isinstance(value, dict):
        raise RequestError("request template: must be a JSON object")
    unknown = sorted(set(value) - {*_SAMPLING_KEYS, "messages"})
    if unknown:
        raise RequestError(
            f"request template: unknown field {unknown[0]!r}",
            hint=f"a request template holds {', '.join(_SAMPLING_KEYS)} and messages",
        )
    found: dict[str, Any] = {}
    limits = {
        "temperature": (0.0, 100.0, False),
        "top_p": (0.0, 1.0, False),
        "top_k": (0, 2**31 - 1, True),
        "min_p": (0.0, 1.0, False),
        "repetition_penalty": (1e-6, 100.0, False),
        "min_tokens": (0, 2**31 - 1, True),
        "max_tokens": (1, 2**31 - 1, True),
    }
    for key, (low, high, integer) in limits.items():
        if key in value:
            found[key] = _number(value, key, low, high, integer=integer)
    if "top_p" in found and found["top_p"] <= 0:
        raise RequestError("request template: top_p must be above 0")
    if "messages" in value:
        found["messages"] = tuple(_message_list(value["messages"], "request template"))
    return RequestTemplate(**found)


# ----------------------------------------------------------------------------- the behaviour policy


@dataclass
class BehaviourPolicy:
    """The model that samples (its LoRA attached, or the base alone), its tokenizer, and its recorded identity."""

    model: Any
    tokenizer: Any
    identity: dict[str, Any]
    max_len: int
    stop_ids: frozenset[int]

    @classmethod
    def of(cls, model: Any, tokenizer: Any, identity: dict[str, Any]) -> BehaviourPolicy:
        from kiln.model import max_positions, special_tokens, stop_token_ids

        return cls(
            model,
            tokenizer,
            identity,
            max_positions(model.config, tokenizer),
            stop_token_ids(model, tokenizer, special_tokens(tokenizer)),
        )

    @classmethod
    def load(
        cls,
        model: tuple[Path, bool],
        *,
        adapter: str | None,
        registry: Path,
        precision: str = "auto",
        device: str = "cpu",
    ) -> BehaviourPolicy:
        """The base model (``kiln.model.resolve_model_path``'s path and whether it is the default) with the registry adapter ``adapter`` (None: the base alone) attached
        the way a GRPO run warm-started from it attaches it (peft LoRA, its verified tensors copied in)."""
        from kiln.model import load_weights, open_base_model, resolve_device, resolve_precision

        model_path, is_default = model
        opened = open_base_model(model_path, is_default=is_default)
        chosen = resolve_precision(precision, opened)
        loaded = load_weights(opened, precision=chosen, device=resolve_device(device, pointer=None))
        identity = cls.model_identity(model_path, loaded.tokenizer, chosen)
        sampler = loaded.model
        if adapter is not None:
            sampler, adapter_identity = _attach(sampler, registry, adapter)
            identity.update(adapter_identity)
        else:
            identity.update({"adapter": None})
        return cls.of(sampler, loaded.tokenizer, identity)

    @staticmethod
    def model_identity(path: Path, tokenizer: Any, precision: str) -> dict[str, Any]:
        """What names a base model's weights, tokenizer and chat template (file digests)."""

        def digest(name: str) -> str | None:
            file = path / name
            return prefixed(file_sha256(file)[0]) if file.is_file() else None

        shards = sorted(path.glob("*.safetensors"))
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        return {
            "model": path.name,
            "model_config_sha256": digest("config.json"),
            "base_weights_sha256": base_model_content_aggregate(file_sha256(p) for p in shards) if shards else None,
            "tokenizer_vocab_sha256": digest("tokenizer.json"),
            "tokenizer_config_sha256": digest("tokenizer_config.json"),
            "chat_template_sha256": prefixed(hashlib.sha256(template.encode()).hexdigest()),
            "precision": precision,
        }


def _attach(model: Any, registry: Path, name: str) -> tuple[Any, dict[str, Any]]:
    """``model`` with the registry adapter ``name``: read and verified once (``AdapterDirectory.read``), attached
    with peft as a GRPO warm start attaches it, its tensors copied from the bytes that were verified."""
    import torch
    from safetensors.torch import load as load_tensors

    from kiln.adapters import CONFIG_FILE, adapter_directory
    from kiln.training import attach_lora, lora_parameters

    files = adapter_directory(registry, name).read()
    config = files.config
    options = sorted(
        config.enabled
        & {
            "use_dora",
            "use_rslora",
            "lora_bias",
            "modules_to_save",
            "alpha_pattern",
            "trainable_token_indices",
            "layer_replication",
            "target_parameters",
        }
    )
    if config.rank_pattern or isinstance(config.target_modules, str) or options:
        raise RequestError(
            f"adapter {name!r}: its {CONFIG_FILE} uses settings rollout generation does not attach "
            "(rank_pattern, a target_modules pattern or all-linear, or another peft option)",
            hint="generate with an adapter Kiln trained, or with --adapter base",
        )
    peft = attach_lora(model, rank=config.rank, alpha=config.alpha, seed=0, targets=list(config.target_modules))
    saved = load_tensors(files.weights_bytes)
    params = lora_parameters(peft)
    with torch.no_grad():
        for param_name, param in params.items():
            key = param_name.replace(".default.", ".")
            if key not in saved or tuple(saved[key].shape) != tuple(param.shape):
                raise RequestError(f"adapter {name!r} has no tensor {key} of shape {tuple(param.shape)}")
            param.copy_(saved[key].to(param.dtype))
    if len(saved) != len(params):
        raise RequestError(f"adapter {name!r} holds {len(saved)} tensors; its config attaches {len(params)}")
    return peft, {
        "adapter": name,
        "adapter_weights_sha256": files.weights_sha256,
        "adapter_content_revision": files.content_revision,
    }


# ----------------------------------------------------------------------------- sampling and scoring


@dataclass
class RolloutGroup:
    """One task's scored group: the JSON group a GRPO trainer reads (``value``) and what it adds up to."""

    task_id: str
    value: dict[str, Any]
    rewards: list[float]
    sampled_tokens: int
    forced_tokens: int
    retokenized: int
    completion_tokens: int


@dataclass
class Timings:
    """Milliseconds spent decoding and scoring (added to across calls)."""

    generation_ms: float = 0.0
    scoring_ms: float = 0.0


def _prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    from kiln.data.trajectory import TrajectoryTokenizer

    ids, _ = TrajectoryTokenizer(tokenizer, True).prefix(messages, [])
    return list(ids)


def sample_groups(
    policy: BehaviourPolicy,
    tasks: Sequence[Task],
    seeds: Sequence[int],
    template: RequestTemplate,
    scorer: Scorer,
    *,
    timings: Timings | None = None,
    sequence_of: Sequence[int] | None = None,
) -> list[RolloutGroup]:
    """One scored group per task, ``len(seeds)`` completions each (see the module docstring). ``sequence_of``:
    each task's draw-sequence index (0 for all by default: the served request's draws)."""
    from kiln.model import decode, generation_backend

    timings = timings if timings is not None else Timings()
    model, tokenizer = policy.model, policy.tokenizer
    prompts = [_prompt_ids(tokenizer, task.messages) for task in tasks]
    for task, prompt in zip(tasks, prompts, strict=True):
        if len(prompt) >= policy.max_len:
            raise RequestError(
                f"task {task.id!r}: its prompt is {len(prompt)} tokens, the model's context is {policy.max_len}"
            )
    rows = [(t, j) for t in range(len(tasks)) for j in range(len(seeds))]
    t0 = time.perf_counter()
    model.eval()
    decoded = decode(
        model,
        [prompts[t] for t, _ in rows],
        max_new=[min(template.max_tokens, policy.max_len - len(prompts[t])) for t, _ in rows],
        sampling=template.sampling(),
        seed=[seeds[j] for _, j in rows],
        sequences=[sequence_of[t] if sequence_of is not None else 0 for t, _ in rows],
        stop_ids=policy.stop_ids,
        logprobs=True,
    )
    timings.generation_ms += (time.perf_counter() - t0) * 1000
    backend = generation_backend(model)
    identity = {
        "behavior_policy": policy.identity,
        "tokenizer": {k: policy.identity.get(k) for k in ("tokenizer_vocab_sha256", "tokenizer_config_sha256")},
        "template_invocation": {
            "chat_template_sha256": policy.identity.get("chat_template_sha256"),
            "add_generation_prompt": True,
        },
        "sampling": template.as_json(),
        "generation_backend": backend,
        "scorer": scorer.identity,
    }
    out: list[RolloutGroup] = []
    for t, task in enumerate(tasks):
        found = [decoded[t * len(seeds) + j] for j in range(len(seeds))]
        texts, contents = [], []
        for d in found:
            content = d.ids[:-1] if d.ids and not d.truncated and d.ids[-1] in policy.stop_ids else list(d.ids)
            contents.append(content)
            texts.append(tokenizer.decode(content, skip_special_tokens=False))
        t1 = time.perf_counter()
        scored = scorer.score(
            [
                ScoreRequest(task.fields, task.id, task.messages, text, tuple(content))
                for text, content in zip(texts, contents, strict=True)
            ]
        )
        timings.scoring_ms += (time.perf_counter() - t1) * 1000
        out.append(_group(policy, task, prompts[t], seeds, found, texts, contents, scored, identity))
    return out


CLOSING_SEARCH = 16  # how many trailing tokens a chat template's end of turn may take


def _closing(tokenizer: Any, text: str, action: Sequence[int]) -> list[int] | None:
    """The ids the chat template puts after ``text`` in the action block ``action`` (the text's own tokenization):
    its shortest tail after a head that spells ``text``; None when no head does."""
    from kiln.data import spelled

    for k in range(len(action), max(-1, len(action) - CLOSING_SEARCH - 1), -1):
        if spelled(tokenizer, action[:k]) == text:
            return list(action[k:])
    return None


def _group(
    policy: BehaviourPolicy,
    task: Task,
    prompt: list[int],
    seeds: Sequence[int],
    found: list[Any],
    texts: list[str],
    contents: list[list[int]],
    scored: list[Any],
    identity: dict[str, Any],
) -> RolloutGroup:
    """The group of one task: each completion's action block is its sampled ids and the chat template's closing
    ids (forced), every one with its behaviour log-probability; read back by the trainer's own reader, which must
    train exactly those ids."""
    import torch

    from kiln.data import read_groups
    from kiln.model import batch_logprobs

    tokenizer = policy.tokenizer
    completions = [
        {"text": text, "reward": s.reward, **({"scorer": s.details} if s.details else {})}
        for text, s in zip(texts, scored, strict=True)
    ]
    value: dict[str, Any] = {"messages": task.messages, "task_id": task.id, "completions": completions}
    plain = read_groups(tokenizer=tokenizer, groups=[value]).groups[0]  # the text's own tokenization
    if list(plain.completions[0].input_ids[: plain.prompt_tokens]) != prompt:
        raise RequestError(
            f"task {task.id!r}: the chat template tokenizes the prompt differently alone and before a completion",
            hint="use a chat template whose generation prompt is a prefix of the rendered conversation",
        )
    actions: list[tuple[list[int], int, bool]] = []  # (action ids, how many were sampled, re-tokenized)
    for c, d, text, content in zip(plain.completions, found, texts, contents, strict=True):
        own = [c.input_ids[t + 1] for t, active in enumerate(c.action_mask) if active]
        closing = _closing(tokenizer, text, own)
        ids = own if closing is None else [*content, *closing]
        agree = 0
        while agree < min(len(ids), len(d.ids)) and ids[agree] == d.ids[agree]:
            agree += 1
        actions.append((ids, agree, closing is None or own != ids))
    sequences = [prompt + ids for ids, _, _ in actions]
    with torch.inference_mode():
        rows = batch_logprobs(policy.model, sequences)  # the forced tokens' log-probabilities, one forward
    sampled = forced = retokenized = tokens = 0
    for j, (completion, d, (ids, agree, re_tokenized), logp) in enumerate(
        zip(completions, found, actions, rows, strict=True)
    ):
        at = torch.arange(len(prompt) - 1 + agree, len(prompt) - 1 + len(ids), device=logp.device)
        want = torch.tensor(ids[agree:], dtype=torch.long, device=logp.device)
        forced_lp = logp.index_select(0, at).gather(1, want.unsqueeze(1)).squeeze(1).double().tolist()
        completion["provenance"] = {
            "schema": PROVENANCE_SCHEMA,
            **identity,
            "seed": seeds[j],
            "truncated": d.truncated,
            "retokenized": re_tokenized,
            "action_tokens": [
                {"token_id": tok, "behavior_logprob": lp, "forced": k >= agree}
                for k, (tok, lp) in enumerate(zip(ids, list(d.logprobs[:agree]) + forced_lp, strict=True))
            ],
        }
        sampled += agree
        forced += len(ids) - agree
        retokenized += int(re_tokenized)
        tokens += len(d.ids)
    trained = read_groups(tokenizer=tokenizer, groups=[value], behavior_policy="recorded").groups[0]
    for c, (ids, _, _) in zip(trained.completions, actions, strict=True):
        if list(c.input_ids) != prompt + ids:  # the reader trains other ids than those recorded: a Kiln bug
            raise RuntimeError(f"task {task.id!r}: the GRPO reader does not read back the sampled token ids")
    return RolloutGroup(task.id, value, [s.reward for s in scored], sampled, forced, retokenized, tokens)


def summary_of(groups: Sequence[RolloutGroup], *, timings: Timings, extra: dict[str, Any]) -> dict[str, Any]:
    """The run's summary: counts, the reward distribution, token counts, time shares and the inputs' identity."""
    rewards = [r for g in groups for r in g.rewards]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    spread = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else 0.0
    return {
        "schema": SUMMARY_TYPE,
        "groups": len(groups),
        "completions": len(rewards),
        "reward": {
            "mean": mean,
            "std": spread,
            "min": min(rewards) if rewards else None,
            "max": max(rewards) if rewards else None,
        },
        "groups_with_equal_rewards": sum(1 for g in groups if len(set(g.rewards)) <= 1),
        "completion_tokens": sum(g.completion_tokens for g in groups),
        "sampled_action_tokens": sum(g.sampled_tokens for g in groups),
        "forced_action_tokens": sum(g.forced_tokens for g in groups),
        "retokenized_completions": sum(g.retokenized for g in groups),
        "generation_ms": round(timings.generation_ms, 3),
        "scoring_ms": round(timings.scoring_ms, 3),
        "groups_sha256": json_sha256([g.value for g in groups]),
        **extra,
    }
