"""Reward scorers: one interface, four kinds (builtin, a Python entry point called as TRL calls a reward function,
an HTTP endpoint with bounded retries, an executable speaking JSON lines), each with a recorded identity; every
failure is a ``ScorerError`` naming the task and the scorer, with the scorer's stderr tail."""

from __future__ import annotations

import hashlib
import http.server
import json
import stat
import sys
import threading
from typing import ClassVar

import pytest

from kiln.errors import RequestError, ScorerError
from kiln.rollouts import (
    BuiltinScorer,
    EntryPointScorer,
    ExecutableScorer,
    HttpScorer,
    ScoreRequest,
    scorer_of,
)


def _request(completion, task_id="t1", **task):
    messages = [{"role": "user", "content": "Say it."}]
    return ScoreRequest({"messages": messages, **task}, task_id, messages, completion, (1, 2))


# ----------------------------------------------------------------------------- builtins


def test_builtin_exact_compares_with_the_answer_ignoring_surrounding_whitespace():
    scorer = BuiltinScorer("exact")
    found = scorer.score([_request(" 4\n", answer="4"), _request("four", answer="4"), _request("4", answer=4)])
    assert [s.reward for s in found] == [1.0, 0.0, 1.0]


def test_builtin_regex_searches_the_tasks_pattern():
    found = BuiltinScorer("regex").score([_request("abc 12", pattern=r"\d+"), _request("abc", pattern=r"\d+")])
    assert [s.reward for s in found] == [1.0, 0.0]


def test_builtin_json_parses_and_checks_the_tasks_schema_when_it_has_one():
    schema = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
    found = BuiltinScorer("json").score(
        [
            _request('{"name": "kiln"}', schema=schema),
            _request('{"name": 3}', schema=schema),
            _request("[1, 2]"),
            _request("{not json"),
        ]
    )
    assert [s.reward for s in found] == [1.0, 0.0, 1.0, 0.0]


def test_a_builtin_missing_its_task_field_fails_naming_the_task():
    with pytest.raises(ScorerError) as failed:
        BuiltinScorer("exact").score([_request("4", task_id="sum-1")])
    assert failed.value.code == "scorer_failed"
    assert "task 'sum-1'" in failed.value.message
    assert "builtin:exact" in failed.value.message
    assert 'no "answer"' in failed.value.message


def test_an_unknown_builtin_is_refused_listing_the_builtins():
    with pytest.raises(RequestError) as refused:
        scorer_of("builtin:nope")
    assert "builtin:exact" in refused.value.hint


# ----------------------------------------------------------------------------- a Python entry point (TRL's call)

REWARDS = '''
def length_reward(prompts, completions, completion_ids, answer, **kwargs):
    """A TRL reward function, unchanged: conversational completions, a dataset column as a keyword."""
    return [float(c[0]["content"] == a) + 0.1 * len(ids) for c, a, ids in zip(completions, answer, completion_ids)]

def details(prompts, completions, **kwargs):
    return [{"reward": 0.5, "why": "half"} for _ in completions]

def short(prompts, completions, **kwargs):
    return [1.0]

def boom(prompts, completions, **kwargs):
    raise ValueError("no reference answer")

def nan(prompts, completions, **kwargs):
    return [float("nan") for _ in completions]
'''


@pytest.fixture
def rewards_dir(tmp_path):
    module = f"rewards_{hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]}"
    (tmp_path / f"{module}.py").write_text(REWARDS)
    yield tmp_path, module
    sys.modules.pop(module, None)


def test_an_entry_point_is_called_like_a_trl_reward_function(rewards_dir):
    where, module = rewards_dir
    scorer = scorer_of(f"{module}:length_reward", search=where)
    assert isinstance(scorer, EntryPointScorer)
    found = scorer.score([_request("4", answer="4"), _request("5", answer="4")])
    assert [s.reward for s in found] == [pytest.approx(1.2), pytest.approx(0.2)]
    identity = scorer.identity
    assert identity["kind"] == "entry_point"
    assert identity["entry_point"] == f"{module}:length_reward"
    assert identity["module_sha256"] == hashlib.sha256(REWARDS.encode()).hexdigest()
    assert str(where) not in sys.path, "the search directory is not left on the import path"


def test_an_entry_points_other_fields_are_kept(rewards_dir):
    where, module = rewards_dir
    (found,) = scorer_of(f"{module}:details", search=where).score([_request("x")])
    assert found.reward == 0.5
    assert found.details == {"why": "half"}


@pytest.mark.parametrize(
    ("function", "says"),
    [
        ("short", "returned 1 values for 2 completions"),
        ("boom", "raised ValueError: no reference answer"),
        ("nan", "non-finite reward nan"),
    ],
)
def test_an_entry_point_that_misbehaves_fails_naming_the_task(rewards_dir, function, says):
    where, module = rewards_dir
    with pytest.raises(ScorerError) as failed:
        scorer_of(f"{module}:{function}", search=where).score([_request("a"), _request("b")])
    assert says in failed.value.message
    assert "task 't1'" in failed.value.message


