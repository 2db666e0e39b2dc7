"""Where the command line may write, and how: every output file is checked before anything is
written, staged next to its destination, and moved into place together with the command's other
outputs — or not at all.

Rules (every subcommand's ``-o``/``--report``/``--json``... goes through :class:`OutputFiles`):

- an output never is, links to, or is a hard link of a file the command reads (the input model, its
  external data, a config file): refused, the input is never modified;
- an existing output must be a regular file: a directory, character/block device, FIFO or socket
  (also behind a symlink) is refused, so ``-o /dev/null`` never replaces the device;
- two outputs of one command must not be the same file;
- the directory must exist and be writable;
- files are staged in a hidden ``.ortsparse-rewrite-*`` folder in the destination's directory and
  renamed into place at the end (a rename within one directory is atomic); on an error, Ctrl-C,
  SIGTERM or SIGHUP the staging folders are removed and no destination is touched.

An output path that is a symlink to a regular file is replaced by the new file (the link's target
is left alone). Violations raise :class:`~.errors.ModelFileError` (exit 2).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from .errors import ModelFileError

STAGING_PREFIX = ".ortsparse-rewrite-"
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Terminated(BaseException):
    """SIGTERM / SIGHUP arrived: unwinds like KeyboardInterrupt so staging folders are removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """While active (main thread only), SIGTERM and SIGHUP raise :class:`Terminated` instead of
    killing the process at once, so ``finally`` blocks run. A second signal kills as usual."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        raise Terminated(signum)

    previous = {s: signal.signal(s, handler) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _describe_kind(mode: int) -> str | None:
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")]
    for test, text in kinds:
        if test(mode):
            return text
    return None if stat.S_ISREG(mode) else "not a regular file"


def same_file(a: Path, b: Path) -> bool:
    """True if ``a`` and ``b`` name the same file: the same resolved path or the same inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


Protected = Mapping[str | os.PathLike, str] | Iterable[str | os.PathLike]


def _described(protected: Protected) -> dict[Path, str]:
    """{file the command reads: how to name it in an error}."""
    if isinstance(protected, Mapping):
        return {Path(p): text for p, text in protected.items() if p}
    return {Path(p): f"the input {p}" for p in protected if p}


def _refuse_alias(what: str, path: Path, description: str) -> ModelFileError:
    return ModelFileError(f"{what} {path} is {description}, which is only read; write it elsewhere "
                          "(inputs are never modified)")


