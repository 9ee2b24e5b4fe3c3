"""The C library of ``inference/kernels/`` (:mod:`fairseq_ext.inference.amx_int8`): built with the system C compiler
on first use, cached, loaded once, or refused with one line that says why (the callers then keep PyTorch's ops).

``FAIRSEQ_EXT_NATIVE=0`` turns all of it off: nothing is compiled or loaded, and the ``amx-int8-*`` speed-ups are
refused with one line (read when a library is first needed in a process). ``CC`` picks the compiler (default ``cc``); a compiler that
has not finished after :data:`COMPILE_TIMEOUT_S` seconds is stopped (with everything it started) and the library
refused. ``FAIRSEQ_EXT_CACHE`` (default ``~/.cache/fairseq_ext``; without a home directory a new private
directory of the process, ``tempfile.mkdtemp``) holds the built libraries, each named by a hash of its source,
compiler and flags. A library found there is loaded, so what is loaded must be what this user built:

* every directory of the cache's path is opened with ``O_NOFOLLOW`` from its parent's descriptor: a symbolic link
  anywhere in the path is refused; each must belong to root or this user and be writable by no one else unless
  sticky (as ``/tmp``), the cache itself this user's, writable by no one else (created ``0700`` where missing);
* the library is opened with ``O_NOFOLLOW`` from the cache's descriptor and checked on that descriptor (a regular
  file of this user's, writable by no one else), and that descriptor is what is loaded (``/proc/self/fd/N``), so
  a file swapped in after the check is never the one loaded.

Linux only (``/proc``). Not covered: root, and this user's own processes, can change anything in the cache; the
compiler and its flags are trusted as ``CC`` and the system give them.
"""

import atexit
import ctypes
import errno
import hashlib
import logging
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from fairseq_ext.errors import FairseqExtError

logger = logging.getLogger(__name__)

SWITCH = "FAIRSEQ_EXT_NATIVE"
COMPILE_TIMEOUT_S = 120  # seconds a compiler may take (each kernel takes a few seconds on a busy core)
_private_cache: Optional[Path] = None  # the process's own cache where there is no home directory


def switched_off() -> Optional[str]:
    """The refusal when ``FAIRSEQ_EXT_NATIVE=0``, else None."""
    if os.environ.get(SWITCH, "").strip() == "0":
        return f"native code turned off by {SWITCH}=0"
    return None


def cpu_flags() -> List[str]:
    """The CPU's feature flags (/proc/cpuinfo); FairseqExtError with the reason where they cannot be read."""
    if sys.platform != "linux" or not hasattr(os, "sched_getaffinity"):
        raise FairseqExtError(f"it runs on Linux only (this is {sys.platform})")
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError as e:
        raise FairseqExtError(f"/proc/cpuinfo cannot be read ({e})")


def cache_dir() -> Path:
    """``FAIRSEQ_EXT_CACHE``, else ``~/.cache/fairseq_ext``, else (no home directory) this process's own
    ``mkdtemp`` directory, removed at exit (a name in /tmp that another user could create first is never used)."""
    global _private_cache
    cache = os.environ.get("FAIRSEQ_EXT_CACHE")
    if cache:
        return Path(cache)
    try:
        return Path.home() / ".cache" / "fairseq_ext"
    except (RuntimeError, KeyError):  # no home directory (some CI and container users)
        if _private_cache is None:
            _private_cache = Path(tempfile.mkdtemp(prefix="fairseq_ext-"))
            atexit.register(shutil.rmtree, str(_private_cache), True)
        return _private_cache


def _refuse(path, why) -> FairseqExtError:
    return FairseqExtError(f"{path} {why}; set FAIRSEQ_EXT_CACHE to a directory of this user's alone")