def test_an_entry_point_that_does_not_import_is_refused():
    with pytest.raises(RequestError, match="cannot be imported"):
        scorer_of("no_such_module_here:fn")


# ----------------------------------------------------------------------------- an executable (JSON lines)


def _script(tmp_path, body, name="grade.py"):
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\nimport json, sys, time\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_an_executable_reads_json_lines_and_answers_one_line_per_completion(tmp_path):
    path = _script(
        tmp_path,
        "for line in sys.stdin:\n"
        "    item = json.loads(line)\n"
        "    print(json.dumps({'reward': len(item['completion']), 'task': item['task']['id']}))\n",
    )
    scorer = scorer_of(str(path))
    assert isinstance(scorer, ExecutableScorer)
    found = scorer.score([_request("ab", id="x"), _request("abcd", id="y")])
    assert [(s.reward, s.details) for s in found] == [(2.0, {"task": "x"}), (4.0, {"task": "y"})]
    assert scorer.identity == {
        "kind": "executable",
        "path": str(path.resolve()),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("sys.stderr.write('traceback: KeyError answer\\n'); sys.exit(2)", "exited with status 2"),
        ("[print('not json') for _ in sys.stdin]", "which is not JSON"),
        ("print(json.dumps({'reward': 1}))", "wrote 1 answer lines for 2 completions"),
        ("[print(json.dumps({'score': 1})) for _ in sys.stdin]", 'where {"reward": <number>} is needed'),
        ("[print(json.dumps({'reward': 1e999})) for _ in sys.stdin]", "the non-finite reward inf"),
    ],
)
def test_an_executable_that_misbehaves_fails_with_its_stderr_tail(tmp_path, body, says):
    path = _script(tmp_path, "sys.stderr.write('grader v2 starting\\n')\n" + body + "\n")
    with pytest.raises(ScorerError) as failed:
        scorer_of(str(path)).score([_request("a"), _request("b")])
    message = failed.value.message
    assert says in message
    assert str(path) in message
    assert "task 't1'" in message
    assert "grader v2 starting" in message  # the stderr tail


def test_an_executable_that_hangs_is_stopped_at_its_timeout(tmp_path):
    path = _script(tmp_path, "time.sleep(30)\n")
    with pytest.raises(ScorerError, match=r"timed out after 0.5 s"):
        scorer_of(str(path), timeout=0.5).score([_request("a")])


def test_an_executable_runs_without_a_shell(tmp_path):
    with pytest.raises(RequestError, match="no such file"):
        scorer_of(f"{_script(tmp_path, '')} ; rm -rf /")  # one path, never a command line


# ----------------------------------------------------------------------------- an HTTP endpoint


class _Grader(http.server.BaseHTTPRequestHandler):
    script: ClassVar[list[int]] = []  # statuses to answer, in order; then 200

    def do_POST(self):
        item = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status = self.script.pop(0) if self.script else 200
        body = json.dumps({"reward": float(len(item["completion"]))} if status == 200 else {"error": "no"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def grader():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Grader)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    _Grader.script = []


def _url(server):
    return f"http://127.0.0.1:{server.server_address[1]}/score"


def test_an_http_scorer_posts_each_completion_and_retries_a_5xx(grader):
    _Grader.script = [503, 500]
    scorer = HttpScorer(_url(grader), retries=2, backoff=0.0)
    assert [s.reward for s in scorer.score([_request("abc")])] == [3.0]
    assert scorer.identity == {"kind": "http", "url": _url(grader)}


def test_an_http_scorer_does_not_retry_a_4xx_and_stops_after_its_retries(grader):
    _Grader.script = [400]
    with pytest.raises(ScorerError, match=r"HTTP 400.*not retried.*after 1 attempt\)"):
        HttpScorer(_url(grader), retries=2, backoff=0.0).score([_request("abc")])
    assert _Grader.script == []
    _Grader.script = [500, 500, 500]
    with pytest.raises(ScorerError, match=r"HTTP 500.*after 3 attempts"):
        HttpScorer(_url(grader), retries=2, backoff=0.0).score([_request("abc")])


def test_an_http_scorer_that_does_not_answer_fails_naming_the_task():
    with socket_closed() as port, pytest.raises(ScorerError, match=r"task 't1'.*no answer"):
        HttpScorer(f"http://127.0.0.1:{port}/", retries=1, backoff=0.0, timeout=2).score([_request("a")])


class socket_closed:  # noqa: N801 -- a context manager read as a phrase
    """A local port nothing listens on."""

    def __enter__(self):
        import socket

        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        return self.port

    def __exit__(self, *exc):
        return False
