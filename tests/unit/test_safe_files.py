"""The one folder-bound save and path check (``workbench.safe_files``): a failed save leaves the old files, nothing is
read or written outside the folder, no temporary is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workbench.errors import CheckpointError
from workbench.safe_files import inside, save_files


def _write(text: str):
    return lambda path: path.write_text(text)


def _fail_after_writing_half(path: Path) -> None:
    path.write_text("half")
    raise OSError("disk full")


def test_a_failed_writer_leaves_every_previous_file_and_no_temporary(tmp_path: Path) -> None:
    save_files(tmp_path, {"cfg.json": _write("old cfg"), "weights.bin": _write("old weights")})
    with pytest.raises(OSError, match="disk full"):
        save_files(tmp_path, {"cfg.json": _write("new cfg"), "weights.bin": _fail_after_writing_half})
    assert (tmp_path / "cfg.json").read_text() == "old cfg"
    assert (tmp_path / "weights.bin").read_text() == "old weights"
    assert sorted(os.listdir(tmp_path)) == ["cfg.json", "weights.bin"]


def test_an_interrupt_is_cleaned_up_like_an_error(tmp_path: Path) -> None:
    def interrupted(path: Path) -> None:
        path.write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_files(tmp_path / "new", {"a": interrupted})
    assert list((tmp_path / "new").iterdir()) == []


def test_a_successful_save_replaces_each_file(tmp_path: Path) -> None:
    save_files(tmp_path, {"a": _write("1")})
    save_files(tmp_path, {"a": _write("2"), "sub/b": _write("3")})
    assert (tmp_path / "a").read_text() == "2" and (tmp_path / "sub" / "b").read_text() == "3"


@pytest.mark.parametrize("name", ["../escape.json", "/etc/passwd", "sub/../../escape"])
def test_names_that_leave_the_folder_are_refused_before_writing(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "folder"
    with pytest.raises(CheckpointError, match="leaves the folder"):
        save_files(folder, {"ok": _write("x"), name: _write("y")})
    assert os.listdir(tmp_path) == []


def test_a_link_out_of_the_folder_is_neither_read_nor_written(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "cfg.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside"):
        inside(folder, "cfg.json", must_exist=True)
    with pytest.raises(CheckpointError, match="outside|symbolic link"):
        save_files(folder, {"cfg.json": _write("overwritten")})
    assert outside.read_text() == "secret"


def test_a_linked_folder_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(CheckpointError, match="symbolic link"):
        save_files(tmp_path / "link", {"a": _write("x")})
    assert list(real.iterdir()) == []


def test_a_file_in_place_of_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        save_files(tmp_path / "file", {"a": _write("y")})


def test_a_missing_file_is_refused_only_when_it_must_exist(tmp_path: Path) -> None:
    assert inside(tmp_path, "absent.json") == tmp_path / "absent.json"
    with pytest.raises(CheckpointError, match="missing"):
        inside(tmp_path, "absent.json", must_exist=True)
