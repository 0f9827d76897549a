"""The schema states what the server enforces (issue "Serving that real clients can rely on", item 5): every rule a
request body can break by itself is in its schema, so a client, a generator or a fuzzer reading the schema knows it,
and the refusal names the field and the rule. Each case below was a schema-valid request the server refused."""

from __future__ import annotations

import pytest

from kiln import contracts

USER = [{"role": "user", "content": "Hi"}]
SUITE = {
    "schema": "kiln.eval-suite.v1",
    "name": "suite",
    "generation": {"max_tokens": 4, "seed": 0, "temperature": 0},
    "examples": [{"id": "1", "messages": USER, "expected": "Hello"}],
}


def _refused(document, body):
    found = contracts.problems(document, body)
    assert found, f"{document} accepted {body}"
    return {p.pointer: p for p in found}


@pytest.mark.parametrize(
    ("document", "body", "pointer", "code", "needle"),
    [
        ("ChatCompletionRequest", {"messages": USER, "stream_options": {}}, "/stream_options", "inconsistent_fields", "stream: true"),
        ("CompletionRequest", {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}, "stream": False}, "/stream_options", "inconsistent_fields", "stream: true"),
        ("ChatCompletionRequest", {"messages": USER, "adapter": "bot", "base_model": True}, "/adapter", "inconsistent_fields", "cannot be combined"),
        ("ChatCompletionRequest", {"messages": USER, "top_logprobs": 2}, "/logprobs", "inconsistent_fields", "needs `logprobs: true`"),
        ("CompletionRequest", {"model": "m", "prompt": ""}, "/prompt", "invalid_length", ""),
        ("CompletionRequest", {"model": "m", "prompt": ["a", ""]}, "/prompt/1", "invalid_length", ""),
        ("CompletionRequest", {"model": "m", "prompt": "x", "best_of": 2}, "/best_of", "wrong_const", ""),
        ("AuditRequest", {"adapter": "bot", "seed": 3}, "/seed", "inconsistent_fields", "give `segments`"),
        ("EvalSuite", {**SUITE, "scorer": {"kind": "regex"}}, "/scorer/pattern", "inconsistent_fields", "`regex` scorer"),
        ("EvalSuite", {**SUITE, "scorer": {"kind": "contains", "pattern": "x"}}, "/scorer/pattern", "inconsistent_fields", "`regex` scorer"),
        ("EvalSuite", {**SUITE, "scorer": {"kind": "regex", "pattern": "a\\K"}}, "/scorer/pattern", "invalid_format", ""),
        ("EvalSuite", {**SUITE, "scorer": {"kind": "json_field"}}, "/scorer/field", "inconsistent_fields", "`json_field`"),
        ("RegisterTeacherRequest", {"alias": "t", "kind": "local", "model_id": "/srv/m", "url": "http://h"}, "/url", "inconsistent_fields", "no `provider`, `url`"),
        ("RegisterTeacherRequest", {"alias": "t", "kind": "local", "model_id": "models/m"}, "/model_id", "inconsistent_fields", "absolute path"),
        ("RegisterTeacherRequest", {"alias": "t", "kind": "remote", "provider": "vllm", "model_id": "m"}, "/url", "inconsistent_fields", "http(s) `url`"),
        ("RegisterTeacherRequest", {"alias": "t", "kind": "remote", "provider": "vllm", "model_id": "m", "url": "ftp://h"}, "/url", "inconsistent_fields", "http(s) `url`"),
        ("RegisterTeacherRequest", {"alias": "t\x01", "kind": "fixture", "model_id": "f"}, "/alias", "unsafe_path", "control characters"),
        ("OpdRequest", {"teacher": "t", "dataset_path": "/data/x.jsonl"}, "/prompts", "inconsistent_fields", "on_policy"),
        ("OpdRequest", {"teacher": "t", "prompts": [{"messages": USER}], "config": {"training_mode": "off_policy"}}, "/dataset_path", "inconsistent_fields", "off_policy"),
        ("GrpoRequest", {"groups": [{"messages": USER, "completions": [{"text": "x", "reward": 1}]}], "dry_run": True}, "/dataset_path", "inconsistent_fields", "dry_run"),
        ("GrpoRequest", {"dataset": "hub/math"}, "/dataset", "wrong_type", "no dataset registry"),
        ("GrpoRequest", {"agentic_groups": [{"messages": [], "completions": [{"text": "x", "reward": 1}]}]}, "/agentic_groups/0/messages", "invalid_length", ""),
        ("GrpoRequest", {"groups": [{"messages": [{"role": "robot", "content": "x"}], "completions": [{"text": "x", "reward": 1}]}]}, "/groups/0/messages/0/role", "value_not_allowed", ""),
        ("SftRequest", {"examples": [{}]}, "/examples/0/messages", "missing_field", ""),
        ("SftRequest", {"examples": [{"messages": []}]}, "/examples/0/messages", "invalid_length", ""),
        ("SftRequest", {"dataset": "hub/thing"}, "/dataset", "wrong_type", "no dataset registry"),
        ("SftRequest", {"dataset_path": "relative/rows.jsonl"}, "/dataset_path", "unsafe_path", "absolute path"),
        ("SftRequest", {"dataset_path": "/data/../etc/rows.jsonl"}, "/dataset_path", "unsafe_path", "`..`"),
        ("SftRequest", {"dataset_path": "/data/a\x00b"}, "/dataset_path", "unsafe_path", "NUL"),
        ("SftRequest", {"examples": [{"messages": USER}], "config": {"output_name": " bot"}}, "/config/output_name", "pattern_mismatch", "whitespace"),
        ("SftRequest", {"examples": [{"messages": USER}], "config": {"output_name": "bot.FAILED-2"}}, "/config/output_name", "pattern_mismatch", "derived"),
        ("SftRequest", {"examples": [{"messages": USER}], "config": {"output_name": "a-checkpoint-step-1"}}, "/config/output_name", "pattern_mismatch", "-checkpoint-step-"),
        ("SftRequest", {"examples": [{"messages": USER}], "config": {"output_name": "x" * 194}}, "/config/output_name", "invalid_length", ""),
    ],
)  # fmt: skip
def test_a_rule_the_server_enforces_is_refused_by_the_schema_naming_the_field(document, body, pointer, code, needle):
    found = _refused(document, body)
    assert pointer in found, sorted(found)
    assert found[pointer].code == code, found[pointer]
    assert needle in found[pointer].message


