"""The vLLM-compatible teacher protocol of ``kiln serve``: the base model's card and prompt scoring.

A Kiln server can be another Kiln's ``remote`` teacher. ``GET /v1/models`` lists one card,
the served base model, with Kiln's ``teacher_identity`` extension (``kiln.teachers.
teacher_identity_for``, computed once at startup). ``POST /v1/completions`` (translated by
``kiln.server._openai``) scores numeric token ids exactly as a ``local`` teacher does
(``kiln.teachers.top_k_logprobs``' functions, one forward under the generator's lock; the
base weights for the base model's id) and answers in vLLM's layout:

* ``prompt_logprobs[0]`` is null (nothing precedes the first token);
* ``prompt_logprobs[p]`` maps ``str(id)`` to ``{logprob, rank, decoded_token}`` for the top-N
  ids (ranks 1..N, descending log-probability, ties by ascending id) plus the prompt token
  ``prompt[p]`` with its true rank when it is outside the top N;
* with ``max_tokens`` 1 one greedy token is picked from the same forward's last position
  (``stop`` when it is an end-of-turn token, which is then not part of ``text``).

Refusals: ``model`` other than the served id is ``not_found`` (404); ids at or above the
vocabulary size, a prompt longer than ``max_model_len`` and ``prompt_logprobs`` above
``MAX_TOP_K`` are ``out_of_range`` (400).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import Problem
from kiln.teachers import MAX_TOP_K, ranks_of, stable_top_k

__all__ = ["TeacherProtocol"]

MAX_REPORTED = 5  # out-of-range token ids named in one refusal


@dataclass
class TeacherProtocol:
    """Scoring over the generator's model (base weights, under its lock)."""

    generator: Any  # kiln.server._generation.Generator: owns the model (whichever copy it serves) and the lock
    tokenizer: Any
    model_name: str
    identity: dict[str, Any] | None  # TeacherIdentityV1 of the served model, or None when it has none
    vocab_size: int
    max_model_len: int
    created: int
    _decoded: dict[int, str] = field(default_factory=dict)

    # --- GET /v1/models: the base model's card ---------------------------------------------

    def card(self) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kiln",
            "max_model_len": self.max_model_len,
            "parent": None,
            "root": self.model_name,
        }
        if self.identity is not None:
            card["teacher_identity"] = self.identity
        return card

    # --- POST /v1/completions: admission and scoring ------------------------------------------

    def prompt_problems(self, prompt: list[int], pointer: str) -> list[Problem]:
        """A token prompt longer than ``max_model_len`` or holding ids outside the vocabulary."""
        problems = []
        if len(prompt) > self.max_model_len:
            problems.append(
                Problem(
                    "out_of_range",
                    pointer,
                    f"the prompt is {len(prompt)} tokens; the model accepts at most {self.max_model_len}",
                )
            )
        bad = [i for i, token in enumerate(prompt) if token >= self.vocab_size]
        problems.extend(
            Problem(
                "out_of_range",
                f"{pointer}/{i}",
                f"token id {prompt[i]} is not below the vocabulary size {self.vocab_size}",
            )
            for i in bad[:MAX_REPORTED]
        )
        return problems

    @staticmethod
    def top_n_problems(top_n: int | None) -> list[Problem]:
        if top_n is not None and top_n > MAX_TOP_K:
            return [
                Problem(
                    "out_of_range", "/prompt_logprobs", f"prompt_logprobs is {top_n}; at most {MAX_TOP_K} are returned"
                )
            ]
        return []

    def _decode(self, token: int) -> str:
        text = self._decoded.get(token)
        if text is None:
            text = self._decoded[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def logprobs(self, prompt: list[int], adapter: Any = None) -> Any:
        """``[len(prompt), V]`` log-probabilities of one forward, under the generator's lock, with ``adapter``."""
        return self.generator.logprobs(prompt, adapter)

    @staticmethod
    def top(rows: Any, targets: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """Per row: the log-probability of its target token and the top ``k`` (id, log-probability)."""
        import torch

        if not targets:
            return []
        own = rows.gather(1, torch.tensor(targets, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
        if not k:
            return [(own[p], []) for p in range(len(targets))]
        ids, values = stable_top_k(rows, k)
        return [(own[p], list(zip(ids[p].tolist(), values[p].tolist(), strict=True))) for p in range(len(targets))]

    def prompt_logprobs(self, logprobs: Any, prompt: list[int], top_n: int) -> list[Any]:
        """vLLM's ``prompt_logprobs`` of ``prompt`` from its forward's log-probabilities (see the module docstring)."""
        import torch

        rows = logprobs[: len(prompt) - 1]
        top_ids, top_values = stable_top_k(rows, top_n)
        targets = torch.tensor(prompt[1:], dtype=torch.long)
        target_values = rows.gather(1, targets.unsqueeze(1)).squeeze(1).tolist() if len(targets) else []
        target_ranks = ranks_of(rows, targets).tolist() if len(targets) else []
        scored: list[Any] = [None]
        for p, (ids, values) in enumerate(zip(top_ids.tolist(), top_values.tolist(), strict=True)):
            entry = {
                str(token): {"logprob": value, "rank": rank, "decoded_token": self._decode(token)}
                for rank, (token, value) in enumerate(zip(ids, values, strict=True), start=1)
            }
            token = prompt[p + 1]
            if str(token) not in entry:
                entry[str(token)] = {
                    "logprob": target_values[p],
                    "rank": int(target_ranks[p]),
                    "decoded_token": self._decode(token),
                }
            scored.append(entry)
        return scored


def build_protocol(
    generator: Any, loaded: Any, model_name: str, base_weight_manifest: dict[str, Any]
) -> TeacherProtocol:
    """The protocol over the served model; its identity is computed here, once."""
    import logging

    from kiln.errors import KilnError
    from kiln.teachers import teacher_identity_for

    identity: dict[str, Any] | None
    try:
        identity = teacher_identity_for(
            loaded.path, served_model_id=model_name, base_weight_manifest=base_weight_manifest
        )
    except KilnError as exc:  # serving works without it; the model just cannot be registered as a teacher
        logging.getLogger("kiln.server").warning("no teacher identity for %s: %s", loaded.path, exc.message)
        identity = None
    if identity is not None:
        vocab_size, max_model_len = identity["vocab_size"], identity["max_model_len"]
    else:
        vocab_size = int(loaded.model.get_output_embeddings().weight.shape[0])
        max_model_len = int(generator._max_positions)
    return TeacherProtocol(
        generator=generator,
        tokenizer=loaded.tokenizer,
        model_name=model_name,
        identity=identity,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        created=int(time.time()),
    )
