"""What a command reads and where it may write: the one file policy of every command
(rewrite-onnx, tune, calibrate, quality, bench, sweep, validate, genai-config).

**Inputs** (:class:`Inputs`) are everything a command reads: the model and its external data,
every file of an input folder (a genai folder; symlinks resolved: the link and its target both
count; a folder a link points to is an input as a whole, not walked), a config, a reference model
or folder, text, tokenizer, corpus. A command declares them before it writes anything.

**Outputs** (:class:`OutputFiles`) are files (model, report, JSON, plot) and folders (a genai
folder). Every output is checked when it is declared, before any slow work:

- it is not an input (same path, a symlink to one, or a hard link of one), does not lie inside an
  input folder and, for a folder, does not contain an input;
- an existing output file is a regular file (a directory, device, FIFO or socket is refused, also
  behind a symlink, so ``-o /dev/null`` never replaces the device); an existing output folder is
  empty or one the caller may replace (a genai folder ortsparse wrote); a folder output that is a
  symlink replaces the folder it points to (a dangling one is refused);
- two outputs are never the same path, and no output file lies inside an output folder (the folder
  is replaced as a whole);
- its directory exists (or can be made, ``create_dirs``) and is writable;
- a file output names a file: a path ending in ``/`` (``-o newdir/``) is refused rather than
  written as the file ``newdir``; a report *stem* naming a folder (``reports/``, ``.``, ``..``)
  means the command's default name inside it (:func:`resolve_report_stem`: ``-o reports/`` writes
  ``reports/bench.json``);
- an output folder is never the current directory or one holding it: it is replaced as a whole,
  which would leave the command (and the shell that started it) in a deleted folder.

Any OSError while checking, staging or moving (disk full, quota, a file too large, a name longer
than the file system allows) is a :class:`~.errors.ModelFileError` naming the output.

Outputs are staged beside their destination (hidden ``.ortsparse-rewrite-*`` folders, so the final
rename stays on one file system) and moved into place together by :meth:`OutputFiles.commit`,
which the command calls after every check that can fail; on an error, Ctrl-C, SIGTERM or SIGHUP the
staging is removed and no destination is touched. Folders get the user's umask. An output path that
is a symlink to a regular file is replaced by the new file (the link's target is left alone).
Violations raise :class:`~.errors.ModelFileError` (exit 2).

Use::

    inputs = Inputs().add_model(model).add(args.text, "the text")
    with OutputFiles(inputs) as outputs:
        out = outputs.add(args.output, "output")          # checked now
        report = outputs.add(args.report, "report")
        ...                                               # the slow part
        outputs.write_text(report, text)                  # staged
        outputs.commit()                                  # all in place, or none
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
_OLD_STAGING_PREFIXES = (STAGING_PREFIX, ".ortsparse-genai-")  # folders a running command stages in
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


def _inside(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies below it (both resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _identity(path: str | os.PathLike) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def external_data_files(model_file: str | os.PathLike) -> list[Path]:
    """The external data files an ONNX file names (initializers and tensor attributes, subgraphs
    too), resolved against its folder; [] when it cannot be read (its loader says why later)."""
    import onnx

    try:
        proto = onnx.load(os.fspath(model_file), load_external_data=False)
    except Exception:  # noqa: BLE001 - protobuf raises many types; the command's own load reports it
        return []
    # Beside the model, and beside its target when it is a symlink (the Hugging Face cache layout).
    folders = dict.fromkeys([Path(model_file).absolute().parent, Path(os.path.realpath(model_file)).parent])
    found: list[Path] = []

    def tensor(t) -> None:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in t.external_data if e.key == "location"), "")
            if location:
                found.extend(folder / location for folder in folders)

    def graph(g) -> None:
        for t in g.initializer:
            tensor(t)
        for node in g.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    tensor(attribute.t)
                for t in attribute.tensors:
                    tensor(t)
                if attribute.HasField("g"):
                    graph(attribute.g)
                for sub in attribute.graphs:
                    graph(sub)

    graph(proto.graph)
    return list(dict.fromkeys(found))


Protected = Mapping[str | os.PathLike, str] | Iterable[str | os.PathLike]


class Inputs:
    """Everything a command reads (see the module rules). ``add`` takes a file or a folder; a
    folder counts with every file below it, symlinks resolved (a link's target outside the folder
    is an input too); an ``.onnx`` file counts with its external data. None / "" are skipped, so
    optional flags can be passed as they are."""

    def __init__(self, described: Protected | Inputs = ()) -> None:
        self.files: dict[str, str] = {}  # resolved path -> description
        self.identities: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) -> description: hard links
        self.folders: dict[str, str] = {}  # resolved path -> description
        if isinstance(described, Inputs):
            self.files, self.identities, self.folders = (dict(described.files), dict(described.identities),
                                                         dict(described.folders))
        elif isinstance(described, Mapping):
            for path, text in described.items():
                self.add(path, text)
        else:
            for path in described:
                self.add(path, f"the input {path}" if path else "")

    def add(self, path: str | os.PathLike | None, description: str) -> Inputs:
        """A file (an ``.onnx`` one with its external data) or a folder (every file below it)."""
        if path is None or os.fspath(path) == "":
            return self
        if os.path.isdir(path):
            return self.add_folder(path, description)
        self.add_file(path, description)
        if os.fspath(path).endswith(".onnx") and os.path.isfile(path):
            for data in external_data_files(path):
                self.add_file(data, f"{description}'s external data" if description.startswith("the ")
                              else f"the external data of {description}")
        return self

    def add_model(self, path: str | os.PathLike | None, description: str = "the input model") -> Inputs:
        """A model file with its external data, or a model folder (a genai folder): :meth:`add`."""
        if path is not None and os.fspath(path) != "" and os.path.isdir(path):
            return self.add_folder(path, description if description.endswith("folder") else f"{description} folder")
        return self.add(path, description)

    def add_file(self, path: str | os.PathLike, description: str) -> Inputs:
        self.files.setdefault(os.path.realpath(path), description)
        if (identity := _identity(path)) is not None:
            self.identities.setdefault(identity, description)
        return self

    def add_folder(self, path: str | os.PathLike, description: str) -> Inputs:
        """The folder and every file below it; a symlink below it counts with its target. A
        folder a link points to outside is an input folder as a whole (nothing may be written in
        it) but is not walked: it may be anything (``/``, ``/usr``, another user's home), and a
        command reads only what the folder's own files name. A link that cannot be resolved
        (a loop, a component we may not read) is skipped: no command reads through it."""
        real = os.path.realpath(path)
        if any(_inside(real, folder) for folder in self.folders):
            self.folders.setdefault(real, description)
            return self
        self.folders[real] = description
        for root, dirs, files in os.walk(real):  # symlinked folders are listed in dirs, not entered
            dirs[:] = [d for d in dirs if not d.startswith(_OLD_STAGING_PREFIXES)]
            for name in [*files, *dirs]:
                entry = os.path.join(root, name)
                if os.path.islink(entry):
                    try:
                        target = os.path.realpath(entry, strict=True)
                    except OSError:
                        continue
                    through = f"{description} (through the link {entry})"
                    if os.path.isdir(target):
                        if not _inside(target, real):
                            self.folders.setdefault(target, through)
                    else:
                        self.add_file(target, through)
                elif name in files and (identity := _identity(entry)) is not None:
                    self.identities.setdefault(identity, f"a file of {description} {real}")  # its hard links
        return self

    def describe(self, path: str | os.PathLike) -> tuple[str, str] | None:
        """(relation, description) when writing ``path`` (a file) would touch an input: ``is`` an
        input file, or lies ``inside`` an input folder; None otherwise."""
        candidates = {os.path.realpath(path),  # where a symlink points
                      os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))),
                                   os.path.basename(path))}  # where the replacing rename lands
        for folder, description in self.folders.items():
            if any(c == folder for c in candidates):
                return "is", description
            if any(_inside(c, folder) for c in candidates):
                return "inside", f"{description} {folder}"
        for candidate in candidates:
            if candidate in self.files:
                return "is", self.files[candidate]
        if (identity := _identity(path)) is not None and identity in self.identities:
            return "is", self.identities[identity]
        return None

    def contained_in(self, folder: str) -> str | None:
        """The description of an input that lies inside the resolved ``folder``, if any."""
        for path, description in [*self.folders.items(), *self.files.items()]:
            if _inside(path, folder):
                return f"{description} {path}"
        return None


def _refuse_input(what: str, path: Path, relation: str, description: str) -> ModelFileError:
    where = f"is {description}" if relation == "is" else f"lies inside {description}"
    return ModelFileError(f"{what} {path} {where}, which is only read; write it elsewhere "
                          "(inputs are never modified)")


def _user_folder_mode() -> int:
    """The mode ``mkdir`` gives a folder under the current umask (mkdtemp's is 0700)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o777 & ~mask


def _missing_dirs(directory: Path) -> list[Path]:
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    return missing


def resolve_report_stem(stem: str | os.PathLike, default_name: str) -> str:
    """The stem of a command's report files (``STEM.json``, ``STEM.md``...) for the ``stem`` the
    user gave: as given, unless it names a folder (ends with ``/``, or is ``.`` / ``..``), which
    means ``default_name`` inside that folder (``-o reports/`` -> ``reports/bench``)."""
    text = os.fspath(stem)
    if text.endswith((os.sep, os.altsep or os.sep)) or os.path.basename(text) in ("", ".", ".."):
        return os.path.join(text, default_name)
    return text


def check_output_path(path: str | os.PathLike, *, what: str = "output", protected: Protected | Inputs = (),
                      create_dirs: bool = False) -> Path:
    """The absolute ``path`` if a command may write the file ``what`` there (see the module rules).
    ``create_dirs``: a missing directory is fine if it can be made (its nearest existing ancestor
    is a writable directory); :meth:`OutputFiles.staged` then makes it."""
    inputs = protected if isinstance(protected, Inputs) else Inputs(protected)
    given = os.fspath(path)
    if given.endswith((os.sep, os.altsep or os.sep)):  # abspath would drop the slash and write a file there
        raise ModelFileError(f"{what} {given} names a folder (it ends with '{given[-1]}'); give the path of a file "
                             "(in that folder, or without the slash)")
    path = Path(os.path.abspath(given))
    if (found := inputs.describe(path)) is not None:
        raise _refuse_input(what, path, *found)
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


def _current_directory() -> str | None:
    try:
        return os.path.realpath(os.getcwd())
    except OSError:  # already deleted: nothing to protect
        return None


def _empty_folder(folder: Path) -> bool:
    return not any(folder.iterdir())


def check_output_folder(path: str | os.PathLike, *, what: str = "output", protected: Protected | Inputs = (),
                        replaceable: Callable[[Path], bool] = _empty_folder) -> Path:
    """The resolved folder a command may write (replace as a whole) for ``path``: not an input,
    not inside an input folder, not containing an input; an existing folder must pass
    ``replaceable`` (default: empty). A symlink to a folder means that folder."""
    inputs = protected if isinstance(protected, Inputs) else Inputs(protected)
    given = Path(os.path.abspath(os.fspath(path)))
    try:
        os.lstat(given)  # a name too long, a component we may not search: said here, once
    except FileNotFoundError:
        pass
    except OSError as error:
        raise ModelFileError(f"cannot check {what} {given}: {error.strerror or error}") from None
    if given.is_symlink() and not given.exists():
        raise ModelFileError(f"{what} {given} is a symlink to {os.readlink(given)}, which does not exist; "
                             "give a folder path")
    folder = Path(os.path.realpath(given))
    if (found := inputs.describe(folder)) is not None:
        raise _refuse_input(what, given, *found)
    if (inner := inputs.contained_in(str(folder))) is not None:
        raise ModelFileError(f"{what} {given} contains {inner}, which is only read; choose another folder "
                             "(inputs are never modified)")
    if folder.exists() and (cwd := _current_directory()) is not None and _inside(cwd, str(folder)):
        raise ModelFileError(f"{what} {given} is the current directory (or holds it) and would be replaced as a "
                             "whole, leaving this shell in a deleted folder; run from another directory and name "
                             "the folder there")
    if folder.exists() and not (folder.is_dir() and replaceable(folder)):
        kind = "a file" if not folder.is_dir() else "a folder not written by ortsparse"
        raise ModelFileError(f"{what} {given} exists and is {kind}; give a new folder (or one ortsparse wrote)")
    parent = folder.parent
    if not parent.is_dir():
        raise ModelFileError(f"{what} directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ModelFileError(f"{what} directory {parent} is not writable")
    return folder


class OutputFiles:
    """The files and folders one command writes, staged and then moved into place together.

    ``inputs``: what the command reads (:class:`Inputs`, or ``{path: description}`` / paths).
    Use as a context manager: :meth:`commit` inside; leaving without commit (an error, a signal)
    removes everything staged. Declaring the same path twice with the same ``what`` returns the
    first declaration (a library function may declare what its caller already checked).
    """

    def __init__(self, inputs: Protected | Inputs = ()) -> None:
        self.inputs = inputs if isinstance(inputs, Inputs) else Inputs(inputs)
        self._outputs: list[tuple[Path, str, bool]] = []  # destination, what, is a folder
        self._staging: dict[Path, Path] = {}  # destination directory -> its staging folder
        self._folders: dict[Path, Path] = {}  # destination folder -> its staged folder
        self._made_dirs: list[Path] = []

    def read(self, path: str | os.PathLike | Inputs | None, description: str = "") -> None:
        """Adds an input found later (e.g. external data found after loading the model), or all of
        an :class:`Inputs`; an output declared before that is this input is refused."""
        if path is None:
            return
        if isinstance(path, Inputs):
            for mine, theirs in ((self.inputs.files, path.files), (self.inputs.identities, path.identities),
                                 (self.inputs.folders, path.folders)):
                for key, text in theirs.items():
                    mine.setdefault(key, text)
        else:
            self.inputs.add(path, description)
        for output, what, is_folder in self._outputs:
            if is_folder:
                check_output_folder(output, what=what, protected=self.inputs, replaceable=lambda _: True)
            else:
                check_output_path(output, what=what, protected=self.inputs, create_dirs=True)

    protect = read  # the older name

    def _against_outputs(self, destination: Path, what: str, is_folder: bool) -> Path | None:
        real = os.path.realpath(destination)
        for other, other_what, other_is_folder in self._outputs:
            other_real = os.path.realpath(other)
            if (other_real == real or same_file(other, destination)) and other_what == what \
                    and other_is_folder == is_folder:
                return other
            if other_real == real or same_file(other, destination):
                raise ModelFileError(f"{what} {destination} is the same file as the {other_what}; "
                                     "give each output its own path")
            if other_is_folder and _inside(real, other_real):
                raise ModelFileError(f"{what} {destination} lies inside the {other_what} folder {other}, which "
                                     "is replaced as a whole; write it elsewhere")
            if is_folder and _inside(other_real, real):
                raise ModelFileError(f"{other_what} {other} lies inside the {what} folder {destination}, which "
                                     "is replaced as a whole; write it elsewhere")
        return None

    def add(self, path: str | os.PathLike, what: str = "output", *, create_dirs: bool = False,
            first: bool = False) -> Path:
        """Checks the output file ``path`` and reserves it; returns the absolute destination.
        ``create_dirs``: a missing directory is made when the file is staged. ``first``: moved into
        place before the outputs declared earlier (a model's external data before the model)."""
        if (earlier := self._against_outputs(Path(os.path.abspath(os.fspath(path))), what, False)) is not None:
            return earlier
        destination = check_output_path(path, what=what, protected=self.inputs, create_dirs=create_dirs)
        self._outputs.insert(0 if first else len(self._outputs), (destination, what, False))
        return destination

    def add_folder(self, path: str | os.PathLike, what: str = "output", *,
                   replaceable: Callable[[Path], bool] = _empty_folder) -> Path:
        """Checks the output folder ``path`` (replaced as a whole: :func:`check_output_folder`)
        and reserves it; returns the resolved destination. Fill :meth:`staged` (destination)."""
        if (earlier := self._against_outputs(Path(os.path.realpath(path)), what, True)) is not None:
            return earlier
        destination = check_output_folder(path, what=what, protected=self.inputs, replaceable=replaceable)
        self._outputs.append((destination, what, True))
        return destination

    def staged(self, destination: Path) -> Path:
        """Where to write ``destination`` (added before) until :meth:`commit`: a file in a staging
        folder beside it, or, for an output folder, the (empty) staging folder itself."""
        folder = any(d == destination and is_folder for d, _, is_folder in self._outputs)
        directory = destination.parent
        if folder and destination in self._folders:
            return self._folders[destination]
        if not folder and directory in self._staging:
            return self._staging[directory] / destination.name
        missing = _missing_dirs(directory)
        try:
            if missing:
                directory.mkdir(parents=True, exist_ok=True)
                self._made_dirs.extend(missing)
            staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory))
        except OSError as error:
            raise ModelFileError(f"cannot write into {directory}: {error.strerror or error}") from None
        if folder:
            self._folders[destination] = staging
            return staging
        self._staging[directory] = staging
        return staging / destination.name

    @staticmethod
    @contextlib.contextmanager
    def writing(destination: Path) -> Iterator[None]:
        """Around code that fills the staging of ``destination``: an OSError (disk full, quota, a
        file too large, a name too long) becomes a one-line ModelFileError naming it."""
        try:
            yield
        except OSError as error:
            raise ModelFileError(f"cannot write {destination}: {error.strerror or error}") from None

    def write(self, destination: Path, write: Callable[[Path], None]) -> None:
        """Calls ``write(staged_path)``; an OSError becomes a one-line ModelFileError."""
        with self.writing(destination):
            write(self.staged(destination))

    def write_text(self, destination: Path, text: str) -> None:
        self.write(destination, lambda staged: staged.write_text(text, encoding="utf-8"))

    def commit(self) -> None:
        """Moves everything staged into place, in the order declared, with SIGINT/SIGTERM/SIGHUP
        held back so the renames are not split. An existing output folder is moved aside, the new
        one renamed in, and the old one removed at the end."""
        blocked = {signal.SIGINT, *_STOP_SIGNALS}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked) if hasattr(signal, "pthread_sigmask") else None
        replaced: list[Path] = []
        try:
            for destination, what, is_folder in self._outputs:
                try:
                    if is_folder:
                        if (staged := self._folders.get(destination)) is not None:
                            os.chmod(staged, _user_folder_mode())  # mkdtemp made it 0700
                            replaced += self._replace_folder(staged, destination)
                            del self._folders[destination]
                        continue
                    folder = self._staging.get(destination.parent)
                    if folder is None or not (folder / destination.name).is_file():
                        continue  # declared but not produced (e.g. external data that was not needed)
                    os.replace(folder / destination.name, destination)
                except OSError as error:
                    raise ModelFileError(f"cannot move the {what} into {destination}: "
                                         f"{error.strerror or error}") from None
            self._made_dirs.clear()  # they hold outputs now
        finally:
            if previous is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            for old in replaced:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def _replace_folder(staged: Path, destination: Path) -> list[Path]:
        """Rename ``staged`` onto ``destination``; an existing folder is moved aside first (a reader
        never sees a half folder) and returned, to be removed."""
        if not destination.exists():
            os.replace(staged, destination)
            return []
        aside = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}old-", dir=destination.parent))
        os.rmdir(aside)
        os.replace(destination, aside)
        try:
            os.replace(staged, destination)
        except BaseException:
            os.replace(aside, destination)
            raise
        return [aside]

    def discard(self) -> None:
        for folder in [*self._staging.values(), *self._folders.values()]:
            shutil.rmtree(folder, ignore_errors=True)
        self._staging.clear()
        self._folders.clear()
        for directory in self._made_dirs:  # innermost first
            with contextlib.suppress(OSError):
                directory.rmdir()
        self._made_dirs.clear()

    def __enter__(self) -> OutputFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


