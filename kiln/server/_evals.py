"""Evaluation on the server: suites, evaluation jobs and the post-training gate.

Suites live in ``<home>/eval-suites`` (``kiln.evals.SuiteRegistry``; content-addressed,
immutable by name). An evaluation job (``POST /v1/eval/jobs``) is a ``Job`` of type
``eval`` in the same FIFO queue as training, run by the same worker: it generates greedily
with the suite's pinned settings through the serving ``Generator`` (the base model, or an
adapter applied per request — evaluation never changes what the server serves) and stores
a ``kiln.eval-result.v1`` result.

The gate (``post_eval`` on a training request) is checked before queueing: the suite must
exist, and a ``held_out`` suite must share no prompt digest with the training data. After a
successful run the worker evaluates the baseline (the adapter that was active when the job
started, else the base model) and the candidate on the same suite — two linked ``eval``
jobs — and applies ``paired_wilson_v1`` (``kiln.evals.gate_verdict``): ``promoted``
activates the candidate (after its serving canary), ``kept`` leaves it inactive because
``auto_load`` is false, ``demoted`` renames it ``<name>.failed`` (``kiln.adapters.demote``:
crash-safe, ``<name>.failed-<n>`` when taken), ``regression``, ``inconclusive`` and ``error``
leave it trained but inactive. The previous adapter stays active in every case but
``promoted``; the training job itself is ``completed`` either way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln import contracts
from kiln.adapters import adapter_directory, demote
from kiln.artifacts.evals import canonical_data_scope
from kiln.errors import ConflictError, ContractError, RequestError

if TYPE_CHECKING:
    from kiln.evals import SuiteRegistry
    from kiln.host.config import Settings

log = logging.getLogger("kiln.server.evals")

POST_EVAL_DEFAULTS = {"data_scope": "held_out", "min_accuracy": None, "include_baseline": True}


def registry(settings: Settings) -> SuiteRegistry:
    from kiln.evals import SuiteRegistry, suites_root

    return SuiteRegistry(suites_root(settings.home))


def _checked(definition: str, body: Any) -> Any:
    """``body`` with canonical numbers, after its schema and rules; every problem raises together."""
    found = contracts.problems(definition, body)
    if found:
        raise ContractError(found, document=definition)
    return contracts.canonical(definition, body)


# ----------------------------------------------------------------------------- admission


def check_post_eval(engine: Any, kind: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The gate of a training request, defaults filled, and its suite's digest (None, None without one)."""
    from kiln.evals import overlapping_examples, training_prompt_digests

    post = body.get("post_eval")
    if post is None:
        return None, None
    post = _checked("PostEval", {**POST_EVAL_DEFAULTS, **post})
    post["data_scope"] = canonical_data_scope(post["data_scope"])  # the reference's `held-out` is `held_out`
    suite, entry = registry(engine.settings).get(post["suite"])  # eval_suite_not_found
    if post["data_scope"] == "held_out":
        overlap = overlapping_examples(suite, training_prompt_digests(kind, body))
        if overlap:
            shown = ", ".join(repr(i) for i in overlap[:5]) + (
                f" and {len(overlap) - 5} more" if len(overlap) > 5 else ""
            )
            raise RequestError(
                f"post_eval suite {post['suite']!r} is not held out: example(s) {shown} share their prompt with "
                "the training data",
                code="training_invalid_request",
                pointer="/post_eval/suite",
                hint='remove those examples from the suite, or use "data_scope": "train_set_eval" (diagnostic only)',
            )
    return post, entry["suite_sha256"]


# ----------------------------------------------------------------------------- targets and generation


def target(engine: Any, adapter: str | None) -> dict[str, Any]:
    """``EvalTarget`` of the base model or a registry adapter (named by the registry rule; its manifest must
    exist)."""
    if adapter is None:
        return {
            "kind": "base",
            "adapter": None,
            "adapter_manifest_sha256": None,
            "base_model_sha256": engine.base_sha256,
        }
    return {
        "kind": "adapter",
        "adapter": adapter,
        "adapter_manifest_sha256": adapter_directory(engine.registry, adapter).manifest_sha256(),
        "base_model_sha256": engine.base_sha256,
    }


def _generate(engine: Any, adapter: str | None) -> Callable[[list[dict[str, str]], dict[str, Any]], str]:
    """Greedy answers with the suite's pinned settings, from the serving generator (``Generator.answer``)."""

    def generate(messages: list[dict[str, str]], generation: dict[str, Any]) -> str:
        return str(
            engine.generator.answer(
                messages, max_tokens=generation["max_tokens"], seed=generation["seed"], adapter=adapter
            )
        )

    return generate


def evaluate(engine: Any, suite_name: str, adapter: str | None, cancel: threading.Event | None = None) -> dict:
    """Run a registered suite against the base model or an adapter; the ``EvalResult``."""
    from kiln.evals import run_suite

    suite, entry = registry(engine.settings).get(suite_name)
    return run_suite(suite, entry, _generate(engine, adapter), target=target(engine, adapter), cancel=cancel)


# ----------------------------------------------------------------------------- evaluation jobs


