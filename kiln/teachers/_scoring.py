"""Teacher scores: top-K log-probabilities at every action position, locally or over HTTP.

``top_k_logprobs(model, ids, start, k)`` is the one definition of a score: one no-grad
float32 forward of ``ids``, ``log_softmax`` over the vocabulary, and for every position p in
``[start, len(ids))`` the distribution that predicts ``ids[p]`` (the logits at p - 1), its
top-K ids in a stable descending order (ties: lower id first). ``kiln serve`` answers
``POST /v1/completions`` with the same function, so a ``LocalScorer`` and a ``RemoteScorer``
pointed at a Kiln server over the same model directory return bit-identical tensors.

A scorer has ``max_top_k``, ``score(prefix_ids, action_ids, k) -> (ids LongTensor[A, k],
logprobs FloatTensor[A, k])`` (A = ``len(action_ids)``), ``score_batch(pairs, k)`` (the same for several
``(prefix_ids, action_ids)`` pairs: a local teacher runs them in one right-padded forward, equal to one forward
each, bit for bit, with the invariant forward; the remote protocol's ``prompt`` is one token array, so a remote teacher sends one request
per pair) and ``close()``. ``fixture`` teachers
have no scorer: their scores are the rows of the pre-scored file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from kiln import contracts
from kiln.adapters import CONFIG_FILE, WEIGHTS_FILE
from kiln.documents.jsonio import parse_json
from kiln.errors import ConflictError, InternalError, KilnError, RequestError
from kiln.teachers._identity import adapter_identity, auth_headers, base_url

__all__ = [
    "LocalScorer",
    "RemoteScorer",
    "TeacherScorer",
    "log_probabilities",
    "open_scorer",
    "ranks_of",
    "stable_top_k",
    "top_k_logprobs",
]

SCORE_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 10.0


class TeacherScorer(Protocol):
    max_top_k: int

    def score(self, prefix_ids: list[int], action_ids: list[int], k: int) -> tuple[Any, Any]: ...

    def score_batch(self, pairs: list[tuple[list[int], list[int]]], k: int) -> list[tuple[Any, Any]]: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- the pure functions


def log_probabilities(model: Any, ids: list[int]) -> Any:
    """``[len(ids), V]`` float32 log-probabilities; row r is the distribution of the token after ``ids[r]``.

    One forward of the whole sequence under ``torch.no_grad`` (never inference mode: the result may enter a loss
    as a constant): ``kiln.model.sequence_logprobs``, the invariant forward's log-softmax of the model's logits
    (after its soft-cap or scaling) -- so the same bits as a batch of sequences scored together, and as a server
    decoding or scoring the same model -- or the model's own forward where it has no invariant one.
    """
    import torch

    from kiln.model import sequence_logprobs

    with torch.no_grad():
        return sequence_logprobs(model, list(ids)).cpu()


def stable_top_k(rows: Any, k: int) -> tuple[Any, Any]:
    """Top-``k`` (ids, log-probabilities) of each row: descending, ties by ascending id.

    Exactly the first ``k`` of a stable descending sort of the row, without sorting the
    vocabulary: ``topk`` finds each row's k-th largest value, and only the ids at or above it
    (the top k plus any ties at the boundary, already in ascending id order) are stably sorted.
    """
    import torch

    if rows.shape[0] == 0 or k == 0:
        return torch.empty((rows.shape[0], k), dtype=torch.long), torch.empty((rows.shape[0], k), dtype=rows.dtype)
    threshold = torch.topk(rows, k, dim=-1).values[:, -1:]
    ids, values = [], []
    for row, floor in zip(rows, threshold, strict=True):
        candidates = torch.nonzero(row >= floor, as_tuple=True)[0]
        scores = row[candidates]
        order = torch.sort(scores, descending=True, stable=True).indices[:k]
        ids.append(candidates[order])
        values.append(scores[order])
    return torch.stack(ids).contiguous(), torch.stack(values).contiguous()


def ranks_of(rows: Any, targets: Any) -> Any:
    """1-based rank of ``targets[i]`` in row i under the same order as ``stable_top_k``."""
    import torch

    value = rows.gather(1, targets.unsqueeze(1))
    ids = torch.arange(rows.shape[1]).unsqueeze(0)
    ahead = (rows > value) | ((rows == value) & (ids < targets.unsqueeze(1)))
    return ahead.sum(dim=1) + 1


def top_k_logprobs(model: Any, ids: list[int], start: int, k: int) -> tuple[Any, Any]:
    """(ids LongTensor[A, k], logprobs FloatTensor[A, k]) for positions ``start .. len(ids) - 1``."""
    if not 1 <= start <= len(ids):
        raise ValueError(f"start must be in [1, {len(ids)}]: position 0 has nothing before it; got {start}")
    rows = log_probabilities(model, ids)[: len(ids) - 1]  # the same tensor the server slices
    return stable_top_k(rows[start - 1 :], k)


# ----------------------------------------------------------------------------- scorers


def _check_request(prefix_ids: list[int], action_ids: list[int], k: int, max_top_k: int, limit: int) -> None:
    if not prefix_ids:
        raise RequestError(
            "a teacher scores each action token from what precedes it: prefix_ids must not be empty",
            code="training_invalid_request",
        )
    if not 1 <= k <= max_top_k:
        raise RequestError(f"top-K {k} is outside [1, {max_top_k}] for this teacher", code="training_invalid_request")
    if len(prefix_ids) + len(action_ids) > limit:
        raise RequestError(
            f"the sequence is {len(prefix_ids) + len(action_ids)} tokens; the teacher accepts at most {limit}",
            code="training_invalid_request",
        )


class LocalScorer:
    """A ``local`` teacher loaded in this process (float32, on the student's device), with its pinned adapter when
    it has one; its scores come back on the host."""

    def __init__(self, pinned: Any, *, registry_dir: Path, device: str = "cpu"):
        from kiln.model import load_base_model

        identity = pinned.identity
        self.alias = pinned.alias
        self.max_top_k = min(identity["max_top_k"], identity["max_prompt_logprob_candidates"])
        self.vocab_size = identity["vocab_size"]
        self.max_model_len = identity["max_model_len"]
        loaded = load_base_model(Path(pinned.model_id), device=device)
        model = loaded.model
        if pinned.adapter is not None:
            directory = Path(registry_dir) / pinned.adapter
            found = adapter_identity(directory)
            if found != identity["adapter"]:
                raise ConflictError(
                    f"teacher {pinned.alias!r}: adapter {directory} no longer matches the pinned identity "
                    f"({WEIGHTS_FILE} / {CONFIG_FILE} digests or name changed)",
                    code="teacher_identity_mismatch",
                )
            import warnings

            from peft import PeftModel

            with warnings.catch_warnings():  # peft 0.21 asks transformers 5 for a renamed attribute
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                model = PeftModel.from_pretrained(model, str(directory), is_trainable=False)
            model.eval()
        self._model = model

    def score(self, prefix_ids: list[int], action_ids: list[int], k: int) -> tuple[Any, Any]:
        ids = self._checked(prefix_ids, action_ids, k)
        return top_k_logprobs(self._model, ids, len(prefix_ids), k)

    def _checked(self, prefix_ids: list[int], action_ids: list[int], k: int) -> list[int]:
        """The sequence to score, after the request checks and the vocabulary bound."""
        if self._model is None:
            raise InternalError(f"the scorer of teacher {self.alias!r} is closed")
        _check_request(prefix_ids, action_ids, k, min(self.max_top_k, self.vocab_size), self.max_model_len)
        ids = [*prefix_ids, *action_ids]
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise RequestError(
                f"token ids must be in [0, {self.vocab_size}) for teacher {self.alias!r}",
                code="training_invalid_request",
            )
        return ids

    def score_batch(self, pairs: list[tuple[list[int], list[int]]], k: int) -> list[tuple[Any, Any]]:
        """``score`` of every pair, from one right-padded no-grad forward (``kiln.model.batch_logprobs``: with the
        invariant forward, each pair's exact ``score``; one pair: ``score`` itself)."""
        import torch

        from kiln.model import batch_logprobs

        if len(pairs) == 1:
            return [self.score(*pairs[0], k)]
        sequences = [self._checked(prefix_ids, action_ids, k) for prefix_ids, action_ids in pairs]
        with torch.no_grad():
            found = batch_logprobs(self._model, sequences)
        return [
            stable_top_k(logp.cpu()[len(prefix_ids) - 1 : len(seq) - 1], k)
            for (prefix_ids, _), seq, logp in zip(pairs, sequences, found, strict=True)
        ]

    def close(self) -> None:
        self._model = None


class RemoteScorer:
    """A ``remote`` teacher: ``POST {url}/v1/completions`` with ``prompt_logprobs`` (the vLLM protocol)."""

    def __init__(self, pinned: Any, *, timeout: float = SCORE_TIMEOUT_S):
        import httpx

        identity = pinned.identity
        self.alias = pinned.alias
        self.model_id = pinned.model_id
        self.endpoint = base_url(pinned.url) + "/v1/completions"
        self.max_top_k = min(identity["max_top_k"], identity["max_prompt_logprob_candidates"])
        self.vocab_size = identity["vocab_size"]
        self.max_model_len = identity["max_model_len"]
        self._client: Any = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S), headers=auth_headers(pinned.credential_id)
        )

    def _post(self, body: dict[str, Any]) -> Any:
        import httpx

        for attempt in (1, 2):
            try:
                return self._client.post(self.endpoint, json=body)
            except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                if attempt == 2:
                    raise InternalError(
                        f"teacher {self.alias!r}: POST {self.endpoint} failed twice: {type(exc).__name__}: {exc}"
                    ) from None
            except httpx.HTTPError as exc:
                raise InternalError(
                    f"teacher {self.alias!r}: POST {self.endpoint} failed: {type(exc).__name__}: {exc}"
                ) from None
        raise AssertionError("unreachable")

    def score(self, prefix_ids: list[int], action_ids: list[int], k: int) -> tuple[Any, Any]:
        import torch

        if self._client is None:
            raise InternalError(f"the scorer of teacher {self.alias!r} is closed")
        _check_request(prefix_ids, action_ids, k, min(self.max_top_k, self.vocab_size), self.max_model_len)
        ids = [*prefix_ids, *action_ids]
        answer = self._post({"model": self.model_id, "prompt": ids, "max_tokens": 1, "prompt_logprobs": k})
        where = f"teacher {self.alias!r}: POST {self.endpoint}"
        if answer.status_code != 200:
            raise InternalError(f"{where} answered HTTP {answer.status_code}: {answer.text[:500]}")
        try:
            doc = parse_json(answer.content, source=self.endpoint)
        except KilnError as exc:
            raise InternalError(f"{where} did not answer strict JSON: {exc.message}") from None
        problems = contracts.problems("CompletionResponse", doc)
        if problems:
            raise InternalError(f"{where} answered an invalid CompletionResponse: {problems[0]}")
        scores = doc["choices"][0]["prompt_logprobs"]
        if scores is None or len(scores) != len(ids):
            raise InternalError(f"{where}: expected prompt_logprobs for {len(ids)} positions")
        top_ids: list[list[int]] = []
        top_values: list[list[float]] = []
        for p in range(len(prefix_ids), len(ids)):
            picked = sorted((e["rank"], int(t), e["logprob"]) for t, e in scores[p].items() if e["rank"] <= k)
            if [rank for rank, _, _ in picked] != list(range(1, k + 1)):
                raise InternalError(f"{where}: position {p} does not carry exactly the ranks 1..{k}")
            top_ids.append([t for _, t, _ in picked])
            top_values.append([v for _, _, v in picked])
        if not top_ids:
            return torch.empty((0, k), dtype=torch.long), torch.empty((0, k), dtype=torch.float32)
        return torch.tensor(top_ids, dtype=torch.long), torch.tensor(top_values, dtype=torch.float32)

    def score_batch(self, pairs: list[tuple[list[int], list[int]]], k: int) -> list[tuple[Any, Any]]:
        """One request per pair: the completions protocol scores one token array per request."""
        return [self.score(prefix_ids, action_ids, k) for prefix_ids, action_ids in pairs]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def open_scorer(pinned: Any, *, registry_dir: Path, device: str = "cpu") -> TeacherScorer:
    """The scorer of a pinned teacher; ``registry_dir`` is the adapter registry a ``local`` teacher's adapter is in."""
    if pinned.kind == "local":
        return LocalScorer(pinned, registry_dir=registry_dir, device=device)
    if pinned.kind == "remote":
        return RemoteScorer(pinned)
    raise RequestError(
        f"teacher {pinned.alias!r} is a {pinned.kind} teacher: its scores come from its pre-scored file, "
        "there is no model to score with",
        code="training_invalid_request",
        hint="read the teacher_tokens of the off-policy rows instead of opening a scorer",
    )
