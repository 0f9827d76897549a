"""Strict JSON parsing and crash-atomic writes."""

from __future__ import annotations

import os

import pytest

from kiln.documents import jsonio
from kiln.errors import DocumentReadError
from kiln.host import fs


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"a": 1, "a": 2}', "duplicate key"),
        ('{"a": NaN}', "non-finite"),
        ('{"a": Infinity}', "non-finite"),
        ('{"a": -Infinity}', "non-finite"),
        ('{"a": 1} trailing', "Extra data"),
        ("", "Expecting value"),
    ],
)
def test_json_that_is_not_strict_is_refused(text, reason):
    with pytest.raises(DocumentReadError) as info:
        jsonio.parse_json(text)
    assert info.value.code == "invalid_json"
    assert reason in info.value.message


def test_bytes_that_are_not_utf8_are_refused():
    with pytest.raises(DocumentReadError) as info:
        jsonio.parse_json(b'{"a": "\xff"}')
    assert info.value.code == "invalid_json"


def test_documents_over_the_limit_are_refused_before_parsing(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b"[" + b"1," * 100 + b"1]")
    with pytest.raises(DocumentReadError) as info:
        jsonio.read_json_file(path, limit=50)
    assert info.value.code == "document_too_large"


def test_a_missing_file_is_reported_as_unreadable(tmp_path):
    with pytest.raises(DocumentReadError) as info:
        jsonio.read_json_file(tmp_path / "absent.json")
    assert info.value.code == "document_unreadable"


def test_nested_duplicate_keys_are_refused():
    with pytest.raises(DocumentReadError):
        jsonio.parse_json('{"a": {"b": 1, "b": 1}}')


def test_atomic_write_replaces_content_and_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "doc.json"
    target.write_bytes(b"old")
    fs.atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["doc.json"]


def test_a_failed_atomic_write_keeps_the_old_content(tmp_path, monkeypatch):
    target = tmp_path / "doc.json"
    target.write_bytes(b"old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(fs.os, "replace", broken_replace)
    with pytest.raises(OSError):
        fs.atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["doc.json"]


def test_a_number_that_overflows_to_infinity_is_refused():
    from kiln.documents.jsonio import parse_json
    from kiln.errors import DocumentReadError

    with pytest.raises(DocumentReadError) as info:
        parse_json('{"reward": 1e400}')
    assert info.value.code == "invalid_json"
    assert "infinity" in info.value.message
    assert parse_json('{"reward": 1e300}')["reward"] == 1e300


def test_crash_atomic_writes_and_staging_directories_follow_the_umask(tmp_path):
    import stat

    from kiln.host.fs import atomic_write_bytes, create_exclusive, staging_dir

    previous = os.umask(0o027)
    try:
        atomic_write_bytes(tmp_path / "a.json", b"{}")
        assert create_exclusive(tmp_path / "b.json", b"{}")
        assert not create_exclusive(tmp_path / "b.json", b"[]")
        staged = staging_dir(tmp_path, "name")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o640
    assert (tmp_path / "b.json").read_bytes() == b"{}"
    assert stat.S_IMODE(staged.stat().st_mode) == 0o750
    assert staged.name.startswith(".name.incomplete-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a.json", "b.json", staged.name])  # no temp left


def test_a_published_adapter_and_a_tiny_model_are_readable_as_the_umask_allows(trained_adapter, tiny_model_dir):
    import stat

    from kiln.host.fs import dir_mode, file_mode

    for directory in (trained_adapter, tiny_model_dir):
        assert stat.S_IMODE(directory.stat().st_mode) == dir_mode(), directory
        for path in directory.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == file_mode(), path


# --- staged directory publication ----------------------------------------------------------------


def _events(monkeypatch):
    """Record every fsync (by the path the descriptor names) and rename ``kiln.host.fs`` makes, in order."""
    log = []
    fsync, rename = fs.os.fsync, fs.os.rename

    def logged_fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def logged_rename(src, dst):
        log.append(("rename", os.fspath(src), os.fspath(dst)))
        rename(src, dst)

    monkeypatch.setattr(fs.os, "fsync", logged_fsync)
    monkeypatch.setattr(fs.os, "rename", logged_rename)
    return log


def test_a_published_directory_is_synced_then_renamed_once_then_its_parent_is_synced(tmp_path, monkeypatch):
    log = _events(monkeypatch)
    target = tmp_path / "bot"
    with fs.publish_dir(target) as staging:
        assert staging.parent == tmp_path
        assert staging.name.startswith(".bot.incomplete-")
        (staging / "a.json").write_bytes(b"{}")
        (staging / "sub").mkdir()
        (staging / "sub" / "b.bin").write_bytes(b"b")
        assert not target.exists()  # nothing at the name until the block is done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bot"]
    assert (target / "a.json").read_bytes() == b"{}"
    assert (target / "sub" / "b.bin").read_bytes() == b"b"
    renames = [i for i, event in enumerate(log) if event[0] == "rename"]
    assert len(renames) == 1
    assert log[renames[0]] == ("rename", str(staging), str(target))
    before = {event[1] for event in log[: renames[0]]}
    assert {str(staging / "a.json"), str(staging / "sub" / "b.bin"), str(staging / "sub"), str(staging)} <= before
    assert log[renames[0] + 1 :] == [("fsync", str(tmp_path))]


def test_a_failed_publication_leaves_nothing_that_looks_complete(tmp_path):
    target = tmp_path / "bot"

    def half_way():
        with fs.publish_dir(target) as staging:
            (staging / "a.json").write_bytes(b"{}")
            raise RuntimeError("half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        half_way()
    assert list(tmp_path.iterdir()) == []


def test_publication_refuses_an_existing_target_unless_told_to_replace_it(tmp_path):
    target = tmp_path / "bot"
    target.mkdir()
    (target / "old").write_bytes(b"old")
    with pytest.raises(FileExistsError), fs.publish_dir(target) as staging:
        (staging / "new").write_bytes(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bot"]
    assert [p.name for p in target.iterdir()] == ["old"]
    with fs.publish_dir(target, overwrite=True) as staging:
        (staging / "new").write_bytes(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bot"]  # the replaced directory is gone too
    assert [p.name for p in target.iterdir()] == ["new"]


def test_a_replacement_whose_rename_fails_puts_the_old_directory_back(tmp_path, monkeypatch):
    target = tmp_path / "bot"
    target.mkdir()
    (target / "old").write_bytes(b"old")
    rename = fs.os.rename

    def failing(src, dst):
        if ".incomplete-" in os.fspath(src):
            raise OSError("disk full")
        rename(src, dst)

    monkeypatch.setattr(fs.os, "rename", failing)
    with pytest.raises(OSError, match="disk full"), fs.publish_dir(target, overwrite=True) as staging:
        (staging / "new").write_bytes(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bot"]
    assert [p.name for p in target.iterdir()] == ["old"]