def submit(server: Any, body: Any) -> dict[str, Any]:
    """``POST /v1/eval/jobs``: check the suite and the adapter now, then queue."""
    body = _checked("EvalRunRequest", body)
    _, entry = registry(server.settings).get(body["suite"])
    adapter = body.get("adapter")
    target(server.engine, adapter)  # adapter_not_found before queueing
    job = server.jobs.submit(
        job_type="eval",
        adapter_name=adapter or "",
        effective_seed="0",
        request={"suite": body["suite"], **({"adapter": adapter} if adapter else {})},
        fingerprint={"suite_sha256": entry["suite_sha256"]},
        auto_load=False,
        total_steps=entry["example_count"],
        role="standalone",
    )
    return {
        "job_id": job.job_id,
        "state": "queued",
        "message": f"evaluation of {adapter or 'the base model'} on suite {body['suite']!r} queued at position "
        f"{len(server.jobs.queue)} ({entry['example_count']} examples)",
    }


def run_job(engine: Any, job: Any, cancel: threading.Event) -> Any:
    """The worker's side of an evaluation job."""
    from kiln.evals import EvalCancelled
    from kiln.server._jobs import Outcome

    try:
        _, entry = registry(engine.settings).get(job.request["suite"])
        if entry["suite_sha256"] != job.fingerprint["suite_sha256"]:
            return Outcome("failed", f"revalidation_failed: suite {job.request['suite']!r} changed since submission")
        job.result = evaluate(engine, job.request["suite"], job.request.get("adapter"), cancel)
    except EvalCancelled:
        return Outcome("failed", "cancelled: stopped between examples")
    except Exception as exc:  # noqa: BLE001 -- reported on the job; the worker goes on
        return Outcome("failed", f"{type(exc).__name__}: {exc}")
    return Outcome("completed")


def eval_detail(job: Any) -> dict[str, Any]:
    """``EvalJobDetail``."""
    out: dict[str, Any] = {
        "job_id": job.job_id,
        "state": job.state,
        "suite": job.request["suite"],
        "adapter": job.request.get("adapter"),
        "role": job.role or "standalone",
        "linked_training_job_id": job.linked_training_job_id,
        "submitted_unix_ms": job.submitted_ms,
        "result": job.result,
    }
    return {**out, **job.ending()}


def delete_suite(server: Any, name: str) -> dict[str, Any]:
    user = next(
        (
            job
            for job in server.jobs.ordered()
            if not job.terminal
            and (job.request.get("suite") == name or (job.request.get("post_eval") or {}).get("suite") == name)
        ),
        None,
    )
    if user is not None:
        raise ConflictError(
            f"job {user.job_id} ({user.state}) uses suite {name!r}",
            code="eval_suite_conflict",
            hint="wait for it or cancel it first",
        )
    return registry(server.settings).remove(name)


# ----------------------------------------------------------------------------- the gate


def run_gate(engine: Any, job: Any, cancel: threading.Event, active_before: str | None) -> dict[str, Any]:
    """Evaluate baseline and candidate as linked jobs, decide, and act on the outcome; the verdict."""
    from kiln.evals import gate_verdict

    post = job.request["post_eval"]
    name = job.adapter_name
    suite_name = post["suite"]
    entry: dict[str, Any] = {"name": suite_name, "suite_sha256": job.fingerprint.get("suite_sha256")}
    results: dict[str, Any] = {"baseline": None, "candidate": None}
    ids: dict[str, str | None] = {"baseline": None, "candidate": None}
    error = None
    try:
        _, entry = registry(engine.settings).get(suite_name)
        if entry["suite_sha256"] != job.fingerprint.get("suite_sha256"):
            raise RuntimeError(f"suite {suite_name!r} changed since the job was admitted")
        sides = [("baseline", active_before), ("candidate", name)] if post["include_baseline"] else []
        if not sides:
            sides = [("candidate", name)]
        for role, adapter in sides:
            record = engine.jobs.record_eval(job, role=role, suite=suite_name, adapter=adapter, entry=entry)
            ids[role] = record.job_id
            try:
                results[role] = evaluate(engine, suite_name, adapter, cancel)
            except Exception as exc:
                engine.jobs.finish_eval(record, None, f"{type(exc).__name__}: {exc}")
                raise
            engine.jobs.finish_eval(record, results[role], None)
    except Exception as exc:  # noqa: BLE001 -- the verdict reports it as outcome "error"
        error = f"evaluation failed: {type(exc).__name__}: {exc}"
        log.warning("gate of job %s: %s", job.job_id, error)
    verdict = gate_verdict(
        post_eval=post,
        suite_entry=entry,
        candidate=results["candidate"],
        baseline=results["baseline"],
        candidate_job_id=ids["candidate"],
        baseline_job_id=ids["baseline"],
        auto_load=job.auto_load,
        error=error,
    )
    job.linked_eval_job_ids = [i for i in (ids["baseline"], ids["candidate"]) if i]
    return _act(engine, name, verdict)


def _act(engine: Any, name: str, verdict: dict[str, Any]) -> dict[str, Any]:
    outcome = verdict["outcome"]
    if outcome == "promoted":
        status = engine.generator.run_canary(name)
        if status["status"] != "passed":
            return {
                **verdict,
                "outcome": "error",
                "reason": f"the evidence passed but the serving canary quarantined the adapter: "
                f"{status.get('failure_reason')}",
            }
        engine.generator.load(name)
    elif outcome == "demoted":
        active = engine.generator.active()
        if active is not None and active["name"] == name:
            engine.generator.unload()
        failed = demote(engine.registry, name)
        verdict = {**verdict, "reason": f"{verdict['reason']}; renamed to {failed.name}"}
    return verdict
