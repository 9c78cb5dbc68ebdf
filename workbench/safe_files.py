"""Saving and reading files inside one folder: the one implementation every save and reader uses.

- ``inside(folder, name)``: ``folder / name``, refused when it is absolute, climbs out with ``..`` or resolves
  outside the folder through a link;
- ``read_json(path, max_bytes, what)``: a small JSON file of a folder, its size bounded before it is read and
  nesting too deep to parse refused like bad JSON;
- ``save_files(folder, writers)``: writes several files of one folder so that a failure at any point leaves the
  previous contents as they were (each file goes to a temporary name first; only when every file is written are
  they renamed over the old ones, so a reader sees either the old set or the new one, file by file).

Why not write in place: a save killed half-way (a full disk, Ctrl-C, an exception in a tensor's conversion) would
leave a truncated ``safetensors`` file beside an old ``cfg.json``, which loads as garbage or not at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Type, Union

from workbench.errors import CheckpointError

Writer = Callable[[Path], None]  # writes one file at the path it is given


def inside(folder: Union[str, Path], name: Union[str, Path], must_exist: bool = False,
           what: str = "folder") -> Path:
    """``folder / name``, refused (``CheckpointError``) when it would read or write outside ``folder``.

    Refused: an absolute ``name``, a ``..`` step, and a path that resolves outside the folder through a symbolic
    link (the link itself, or a linked folder on the way). With ``must_exist`` a missing file is refused too.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> inside(folder, "cfg.json").name
        'cfg.json'
        >>> inside(folder, "../outside.json")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: ../outside.json: leaves the folder ...; refusing to use it
    """
    folder = Path(folder)
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(f"{name}: leaves the {what} {folder} (absolute, or a '..' step); refusing to use it")
    target = folder / relative
    if not target.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{target}: resolves outside the {what} {folder} (to {target.resolve()}, through a "
                              "link); refusing to use it")
    if must_exist and not target.is_file():
        raise CheckpointError(f"{target}: missing from the {what}")
    return target


def read_json(path: Union[str, Path], max_bytes: int, what: str, error: Type[Exception] = CheckpointError) -> Any:
    """The parsed JSON file at ``path``; a file over ``max_bytes`` (``what`` names what it should be), unreadable,
    invalid or nested too deeply to parse is an ``error`` naming the file (the size is checked before a byte is read).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "cfg.json"
        >>> _ = path.write_text('{"d_in": 2}')
        >>> read_json(path, max_bytes=1024, what="an SAE config")
        {'d_in': 2}
        >>> _ = path.write_text("[" * 100_000 + "]" * 100_000)
        >>> read_json(path, max_bytes=1024, what="an SAE config")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: .../cfg.json: 200000 bytes, more than an SAE config's 1024; refusing to read it
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size} bytes, more than {what}'s {max_bytes}; refusing to read it")
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise error(f"{path}: not a readable JSON file (nested too deeply to parse)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as problem:
        raise error(f"{path}: not a readable JSON file ({problem})") from None


def save_files(folder: Union[str, Path], writers: Mapping[str, Writer], what: str = "folder") -> Path:
    """Writes each ``name -> writer(path)`` into ``folder`` (created if missing) so that a failure leaves it as it was.

    Every file is first written under a temporary name beside its final one; only when all are written are they
    renamed into place (``os.replace``, atomic per file). A failed writer removes every temporary and re-raises;
    the folder's previous files are untouched. A name that leaves the folder, and a final name that is a symbolic
    link (a save never writes through a link), are refused before anything is written.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = save_files(folder, {"a.txt": lambda path: path.write_text("old")})
        >>> def broken(path):
        ...     path.write_text("half")
        ...     raise OSError("disk full")
        >>> save_files(folder, {"a.txt": lambda path: path.write_text("new"), "b.txt": broken})
        Traceback (most recent call last):
        OSError: disk full
        >>> (folder / "a.txt").read_text(), sorted(p.name for p in folder.iterdir())
        ('old', ['a.txt'])
    """
    folder = Path(folder)
    if folder.is_symlink():
        raise CheckpointError(f"{folder}: is a symbolic link; a {what} is saved into a real directory only")
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder}: exists and is not a directory")
    targets = {name: inside(folder, name, what=what) for name in writers}
    for target in targets.values():
        if target.is_symlink():
            raise CheckpointError(f"{target}: is a symbolic link; refusing to write through it")
    folder.mkdir(parents=True, exist_ok=True)
    temporaries: dict[str, Path] = {}
    try:
        for name, writer in writers.items():
            target = targets[name]
            target.parent.mkdir(parents=True, exist_ok=True)
            temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            temporaries[name] = temporary
            writer(temporary)
    except BaseException:
        for temporary in temporaries.values():
            temporary.unlink(missing_ok=True)
        raise
    for name, temporary in temporaries.items():
        os.replace(temporary, targets[name])
    return folder