def check_output_path(path: str | os.PathLike, *, what: str = "output", protected: Protected = (),
                      create_dirs: bool = False) -> Path:
    """The absolute ``path`` if a command may write ``what`` there (see the module rules).
    ``create_dirs``: a missing directory is fine if it can be made (its nearest existing ancestor
    is a writable directory); :meth:`OutputFiles.add` then makes it."""
    path = Path(os.path.abspath(os.fspath(path)))
    for source, description in _described(protected).items():
        if same_file(path, source):
            raise _refuse_alias(what, path, description)
    try:
        mode = os.stat(path).st_mode  # follows a symlink: a link to /dev/null is refused too
    except FileNotFoundError:
        mode = None
    except OSError as error:
        raise ModelFileError(f"cannot check {what} {path}: {error.strerror or error}") from None
    if mode is not None and (kind := _describe_kind(mode)):
        raise ModelFileError(f"{what} {path} is {kind}; only a regular file can be written")
    directory = path.parent
    if create_dirs:
        while not directory.exists() and directory != directory.parent:
            directory = directory.parent
    if not directory.is_dir():
        raise ModelFileError(f"{what} directory {directory} does not exist" if not directory.exists()
                             else f"{what} directory {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ModelFileError(f"{what} directory {directory} is not writable")
    return path


class OutputFiles:
    """The files one command writes, staged and then moved into place together.

    ``protected``: what the command reads (path -> description, e.g. ``"the input model"``).
    Use as a context manager: :meth:`commit` inside; leaving without commit (an error, a signal)
    removes every staged file.
    """

    def __init__(self, protected: Protected = ()) -> None:
        self._protected = _described(protected)
        self._outputs: list[tuple[Path, str]] = []
        self._staging: dict[Path, Path] = {}  # destination directory -> its staging folder

    def protect(self, path: str | os.PathLike, description: str) -> None:
        """Adds a file the command reads (e.g. external data found after loading the model)."""
        path = Path(path)
        for output, what in self._outputs:
            if same_file(output, path):
                raise _refuse_alias(what, output, description)
        self._protected[path] = description

    def add(self, path: str | os.PathLike, what: str = "output", *, create_dirs: bool = False) -> Path:
        """Checks ``path`` and reserves it; returns the absolute destination. ``create_dirs``:
        make a missing directory (reports under ``reports/``)."""
        destination = check_output_path(path, what=what, protected=self._protected, create_dirs=create_dirs)
        if create_dirs and not destination.parent.is_dir():
            try:
                destination.parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise ModelFileError(f"cannot create {what} directory {destination.parent}: "
                                     f"{error.strerror or error}") from None
        for other, other_what in self._outputs:
            if same_file(destination, other):
                raise ModelFileError(f"{what} {destination} is the same file as the {other_what}; "
                                     "give each output its own path")
        self._outputs.append((destination, what))
        return destination

    def staged(self, destination: Path) -> Path:
        """Where to write ``destination`` (added before) until :meth:`commit`."""
        directory = destination.parent
        if directory not in self._staging:
            try:
                self._staging[directory] = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory))
            except OSError as error:
                raise ModelFileError(f"cannot write into {directory}: {error.strerror or error}") from None
        return self._staging[directory] / destination.name

    def write(self, destination: Path, write: Callable[[Path], None]) -> None:
        """Calls ``write(staged_path)``; an OSError becomes a one-line ModelFileError."""
        try:
            write(self.staged(destination))
        except OSError as error:
            raise ModelFileError(f"cannot write {destination}: {error.strerror or error}") from None

    def write_text(self, destination: Path, text: str) -> None:
        self.write(destination, lambda staged: staged.write_text(text, encoding="utf-8"))

    def commit(self) -> None:
        """Moves every staged file into place, in the order they were added, with SIGINT/SIGTERM/
        SIGHUP held back so the renames are not split."""
        blocked = {signal.SIGINT, *_STOP_SIGNALS}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked) if hasattr(signal, "pthread_sigmask") else None
        try:
            for destination, what in self._outputs:
                folder = self._staging.get(destination.parent)
                if folder is None or not (folder / destination.name).is_file():
                    continue  # declared but not produced (e.g. external data that was not needed)
                staged = folder / destination.name
                try:
                    os.replace(staged, destination)
                except OSError as error:
                    raise ModelFileError(f"cannot move the {what} into {destination}: "
                                         f"{error.strerror or error}") from None
        finally:
            if previous is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def discard(self) -> None:
        for folder in self._staging.values():
            shutil.rmtree(folder, ignore_errors=True)
        self._staging.clear()

    def __enter__(self) -> OutputFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


def check_outputs(outputs: Iterable[tuple[str | os.PathLike | None, str]] | Mapping[str, str],
                  protected: Protected = (), *, create_dirs: bool = False) -> None:
    """Checks ``(path, what)`` pairs (None paths skipped; pairs, not a dict, so two flags naming
    the same file are both seen) before a long run, so a bad ``-o`` fails in seconds rather than
    after it; the writes check again."""
    seen: list[tuple[Path, str]] = []
    for path, what in (outputs.items() if isinstance(outputs, Mapping) else outputs):
        if path is None:
            continue
        destination = check_output_path(path, what=what, protected=protected, create_dirs=create_dirs)
        for other, other_what in seen:
            if same_file(destination, other):
                raise ModelFileError(f"{what} {destination} is the same file as the {other_what}; "
                                     "give each output its own path")
        seen.append((destination, what))


def write_files(files: Mapping[str | os.PathLike, tuple[str, Callable[[Path], None]]], protected: Protected = (), *,
                create_dirs: bool = False) -> None:
    """``{path: (what, write)}``: checks every path, calls ``write(staged_path)`` for each, then
    moves them into place together (all or none)."""
    with OutputFiles(protected) as outputs:
        staged = [(outputs.add(path, what, create_dirs=create_dirs), write) for path, (what, write) in files.items()]
        for destination, write in staged:
            outputs.write(destination, write)
        outputs.commit()


def write_text_files(files: Mapping[str | os.PathLike, tuple[str, str]], protected: Protected = (), *,
                     create_dirs: bool = False) -> None:
    """``{path: (what, text)}`` written as :func:`write_files` does."""
    write_files({path: (what, lambda staged, text=text: staged.write_text(text, encoding="utf-8"))
                 for path, (what, text) in files.items()}, protected, create_dirs=create_dirs)