@pytest.mark.parametrize(
    ("document", "body"),
    [
        ("ChatCompletionRequest", {"messages": USER, "stream": True, "stream_options": {"include_usage": True}}),
        ("ChatCompletionRequest", {"messages": USER, "stream_options": None, "adapter": "bot", "base_model": False}),
        ("ChatCompletionRequest", {"messages": USER, "logprobs": True, "top_logprobs": 2, "top_k": -1, "min_p": 0.1}),
        ("CompletionRequest", {"model": "m", "prompt": [1, 2], "best_of": 1, "min_tokens": 4, "repetition_penalty": 1.2}),
        ("AuditRequest", {"adapter": "bot", "seed": 3, "segments": 2}),
        ("EvalSuite", {**SUITE, "scorer": {"kind": "regex", "pattern": "(?<year>[0-9]{4})"}}),
        ("RegisterTeacherRequest", {"alias": "t", "kind": "remote", "provider": "vllm", "model_id": "m", "url": "http://10.0.0.12:8000"}),
        ("RegisterTeacherRequest", {"alias": "t", "kind": "local", "model_id": "/srv/models/teacher"}),
        ("OpdRequest", {"teacher": "t", "dataset_path": "/data/x.jsonl", "config": {"training_mode": "off_policy"}}),
        ("GrpoRequest", {"dataset_path": "/data/groups.jsonl", "dry_run": True, "dataset": None, "dataset_split": None}),
        ("SftRequest", {"dataset_path": "/data/.hidden/..x/rows.jsonl"}),
        ("SftRequest", {"examples": [{"messages": USER}], "config": {"output_name": "support-bot.v2"}}),
    ],
)  # fmt: skip
def test_the_requests_the_rules_allow_stay_valid(document, body):
    assert contracts.problems(document, body) == []


def test_an_ecma_named_group_runs_as_python_reads_it():
    from kiln.evals._scoring import _compiled

    assert _compiled("(?<year>[0-9]{4})").search("in 2026")["year"] == "2026"
