"""``kiln eval``: evaluation suites and jobs on a Kiln server, and paired comparisons of their results.

``kiln eval suites add FILE | list | remove NAME``  ``POST/GET /v1/eval/suites``, ``DELETE /v1/eval/suites/{name}``
``kiln eval run --suite S [--adapter A] [--wait]``  ``POST /v1/eval/jobs`` (``--wait`` polls the job and
                                                    prints the accuracy with its 95% Wilson interval)
``kiln eval status [--job-id ID]``                  ``GET /v1/eval/jobs`` or ``/v1/eval/jobs/{id}``
``kiln eval cancel ID``                             ``DELETE /v1/eval/jobs/{id}``
``kiln eval compare JOB_A JOB_B``                   both results paired by example id: improvements of A
                                                    over B, regressions, ties, the exact sign-test p-value
                                                    (``kiln.evals``) and both accuracies

Every command talks to ``--url`` / ``KILN_URL`` with ``--api-key`` / ``KILN_API_KEY`` through the
generated SDK; ``--json`` prints the server's body (``compare``: its own report). Errors leave as
every client command's do (``error [<code>]: …`` on stderr, exit 1); a file that is not a
suite is refused before anything is sent (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kiln.cli._client import Interrupt, add_client_options, body, print_json, run, server_url, url_flag

TERMINAL = ("completed", "failed")
POLL_S = 0.5  # how often --wait asks for the job detail

__all__ = ["add_eval_parser", "comparison"]


def add_eval_parser(sub: Any) -> None:
    ev = sub.add_parser(
        "eval",
        help="evaluation suites, evaluation jobs and paired comparisons (on a Kiln server)",
        description="A suite (kiln.eval-suite.v1) is a content-addressed set of examples with pinned greedy "
        "generation settings; an evaluation job runs it against the base model or an adapter on the server's "
        "worker and produces a kiln.eval-result.v1 (per-example scores, accuracy, 95% Wilson interval). "
        "See docs/evals.md.",
    )
    verbs = ev.add_subparsers(dest="eval_verb", metavar="VERB")
    ev.set_defaults(func=lambda _args: _help(ev))

    suites = verbs.add_parser("suites", help="register, list and remove evaluation suites")
    suite_verbs = suites.add_subparsers(dest="suites_verb", metavar="VERB")
    suites.set_defaults(func=lambda _args: _help(suites))

    p = suite_verbs.add_parser(
        "add",
        help="register a suite file (identical content again is a no-op)",
        description="Read FILE strictly, check it against EvalSuite and register it. The same name with other "
        "content is refused (eval_suite_conflict): suites are immutable.",
    )
    p.add_argument("file", help="the suite, a kiln.eval-suite.v1 JSON document")
    add_client_options(p, json_help="print the EvalSuiteEntry")
    p.set_defaults(func=cmd_suites_add)

    p = suite_verbs.add_parser("list", help="every registered suite with its digests and example count")
    add_client_options(p, json_help="print the EvalSuitesListResponse body")
    p.set_defaults(func=cmd_suites_list)

    p = suite_verbs.add_parser("remove", help="remove a suite that no queued or running job uses")
    p.add_argument("name", help="the suite to remove")
    add_client_options(p, json_help="print the DeleteEvalSuiteResponse body")
    p.set_defaults(func=cmd_suites_remove)

    p = verbs.add_parser(
        "run",
        help="queue an evaluation of the base model or an adapter",
        description="The job runs on the server's worker, queued like a training job; --wait follows it and "
        "prints the accuracy and its 95% Wilson interval.",
    )
    p.add_argument("--suite", required=True, help="a registered suite")
    p.add_argument("--adapter", help="a registry adapter to evaluate (default: the base model)")
    p.add_argument("--wait", action="store_true", help="poll until the job ends and print its result")
    add_client_options(p, json_help="print the EvalJobResponse (EvalJobDetail with --wait)")
    p.set_defaults(func=cmd_run)

    p = verbs.add_parser("status", help="every evaluation job, or one with --job-id")
    p.add_argument("--job-id", help="one evaluation job")
    add_client_options(p, json_help="print the EvalJobList (EvalJobDetail with --job-id)")
    p.set_defaults(func=cmd_status)

    p = verbs.add_parser("cancel", help="cancel a queued evaluation, or stop a running one after its current example")
    p.add_argument("job_id", help="the evaluation job")
    add_client_options(p, json_help="print the EvalJobDetail")
    p.set_defaults(func=cmd_cancel)

    p = verbs.add_parser(
        "compare",
        help="compare two completed evaluations example by example (A against B)",
        description="Pairs the two results by example id (they must share the suite and generation digests) and "
        "prints the improvements of A over B, the regressions, the ties, the two-sided exact sign-test p-value "
        "over the non-tied pairs and both accuracies with their 95% Wilson intervals.",
    )
    p.add_argument("job_a", metavar="JOB_A", help="the evaluation job under test (for example the candidate)")
    p.add_argument("job_b", metavar="JOB_B", help="the evaluation job it is compared with (for example the baseline)")
    add_client_options(p, json_help="print the comparison as JSON")
    p.set_defaults(func=cmd_compare)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _target(adapter: str | None) -> str:
    return "base model" if adapter is None else f"adapter {adapter}"


def _interval(result: dict[str, Any]) -> str:
    return (
        f"{result['accuracy']:.3f} ({result['correct']}/{result['example_count']}; "
        f"95% Wilson [{result['wilson_lower']:.3f}, {result['wilson_upper']:.3f}])"
    )


# ----------------------------------------------------------------------------- suites


def _read_suite(path: Path) -> dict[str, Any] | None:
    """The suite in ``path`` checked against ``EvalSuite``; prints the problems and returns None if not."""
    from kiln import contracts
    from kiln.documents.jsonio import read_json_file
    from kiln.errors import ContractError

    try:
        value = read_json_file(path)
    except ContractError as exc:
        problems = exc.problems
    else:
        problems = contracts.problems("EvalSuite", value)
        if not problems:
            return value
    print(f"error: {path} is not a valid evaluation suite (kiln.eval-suite.v1)", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    return None


def cmd_suites_add(args: argparse.Namespace) -> int:
    suite = _read_suite(Path(args.file))
    if suite is None:
        return 2

    def add(client: Any) -> int:
        entry = body(client.register_eval_suite(suite))
        if args.json:
            print_json(entry)
        else:
            print(
                f"✓ registered suite {entry['name']} ({entry['example_count']} examples, "
                f"suite {entry['suite_sha256']}, generation {entry['generation_sha256'][:19]}…)"
            )
        return 0

    return run(args, add)


def cmd_suites_list(args: argparse.Namespace) -> int:
    def listing(client: Any) -> int:
        answer = body(client.list_eval_suites())
        if args.json:
            print_json(answer)
            return 0
        suites = answer["suites"]
        if not suites:
            print(f"no evaluation suites registered on {server_url(args)}")
            return 0
        print(f"{'NAME':24} {'EXAMPLES':>8}  {'SUITE SHA256':22} {'GENERATION':22} REGISTERED")
        for entry in suites:
            print(
                f"{entry['name']:24} {entry['example_count']:>8}  {entry['suite_sha256'][:19] + '…':22} "
                f"{entry['generation_sha256'][:19] + '…':22} {entry['registered_at']}"
            )
        return 0

    return run(args, listing)


def cmd_suites_remove(args: argparse.Namespace) -> int:
    def remove(client: Any) -> int:
        answer = body(client.delete_eval_suite(args.name))
        if args.json:
            print_json(answer)
        else:
            print(f"✓ removed suite {answer['deleted']} ({answer['suite_sha256']})")
        return 0

    return run(args, remove)


# ----------------------------------------------------------------------------- jobs


def _outcome(args: argparse.Namespace, detail: dict[str, Any]) -> int:
    ok = detail["state"] == "completed" and detail["result"] is not None
    if args.json:
        print_json(detail)
        return 0 if ok else 1
    if ok:
        print(f"✓ evaluation {detail['job_id']} completed: {detail['suite']} on {_target(detail['adapter'])}")
        print(f"Accuracy: {_interval(detail['result'])}")
        return 0
    print(f"✗ evaluation {detail['job_id']} failed: {detail.get('error') or 'no reason given'}", file=sys.stderr)
    return 1


def _follow(client: Any, args: argparse.Namespace, job_id: str) -> int:
    """Poll until the job ends; Ctrl-C stops watching, not the job."""
    with Interrupt() as interrupt:
        while not interrupt.event.is_set():
            detail = body(client.get_eval_job(job_id))
            if detail["state"] in TERMINAL:
                return _outcome(args, detail)
            interrupt.event.wait(POLL_S)
    print(f"\nstopped watching; evaluation {job_id} keeps running on the server", file=sys.stderr)
    print(f"cancel it with: kiln eval cancel {job_id}{url_flag(args)}", file=sys.stderr)
    return 130


def cmd_run(args: argparse.Namespace) -> int:
    request: dict[str, Any] = {"suite": args.suite}
    if args.adapter:
        request["adapter"] = args.adapter

    def submit(client: Any) -> int:
        answer = body(client.submit_eval_job(request))
        job_id = answer["job_id"]
        if args.json and not args.wait:
            print_json(answer)
            return 0
        if not args.json:
            print(f"✓ evaluation of {args.suite} on {_target(args.adapter)} submitted")
            print(f"Job ID: {job_id}")
            if not args.wait:
                print(f"Check status: kiln eval status --job-id {job_id}{url_flag(args)}")
        return _follow(client, args, job_id) if args.wait else 0

    return run(args, submit)


def cmd_status(args: argparse.Namespace) -> int:
    def table(client: Any) -> int:
        jobs = body(client.list_eval_jobs())
        if args.json:
            print_json(jobs)
            return 0
        if not jobs:
            print(f"no evaluation jobs on {server_url(args)}")
            return 0
        print(f"{'JOB ID':18} {'STATE':10} {'ROLE':10} {'SUITE':20} {'ACCURACY':>8}  TARGET")
        for job in jobs:
            result = job["result"]
            accuracy = "-" if result is None else f"{result['accuracy']:.3f}"
            print(
                f"{job['job_id']:18} {job['state']:10} {job['role']:10} {job['suite']:20} {accuracy:>8}  "
                f"{_target(job['adapter'])}"
            )
        return 0

    def one(client: Any) -> int:
        detail = body(client.get_eval_job(args.job_id))
        if args.json:
            print_json(detail)
            return 0
        print(f"Job ID: {detail['job_id']}")
        print(f"State: {detail['state']}")
        print(f"Suite: {detail['suite']}")
        print(f"Target: {_target(detail['adapter'])}")
        print(f"Role: {detail['role']}")
        if detail["linked_training_job_id"]:
            print(f"Training job: {detail['linked_training_job_id']}")
        result = detail["result"]
        if result is not None:
            print(f"Accuracy: {_interval(result)}")
            print(f"Suite sha256: {result['suite_sha256']}")
            print(f"Generation sha256: {result['generation_sha256']}")
        if detail.get("error"):
            print(f"Error: {detail['error']}")
        return 0

    return run(args, table if args.job_id is None else one)


def cmd_cancel(args: argparse.Namespace) -> int:
    def cancel(client: Any) -> int:
        detail = body(client.cancel_eval_job(args.job_id))
        if args.json:
            print_json(detail)
        elif detail["state"] in TERMINAL:
            print(f"✓ evaluation {detail['job_id']} is {detail['state']}")
        else:
            print(f"✓ cancellation requested (evaluation {detail['job_id']} stops after its current example)")
        return 0

    return run(args, cancel)


# ----------------------------------------------------------------------------- compare


def _side(detail: dict[str, Any]) -> dict[str, Any]:
    result = detail["result"]
    return {
        "job_id": detail["job_id"],
        "target": result["target"],
        "correct": result["correct"],
        "example_count": result["example_count"],
        "accuracy": result["accuracy"],
        "wilson_lower": result["wilson_lower"],
        "wilson_upper": result["wilson_upper"],
    }


def comparison(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The paired comparison of two completed ``EvalJobDetail``s (A against B); ``ValueError`` if impossible."""
    from kiln.evals import ALPHA, MIN_PAIRED, paired_counts, sign_test_p_value

    for detail in (a, b):
        if detail["state"] != "completed" or detail["result"] is None:
            raise ValueError(f"evaluation {detail['job_id']} has no result (state {detail['state']})")
    candidate, baseline = a["result"], b["result"]
    paired, improvements, regressions, ties = paired_counts(candidate, baseline)
    return {
        "suite": candidate["suite"],
        "suite_sha256": candidate["suite_sha256"],
        "generation_sha256": candidate["generation_sha256"],
        "a": _side(a),
        "b": _side(b),
        "paired_examples": paired,
        "improvements": improvements,
        "regressions": regressions,
        "ties": ties,
        "sign_test_p_value": sign_test_p_value(improvements, regressions),
        "alpha": ALPHA,
        "min_paired_examples": MIN_PAIRED,
    }