def open_private_dir(path: Path) -> int:
    """A descriptor of the directory ``path``, made (``0700``) where missing, after the checks of the module
    docstring on every component; FairseqExtError naming the component that fails them."""
    uid, flags = os.getuid(), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    parts = Path(os.path.abspath(path)).parts
    fd = os.open(parts[0], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, name in enumerate(parts[1:], 2):
            where, last = Path(*parts[:i]), i == len(parts)
            try:
                try:
                    sub = os.open(name, flags, dir_fd=fd)
                except FileNotFoundError:
                    try:
                        os.mkdir(name, 0o700, dir_fd=fd)
                    except FileExistsError:  # made meanwhile by another process: checked below like any
                        pass
                    sub = os.open(name, flags, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(where):
                    raise _refuse(where, "is a symbolic link (the cache's path may hold none)") from None
                raise FairseqExtError(f"cannot use {where} as the cache of built kernels ({e}); "
                                      "set FAIRSEQ_EXT_CACHE") from None
            os.close(fd)
            fd = sub
            st = os.fstat(fd)
            if last and (st.st_uid != uid or st.st_mode & 0o022):
                raise _refuse(where, f"is not a directory of this user's alone (owner uid {st.st_uid}, mode "
                                     f"{stat.S_IMODE(st.st_mode):o})")
            if not last and (st.st_uid not in (0, uid) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX)):
                raise _refuse(where, f"could be changed by another user (owner uid {st.st_uid}, mode "
                                     f"{stat.S_IMODE(st.st_mode):o})")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_library(dir_fd: int, name: str, where: Path) -> Optional[int]:
    """A descriptor of the library ``name`` in the directory ``dir_fd`` after checking it on that descriptor, or
    None where there is none."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(where / name, "is a symbolic link, not a library built here") from None
        raise FairseqExtError(f"cannot open the built kernel {where / name} ({e}); set FAIRSEQ_EXT_CACHE") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        os.close(fd)
        raise _refuse(where / name, f"is not a file of this user's alone (owner uid {st.st_uid}, mode "
                                    f"{stat.S_IMODE(st.st_mode):o}), so it is not loaded")
    return fd


def _compiler() -> Tuple[str, List[str]]:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise FairseqExtError("no C compiler found (set CC or install gcc >= 11)")
    return cc, shlex.split(cc)  # CC may carry a wrapper or flags ("ccache gcc")


def library_name(source: Path, cflags: List[str]) -> str:
    """The file name of the library built from ``source`` with ``cflags`` by the compiler of ``CC``."""
    _, command = _compiler()
    tag = hashlib.sha256(source.read_bytes() + " ".join(command + cflags).encode()).hexdigest()[:16]
    return f"{source.stem}-{tag}.so"


def _compile(command: List[str], cc: str, source: Path, cflags: List[str], out: str, needs: str):
    try:
        proc = subprocess.Popen([*command, *cflags, str(source), "-o", out], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as e:
        raise FairseqExtError(f"cannot run the C compiler {cc!r} ({e}); set CC")
    try:
        _, err = proc.communicate(timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the compiler and what it started (cc1, as, ld, a wrapper's child)
        except OSError:
            pass
        proc.communicate()
        raise FairseqExtError(f"{cc} did not build {source.name} within {COMPILE_TIMEOUT_S} s (stopped); "
                              f"set CC to a working compiler or {SWITCH}=0")
    if proc.returncode != 0:
        first = next((line for line in err.splitlines() if "error" in line), err.strip()[:200])
        raise FairseqExtError(f"{cc} could not build {source.name} ({needs}): {first}")


def build_fd(source: Path, cflags: List[str], needs: str) -> Tuple[int, Path]:
    """An open descriptor of the library compiled from ``source`` with ``cflags`` (on first use, cached) and its
    path, after the checks of the module docstring; ``needs`` (what the compiler must support) goes into the
    refusal of a failed build. The caller closes the descriptor."""
    off = switched_off()
    if off:
        raise FairseqExtError(off)
    cc, command = _compiler()
    cache = cache_dir()
    name = library_name(source, cflags)
    dir_fd = open_private_dir(cache)
    try:
        fd = _open_library(dir_fd, name, cache)
        if fd is not None:
            return fd, cache / name
        try:
            tmp_fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(tmp_fd)
        except OSError as e:
            raise FairseqExtError(f"cannot write the built kernel to {cache} ({e}); set FAIRSEQ_EXT_CACHE")
        try:
            _compile(command, cc, source, cflags, tmp, needs)
            # atomic: a concurrent build leaves one complete file
            os.replace(os.path.basename(tmp), name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        fd = _open_library(dir_fd, name, cache)
        if fd is None:
            raise FairseqExtError(f"the built kernel {cache / name} vanished; set FAIRSEQ_EXT_CACHE")
        return fd, cache / name
    finally:
        os.close(dir_fd)


def build(source: Path, cflags: List[str], needs: str) -> Path:
    """The path of the library compiled from ``source`` with ``cflags`` (:func:`build_fd`, which loaders use)."""
    fd, path = build_fd(source, cflags, needs)
    os.close(fd)
    return path


def load_fd(fd: int) -> ctypes.CDLL:
    """The library open on descriptor ``fd`` (what was checked is what is loaded). Keep ``fd`` open while the
    library is in use: the dynamic loader knows it by the name ``/proc/self/fd/N`` and would hand the same library
    back for a later file open under that number."""
    path = f"/proc/self/fd/{fd}"
    if not os.path.exists(path):
        raise FairseqExtError(f"a built kernel is loaded from its descriptor, which needs Linux's /proc ({path} "
                              f"is missing)")
    return ctypes.CDLL(path)


class NativeLibrary:
    """One C library: :meth:`load` builds and loads it once, or raises FairseqExtError ``"{name} unavailable:
    {why}"`` with the reason found the first time. ``check()`` (a reason, or None) runs before the build;
    ``setup(lib)`` declares the functions' types and may refuse too (a reason, or None)."""

    def __init__(self, name: str, source: Path, cflags: List[str], needs: str,
                 check: Callable[[], Optional[str]], setup: Callable[[ctypes.CDLL], Optional[str]]):
        self.name, self.source, self.cflags, self.needs = name, source, cflags, needs
        self.check, self.setup = check, setup
        self.lib: Optional[ctypes.CDLL] = None  # the loaded library
        self.why: Optional[str] = None  # why it cannot run here, once known

    def load(self) -> ctypes.CDLL:
        if self.lib is not None:
            return self.lib
        if self.why is None:
            try:
                why = switched_off() or self.check()
                if why is None:
                    fd, _ = build_fd(self.source, self.cflags, self.needs)
                    try:
                        lib = load_fd(fd)
                    except BaseException:
                        os.close(fd)
                        raise
                    # the descriptor stays open: the loader knows the library by the name /proc/self/fd/N, which
                    # must not name another file later
                    self._fd = fd
                    why = self.setup(lib)
                    if why is None:
                        self.lib = lib
                        return lib
            except FairseqExtError as e:
                why = str(e)
            except OSError as e:
                why = f"the built kernel does not load ({e})"
            self.why = why
            logger.info(f"{self.name} unavailable: {why}")
        raise FairseqExtError(f"{self.name} unavailable: {self.why}")

    def refusal(self) -> Optional[str]:
        """None when the library runs here, else the reason (one line)."""
        try:
            self.load()
            return None
        except FairseqExtError as e:
            return str(e)
