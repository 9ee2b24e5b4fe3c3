"""The C libraries of ``fairseq_ext/native/`` (:mod:`fairseq_ext.amx_int8`, :mod:`fairseq_ext.search_kernels`):
built with the system C compiler on first use, cached, loaded once, or refused with one line that says why.

``FAIRSEQ_EXT_CACHE`` (default ``~/.cache/fairseq_ext``) holds the built libraries, each named by a hash of its
source and flags and loaded as it is found there, so a directory that another user owns or that group or others
can write is refused. ``CC`` picks the compiler (default ``cc``).
"""

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, List, Optional

from fairseq_ext.errors import FairseqExtError

logger = logging.getLogger(__name__)


def cpu_flags() -> List[str]:
    """The CPU's feature flags (/proc/cpuinfo); FairseqExtError with the reason where they cannot be read."""
    if sys.platform != "linux" or not hasattr(os, "sched_getaffinity"):
        raise FairseqExtError(f"it runs on Linux only (this is {sys.platform})")
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError as e:
        raise FairseqExtError(f"/proc/cpuinfo cannot be read ({e})")


def build(source: Path, cflags: List[str], needs: str) -> Path:
    """The library compiled from ``source`` with ``cflags``, on first use, cached by the source's and flags' hash;
    ``needs`` (what the compiler must support) goes into the refusal of a failed build."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise FairseqExtError("no C compiler found (set CC or install gcc >= 11)")
    command = shlex.split(cc)  # CC may carry a wrapper or flags ("ccache gcc")
    tag = hashlib.sha256(source.read_bytes() + " ".join(command + cflags).encode()).hexdigest()[:16]
    cache = os.environ.get("FAIRSEQ_EXT_CACHE")
    if not cache:
        try:
            cache = Path.home() / ".cache" / "fairseq_ext"
        except RuntimeError:  # no home directory (some CI and container users)
            cache = Path(tempfile.gettempdir()) / f"fairseq_ext-{os.getuid()}"
    cache = Path(cache)
    lib = cache / f"{source.stem}-{tag}.so"
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = cache.stat()
    except OSError as e:
        raise FairseqExtError(f"cannot write the built kernel to {cache} ({e}); set FAIRSEQ_EXT_CACHE")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:  # a library found there is loaded: nobody else may write
        raise FairseqExtError(f"{cache} is not a directory of this user's alone (owner or group/other write); "
                              f"set FAIRSEQ_EXT_CACHE to one")
    if lib.exists():
        return lib
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
    except OSError as e:
        raise FairseqExtError(f"cannot write the built kernel to {cache} ({e}); set FAIRSEQ_EXT_CACHE")
    try:
        try:
            run = subprocess.run([*command, *cflags, str(source), "-o", tmp], capture_output=True, text=True)
        except OSError as e:
            raise FairseqExtError(f"cannot run the C compiler {cc!r} ({e}); set CC")
        if run.returncode != 0:
            first = next((line for line in run.stderr.splitlines() if "error" in line), run.stderr.strip()[:200])
            raise FairseqExtError(f"{cc} could not build {source.name} ({needs}): {first}")
        os.replace(tmp, lib)  # atomic: a concurrent build leaves one complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class NativeLibrary:
    """One library of ``fairseq_ext/native/``: :meth:`load` builds and loads it once, or raises FairseqExtError
    ``"{name} unavailable: {why}"`` with the reason found the first time. ``check()`` (a reason, or None) runs
    before the build; ``setup(lib)`` declares the functions' types and may refuse too (a reason, or None)."""

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
                why = self.check()
                if why is None:
                    lib = ctypes.CDLL(str(build(self.source, self.cflags, self.needs)))
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