def check_outputs(outputs: Iterable[tuple[str | os.PathLike | None, str]] | Mapping[str, str],
                  protected: Protected | Inputs = (), *, create_dirs: bool = False) -> None:
    """Checks ``(path, what)`` pairs (None paths skipped; pairs, not a dict, so two flags naming
    the same file are both seen) before a long run, so a bad ``-o`` fails in seconds rather than
    after it; the writes check again."""
    reserved = OutputFiles(protected)
    for path, what in (outputs.items() if isinstance(outputs, Mapping) else outputs):
        if path is not None:
            reserved.add(path, what, create_dirs=create_dirs)


def write_files(files: Mapping[str | os.PathLike, tuple[str, Callable[[Path], None]]],
                protected: Protected | Inputs = (), *, create_dirs: bool = False) -> None:
    """``{path: (what, write)}``: checks every path, calls ``write(staged_path)`` for each, then
    moves them into place together (all or none)."""
    with OutputFiles(protected) as outputs:
        staged = [(outputs.add(path, what, create_dirs=create_dirs), write) for path, (what, write) in files.items()]
        for destination, write in staged:
            outputs.write(destination, write)
        outputs.commit()


def write_text_files(files: Mapping[str | os.PathLike, tuple[str, str]], protected: Protected | Inputs = (), *,
                     create_dirs: bool = False) -> None:
    """``{path: (what, text)}`` written as :func:`write_files` does."""
    write_files({path: (what, lambda staged, text=text: staged.write_text(text, encoding="utf-8"))
                 for path, (what, text) in files.items()}, protected, create_dirs=create_dirs)
