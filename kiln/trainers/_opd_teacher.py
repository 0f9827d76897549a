"""OPD admission's teacher side: the pinned teacher, and the source it scores or has scored.

* ``pinned_teacher``: the registered teacher looked up and re-probed (``teacher_not_found``,
  ``teacher_identity_mismatch`` when it changed since registration), and its kind checked against the mode: a
  fixture (pre-scored file) cannot score new rollouts, and ``off_policy`` replays only a fixture's file;
* ``admitted_source``: ``on_policy`` -- the request's prompts, scored live by a teacher that shares the student's
  vocabulary and tokenizer; ``off_policy`` -- the pre-scored file, read row by row against the student's
  vocabulary and bound to the fixture the teacher was registered for (its id and, when pinned, its digest). Each
  says what the effective config needs (the teacher's top-K bound), the revisions a checkpoint binds, and the
  candidates the loop visits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.digests import raw_hex, teacher_identity_revision
from kiln.errors import RequestError

__all__ = ["admitted_source", "pinned_teacher"]

DEFAULT_MAX_TOP_K = 32  # a teacher without a pinned identity (none is registered so today) bounds top_k here


def pinned_teacher(alias: str, mode: str, *, teachers_root: Path, registry: Path) -> Any:
    """The registered teacher ``alias``, re-probed, whose kind can serve ``mode``."""
    from kiln.teachers import TeacherRegistry, reprobe

    teacher = TeacherRegistry(teachers_root, adapter_registry=registry).get(alias)  # teacher_not_found
    reprobe(teacher, registry_dir=registry)  # teacher_identity_mismatch when the teacher changed since registration
    if mode == "on_policy" and teacher.kind == "fixture":
        raise RequestError(
            f"teacher {teacher.alias!r} is a fixture (pre-scored file) and cannot score new rollouts",
            code="training_invalid_request",
            pointer="/teacher",
            hint='use "training_mode": "off_policy" with its file as dataset_path, or a local/remote teacher',
        )
    if mode == "off_policy" and teacher.kind != "fixture":
        raise RequestError(
            f"off_policy replays a pre-scored file, but teacher {teacher.alias!r} is {teacher.kind}",
            code="training_invalid_request",
            pointer="/teacher",
            hint="register the file as a fixture teacher (kiln teachers add ALIAS --kind fixture --file F)",
        )
    return teacher


def admitted_source(mode: str, request: dict[str, Any], teacher: Any, loaded: Any, identity: Any) -> Any:
    """The source of ``mode`` for the student ``loaded`` (with run ``identity``), checked against ``teacher``."""
    vocab = int(loaded.model.config.vocab_size)
    tokenizer = raw_hex(identity.tokenizer_vocab_hash)
    if mode == "on_policy":
        return _Prompts(request, teacher, loaded, vocab, tokenizer)
    return _PreScored(request, teacher, loaded, vocab, tokenizer)


class _Prompts:
    """``on_policy``: the request's prompts; the teacher scores each rollout live."""

    route = "prompts"
    pin = None

    def __init__(self, request: dict[str, Any], teacher: Any, loaded: Any, vocab: int, tokenizer: str) -> None:
        _check_vocabulary(teacher.identity, vocab, tokenizer, teacher.alias)
        self.request, self.loaded = request, loaded
        self.max_top_k = teacher.identity["max_top_k"] if teacher.identity else DEFAULT_MAX_TOP_K
        self.teacher_identity = teacher.identity
        self.identity_revision = teacher.identity_revision
        self.content_revision = teacher.content_revision

    def read(self, cfg: dict[str, Any]) -> Any:
        from kiln.data.opd import read_prompts

        echo = cfg["echo"]
        return read_prompts(
            self.loaded.tokenizer, self.request["prompts"], warning_filter=echo["warning_filter"] if echo else True
        )

    @staticmethod
    def candidates(source: Any, cfg: dict[str, Any]) -> list[tuple[int, int]]:
        return [(item.index, s) for item in source.items for s in range(cfg["samples_per_prompt"])]


class _PreScored:
    """``off_policy``: the fixture's pre-scored file; the row's response is the rollout, its scores the teacher's."""

    route = "teacher_jsonl"

    def __init__(self, request: dict[str, Any], teacher: Any, loaded: Any, vocab: int, tokenizer: str) -> None:
        from kiln.data.opd import read_off_policy_file

        self.source = source = read_off_policy_file(
            loaded.tokenizer, request["dataset_path"], vocab_size=vocab, tokenizer_vocab_sha256=tokenizer
        )
        manifest = source.manifest
        if manifest["fixture_id"] != teacher.model_id:
            raise RequestError(
                f"{source.path} is fixture {manifest['fixture_id']!r} but teacher {teacher.alias!r} is "
                f"registered for fixture {teacher.model_id!r}",
                code="training_invalid_request",
                pointer="/dataset_path",
            )
        if teacher.content_revision is not None and teacher.content_revision != source.sha256:
            raise RequestError(
                f"teacher {teacher.alias!r} was registered with a file of digest {teacher.content_revision}; "
                f"{source.path} has {source.sha256}",
                code="teacher_identity_mismatch",
                pointer="/dataset_path",
                hint="train from the registered file, or register the new file under a new alias",
            )
        self.max_top_k = int(manifest["top_k"])
        self.pin = self.content_revision = source.sha256
        self.teacher_identity = manifest.get("teacher_identity")
        self.identity_revision = (
            teacher_identity_revision(self.teacher_identity)
            if self.teacher_identity
            else raw_hex(source.manifest_sha256)
        )

    def read(self, cfg: dict[str, Any]) -> Any:
        return self.source

    @staticmethod
    def candidates(source: Any, cfg: dict[str, Any]) -> list[tuple[int, int]]:
        return [(row.index, 0) for row in source.rows]


def _check_vocabulary(identity: dict[str, Any] | None, vocab: int, tokenizer: str, alias: str) -> None:
    """The teacher scores ids of the student's vocabulary, or the loss compares different tokens."""
    if identity is None:
        return
    if identity["vocab_size"] != vocab:
        raise RequestError(
            f"teacher {alias!r} has a vocabulary of {identity['vocab_size']} ids, the student {vocab}",
            code="training_invalid_request",
            pointer="/teacher",
            hint="distil from a teacher that shares the student's tokenizer",
        )
    if identity["tokenizer_vocab_sha256"] != tokenizer:
        raise RequestError(
            f"teacher {alias!r} uses tokenizer vocabulary {identity['tokenizer_vocab_sha256']}, "
            f"the student {tokenizer}",
            code="training_invalid_request",
            pointer="/teacher",
            hint="distil from a teacher that shares the student's tokenizer",
        )
