"""The filesystem half of ``corral create``: find the Modelfile, resolve FROM/ADAPTER paths, hash files.

``modelfile`` stays pure (text in, values out); everything here touches the disk. A FROM value that names an
existing path (absolute, ``~``-expanded, or relative to the Modelfile's directory) is a local artifact; anything
else is a model name for the daemon to resolve.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cli.errors import LocalFileError
from registry.digest import Digest

CHUNK = 1024 * 1024
DEFAULT_MODELFILE = "Modelfile"
IMPLICIT_MODELFILE = b"FROM .\n"
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what the daemon reads (registry/gguf.py)
TAKES = {
    "FROM": "FROM takes a .gguf file, a directory of them, or a model name",
    "ADAPTER": "ADAPTER takes a .gguf file or a directory of them",
}


@dataclass(frozen=True)
class ModelfileSource:
    """The Modelfile's bytes, the name to report errors under, and the directory its paths are relative to."""

    data: bytes
    filename: str
    base_dir: Path
    implicit: bool = False  # no Modelfile was found: this is ``FROM .``


def read_modelfile(given: str | None, cwd: Path | None = None) -> ModelfileSource:
    """Read ``-f given``; with no ``-f`` and no ``./Modelfile``, behave as ``FROM .`` in ``cwd``."""
    cwd = cwd or Path.cwd()
    if given is None:
        path = cwd / DEFAULT_MODELFILE
        if not path.exists():
            return ModelfileSource(IMPLICIT_MODELFILE, DEFAULT_MODELFILE, cwd, implicit=True)
        filename = DEFAULT_MODELFILE
    else:
        path = Path(given).expanduser()
        if not path.is_absolute():
            path = cwd / path
        if not path.exists():
            raise LocalFileError(f'Modelfile "{given}" not found')
        filename = given
    if path.is_dir():
        raise LocalFileError(f'Modelfile "{filename}" is a directory; name the file with -f')
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LocalFileError(f'cannot read Modelfile "{filename}": {exc.strerror or exc}') from exc
    return ModelfileSource(data, filename, path.resolve().parent)


def resolve_path(value: str, base_dir: Path) -> Path:
    """``value`` as a path: ``~`` expanded, absolute kept, otherwise relative to ``base_dir``."""
    p = Path(os.path.expanduser(value))
    return p if p.is_absolute() else base_dir / p


def resolve_from(value: str, base_dir: Path) -> Path | None:
    """The local path a FROM names, or None when it names no existing path (it is then a model name)."""
    p = resolve_path(value, base_dir)
    return p if p.exists() else None


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def model_files(path: Path, what: str = "FROM") -> list[Path]:
    """The GGUF files a path stands for: the file itself, or a directory's ``*.gguf`` (else GGUF ``*.bin``)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        check_model_file(path, what)  # a FIFO, a device or a socket: says which
        raise LocalFileError(f'{what} "{path}" is neither a file nor a directory')
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if not found:
        found = sorted(p for p in path.glob("*.bin") if p.is_file() and _is_gguf(p))
    if not found:
        hint = ""
        if any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
            hint = "; corral imports GGUF only: convert the weights with llama.cpp's convert_hf_to_gguf.py"
        raise LocalFileError(f'no GGUF files found in "{path}"{hint}')
    return found


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def check_model_file(path: Path, what: str = "FROM") -> None:
    """Refuse, before anything is hashed or uploaded, a FROM/ADAPTER file that is not a GGUF model file.

    It must be a regular file (symbolic links are followed, as a Hugging Face cache needs; a FIFO, a device such as
    ``/dev/random`` or a socket is refused without reading from it) that starts with the GGUF magic and a version
    corral reads. The daemon checks the whole header again when the model is created.
    """
    takes = TAKES.get(what, TAKES["FROM"])
    try:
        st = path.stat()
    except OSError as exc:
        raise LocalFileError(f'cannot read "{path}": {exc.strerror or exc}') from exc
    if not stat.S_ISREG(st.st_mode):
        raise LocalFileError(f"{path} is not a regular file (it is {_kind(st.st_mode)}); {takes}")
    try:
        # O_NONBLOCK: should the path be swapped for a FIFO after the stat, opening it does not hang
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise LocalFileError(f'cannot read "{path}": {exc.strerror or exc}') from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LocalFileError(f"{path} is not a regular file (it is {_kind(st.st_mode)}); {takes}")
        head = os.pread(fd, 8, 0)
    except OSError as exc:
        raise LocalFileError(f'cannot read "{path}": {exc.strerror or exc}') from exc
    finally:
        os.close(fd)
    if head[:4] != GGUF_MAGIC:
        raise LocalFileError(f"{path} is not a GGUF model file (it does not start with the GGUF magic); {takes}")
    if len(head) < 8:
        raise LocalFileError(f"{path} is not a GGUF model file (it ends before the GGUF version); {takes}")
    version = struct.unpack("<I", head[4:8])[0]
    if version not in GGUF_VERSIONS:
        if struct.unpack(">I", head[4:8])[0] in GGUF_VERSIONS:
            detail = "a big-endian GGUF; corral reads little-endian files only"
        else:
            detail = f"GGUF version {version}; corral reads versions 2 and 3"
        raise LocalFileError(f"{path} is not a GGUF model file ({detail}); {takes}")


def adapter_files(value: str, base_dir: Path) -> list[Path]:
    """ADAPTER paths must exist."""
    p = resolve_path(value, base_dir)
    if not p.exists():
        raise LocalFileError(f'ADAPTER "{value}" not found (looked for {p})')
    return model_files(p, "ADAPTER")


def hash_file(path: Path, progress: Callable[[int], None] | None = None) -> Digest:
    """SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                if progress is not None:
                    progress(len(chunk))
    except OSError as exc:
        raise LocalFileError(f'cannot read "{path}": {exc.strerror or exc}') from exc
    return Digest(h.hexdigest())


def files_map(paths: Iterable[Path], digests: dict[Path, Digest]) -> dict[str, str]:
    """``{basename: "sha256:<hex>"}``; two different files with one basename are an error."""
    out: dict[str, str] = {}
    for p in paths:
        d = str(digests[p])
        if out.get(p.name, d) != d:
            raise LocalFileError(f'two different files are both named "{p.name}"; rename one of them')
        out[p.name] = d
    return out