def _describe(side: dict[str, Any]) -> str:
    target = side["target"]
    what = "base model" if target["kind"] == "base" else f"adapter {target['adapter']}"
    return f"{side['job_id']} ({what})"


def _summary(report: dict[str, Any]) -> str:
    p, alpha = report["sign_test_p_value"], report["alpha"]
    improvements, regressions = report["improvements"], report["regressions"]
    if report["paired_examples"] < report["min_paired_examples"]:
        return (
            f"too few pairs for the gate: {report['paired_examples']} < {report['min_paired_examples']} "
            "(paired_wilson_v1 would be inconclusive)"
        )
    if p < alpha and improvements > regressions:
        return f"A is significantly better than B (p < {alpha})"
    if p < alpha and regressions > improvements:
        return f"A is significantly worse than B (p < {alpha})"
    return f"no significant difference (p ≥ {alpha})"


def cmd_compare(args: argparse.Namespace) -> int:
    def compare(client: Any) -> int:
        a = body(client.get_eval_job(args.job_a))
        b = body(client.get_eval_job(args.job_b))
        try:
            report = comparison(a, b)
        except ValueError as exc:
            print(f"error: cannot compare {args.job_a} with {args.job_b}: {exc}", file=sys.stderr)
            return 1
        if args.json:
            print_json(report)
            return 0
        print(f"Suite: {report['suite']} ({report['suite_sha256']})")
        print(f"A: {_describe(report['a'])}: accuracy {_interval(report['a'])}")
        print(f"B: {_describe(report['b'])}: accuracy {_interval(report['b'])}")
        print(
            f"Paired examples: {report['paired_examples']} (A better: {report['improvements']}, "
            f"A worse: {report['regressions']}, ties: {report['ties']})"
        )
        print(f"Sign test (two-sided, exact, ties excluded): p = {report['sign_test_p_value']:.4g}")
        print(f"Verdict: {_summary(report)}")
        return 0

    return run(args, compare)
