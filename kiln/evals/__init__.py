"""Evaluation: suites, eval runs, the held-out rule and the ``paired_wilson_v1`` promotion gate.

``SuiteRegistry(root)``          ``register`` / ``list`` / ``get`` / ``remove`` content-addressed suites
                                 under ``<KILN_HOME>/eval-suites`` (``suites_root(home)``)
``suite_sha256(suite)``          digest of a suite's canonical JSON; ``generation_sha256(generation)``
                                 the same for its pinned generation settings
``score(scorer, output, exp)``   one output against one expected answer, 1 or 0 (``EvalScorerKind``)
``run_suite(suite, entry, ...)`` every example through a caller's ``generate`` and its scorer: the
                                 validated ``kiln.eval-result.v1`` (cooperative cancel: ``EvalCancelled``)
``prompt_digest(messages)``      the held-out rule's prompt identity; ``training_prompt_digests(kind,
                                 request)`` of an SFT/GRPO/OPD request; ``overlapping_examples``
``sign_test_p_value``,           the gate's statistics and its verdict (policy, order of the rules:
``paired_counts``,               ``kiln.evals._gate``; the Wilson interval is
``gate_verdict``                 ``kiln.artifacts.evals.wilson_interval``)

Gate policy ``paired_wilson_v1`` (α = 0.05, at least 20 paired examples), first rule that
applies: ``error`` (an evaluation failed or the candidate has no result) → ``demoted``
(``min_accuracy`` set and the candidate's Wilson upper bound below it) → ``inconclusive``
(``train_set_eval``, no baseline, or < 20 pairs) → significant improvement by the exact
sign test: ``promoted`` (``auto_load``) or ``kept`` when the Wilson lower bound meets
``min_accuracy`` (or none is set), else ``inconclusive`` → significant regression:
``regression`` → otherwise ``inconclusive``.

Nothing here imports torch, a model or the server: generation is the caller's.
"""

from __future__ import annotations

from kiln.evals._gate import ALPHA, MIN_PAIRED, POLICY, gate_verdict, paired_counts, sign_test_p_value
from kiln.evals._overlap import overlapping_examples, prompt_digest, training_prompt_digests
from kiln.evals._registry import SuiteRegistry, generation_sha256, suite_sha256, suites_root
from kiln.evals._run import EvalCancelled, run_suite
from kiln.evals._scoring import normalize, score

__all__ = [
    "ALPHA",
    "MIN_PAIRED",
    "POLICY",
    "EvalCancelled",
    "SuiteRegistry",
    "gate_verdict",
    "generation_sha256",
    "normalize",
    "overlapping_examples",
    "paired_counts",
    "prompt_digest",
    "run_suite",
    "score",
    "sign_test_p_value",
    "suite_sha256",
    "suites_root",
    "training_prompt_digests",
]
