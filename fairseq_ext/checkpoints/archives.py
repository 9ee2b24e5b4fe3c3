"""Model archives of the hub (``from_pretrained("model.tar.gz", ...)`` of fairseq's models and ours), unpacked the
safe way; installed by ``import fairseq_ext`` (:func:`fairseq_ext.checkpoints.install`).

fairseq's ``file_utils.load_archive_file`` (which ``hub_utils.from_pretrained`` calls for the model and the data
argument) unpacks a ``.tar.*`` with ``tarfile.extractall`` and no filter, so a member named ``/abs/path`` or
``../../x``, or a link, writes anywhere the user may write (a ``.pth`` file in a site-packages directory runs at
the next Python start), and then it deletes the user's archive and puts the unpacked directory in its place.
tarfile's own ``data`` filter is no answer either: it resolves links with ``os.path.realpath``, which turns
lexical past PATH_MAX (CVE-2025-4517; fixed in Python 3.11.13, 3.12.11, 3.13.4). :func:`load_archive_file`
replaces it, whatever the interpreter's patch level:

* every header is read and checked before anything is written (:func:`_scan`): a model archive holds regular
  files and directories only, so a symbolic or hard link, a device, a FIFO, a sparse file or a member of any
  other type is refused, as is an absolute name, a name with a ``..`` part, a name given twice, and more members
  (:data:`DEFAULT_MAX_MEMBERS`) or more bytes (:data:`DEFAULT_MAX_BYTES`, the members' declared sizes summed)
  than the caps allow (``FAIRSEQ_EXT_ARCHIVE_MAX_MEMBERS`` / ``FAIRSEQ_EXT_ARCHIVE_MAX_BYTES``); a pax or GNU
  long-name header over :data:`MAX_HEADER_BYTES` is refused before it is read into memory. One line names the
  archive and the member, and nothing is extracted;
* then the members are written one by one (:func:`_extract`), by us, not by tarfile: directories made here, each
  file created new (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600) and its bytes counted against the cap again;
  no owners, modes or times from the archive;
* into a new private directory (``tempfile.mkdtemp``, removed when the process exits, and at once when the
  archive fails part-way), never beside the archive;
* the archive itself is only read: never removed, renamed or replaced.

A directory (or a name fairseq's cache resolves to a directory) is used as it is. Nothing here unpacks a zip
(fairseq's hub reads tar archives only: a ``.zip`` is one line, "neither a directory nor a tar archive"). Not
covered: the files' contents (the checkpoint is then read by the safe loader, the dictionaries and BPE models as
data).
"""

import atexit
import logging
import lzma
import os
import posixpath
import shutil
import tarfile
import tempfile
import zlib

from fairseq_ext.common.errors import FairseqExtError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 << 30  # 8 GiB unpacked: a large single model; set FAIRSEQ_EXT_ARCHIVE_MAX_BYTES for more
DEFAULT_MAX_MEMBERS = 10_000
MAX_HEADER_BYTES = 1 << 20  # a pax or GNU long-name header (names, times): a few hundred bytes in practice
_CHUNK = 1 << 20
_READ_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError)  # bz2's: OSError


class UnsafeArchiveError(FairseqExtError):
    pass


class _Refused(Exception):
    """A member refused while its header is read (not a TarError, so that tarfile does not swallow it)."""

    def __init__(self, name, why):
        super().__init__(why)
        self.name, self.why = name, why


class _TarInfo(tarfile.TarInfo):
    """tarfile's header reader, refusing a sparse member and a large pax / GNU long-name header before tarfile
    reads its data into memory."""

    def _proc_member(self, tarfile_):
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                         tarfile.SOLARIS_XHDTYPE) and self.size > MAX_HEADER_BYTES:
            raise _Refused(self.name, f"is a header of {self.size:,} bytes (at most {MAX_HEADER_BYTES:,})")
        return super()._proc_member(tarfile_)

    def _refuse_sparse(self, *args):
        raise _Refused(self.name, "is a sparse file (a model archive has none)")

    _proc_sparse = _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


def _cap(var, default):
    value = os.environ.get(var, "").strip()
    if not value:
        return default
    try:
        cap = int(value)
    except ValueError:
        cap = 0
    if cap < 1:
        raise FairseqExtError(f"{var}={value!r} is not a whole number above 0; set it to the most the hub may "
                              f"unpack from a model archive (default {default}) or unset it")
    return cap


def _flat(exc):
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:150]


def _refusal(label, name, why):
    where = f"member {name[:200]!r} {why}" if name is not None else why
    return UnsafeArchiveError(f"refusing to unpack model archive {label}: {where}; nothing was extracted (only use "
                              "archives from a source you trust)")


def _check_name(member):
    """The member's path relative to the directory it is unpacked into; raises _Refused."""
    name = member.name
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise _Refused(name, "has an absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise _Refused(name, "has a '..' in its path (it would be written outside the directory it is unpacked "
                             "into)")
    if member.issym() or member.islnk():
        raise _Refused(name, f"is a link (to {member.linkname[:200]!r}; a model archive needs none)")
    if member.isdev() or member.isfifo():
        raise _Refused(name, "is a device or FIFO")
    if not (member.isreg() or member.isdir()) or member.sparse is not None:
        raise _Refused(name, f"is of tar type {member.type!r}, neither a file nor a directory")
    norm = posixpath.normpath(name)
    if norm == "." and not member.isdir():
        raise _Refused(name, "is a file without a name")
    return norm


def _scan(archive, label, max_bytes, max_members):
    """Every member's header, checked (see the module docstring): [(member, relative path)]."""
    checked, files, dirs, total = [], set(), set(), 0
    while True:
        try:
            member = archive.next()
        except _Refused as exc:
            raise _refusal(label, exc.name, exc.why) from None
        if member is None:
            return checked
        if len(checked) >= max_members:
            raise _refusal(label, None, f"it has more than {max_members:,} members (the cap "
                                        "FAIRSEQ_EXT_ARCHIVE_MAX_MEMBERS; set it higher if the archive is genuine)")
        try:
            norm = _check_name(member)
        except _Refused as exc:
            raise _refusal(label, exc.name, exc.why) from None
        if norm != ".":
            parents = norm.split("/")
            clash = [p for p in ("/".join(parents[:i]) for i in range(1, len(parents))) if p in files]
            if norm in files or (member.isreg() and norm in dirs) or clash:
                raise _refusal(label, member.name, "is given twice, or as a file and as a directory")
            dirs.update("/".join(parents[:i]) for i in range(1, len(parents)))
            (dirs if member.isdir() else files).add(norm)
        if member.isreg():
            total += member.size
            if total > max_bytes:
                raise _refusal(label, member.name, f"brings what the archive unpacks to {total:,} bytes, more than "
                                                   f"{max_bytes:,} (the cap FAIRSEQ_EXT_ARCHIVE_MAX_BYTES; set it "
                                                   "higher if the archive is genuine)")
        checked.append((member, norm))


class _WriteError(Exception):
    pass


def _extract(archive, checked, dest, label, max_bytes):
    """Write the checked members under ``dest`` (created by us, private): nothing on disk is followed."""
    written = 0
    for member, norm in checked:
        target = dest if norm == "." else os.path.join(dest, norm)
        try:
            os.makedirs(target if member.isdir() else os.path.dirname(target), mode=0o700, exist_ok=True)
        except OSError as exc:
            raise _WriteError(exc) from None
        if member.isdir():
            continue
        src = archive.extractfile(member)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _WriteError(exc) from None
        with os.fdopen(fd, "wb") as out:
            left = member.size
            while chunk := src.read(_CHUNK):
                written, left = written + len(chunk), left - len(chunk)
                if written > max_bytes or left < 0:  # never with tarfile's reader: the declared sizes are read
                    raise _refusal(label, member.name, f"unpacks to more than {max_bytes:,} bytes (the cap "
                                                       "FAIRSEQ_EXT_ARCHIVE_MAX_BYTES)")
                try:
                    out.write(chunk)
                except OSError as exc:
                    raise _WriteError(exc) from None


def extract_archive(path, label=None):
    """Unpack the tar archive ``path`` into a new private directory (see the module docstring) and return the
    directory holding its files (the archive's one top directory, when it has one)."""
    label = label or path
    max_bytes = _cap("FAIRSEQ_EXT_ARCHIVE_MAX_BYTES", DEFAULT_MAX_BYTES)
    max_members = _cap("FAIRSEQ_EXT_ARCHIVE_MAX_MEMBERS", DEFAULT_MAX_MEMBERS)
    try:
        archive = tarfile.open(path, "r:*", tarinfo=_TarInfo)
    except _Refused as exc:
        raise _refusal(label, exc.name, exc.why) from None
    except _READ_ERRORS as exc:
        raise FairseqExtError(f"model archive {label} is neither a directory nor a tar archive ({_flat(exc)}); "
                              "give the model's directory or its .tar.gz") from None
    dest = None
    with archive:
        try:
            checked = _scan(archive, label, max_bytes, max_members)
            dest = tempfile.mkdtemp(prefix="fairseq_ext-archive-")
            logger.info(f"extracting archive file {label} to temp dir {dest}")
            _extract(archive, checked, dest, label, max_bytes)
        except BaseException as exc:
            if dest is not None:
                shutil.rmtree(dest, ignore_errors=True)
            if isinstance(exc, _WriteError):
                raise FairseqExtError(
                    f"could not unpack model archive {label} into {dest} ({_flat(exc.args[0])}); free space there "
                    "or set TMPDIR to a directory with room, nothing was kept") from None
            if isinstance(exc, _READ_ERRORS):
                raise FairseqExtError(f"model archive {label} is truncated or corrupted ({_flat(exc)}); download it "
                                      "again") from None
            raise
    atexit.register(shutil.rmtree, dest, True)
    tops = {norm.split("/", 1)[0] for _, norm in checked if norm != "."}
    if len(tops) == 1:
        top = os.path.join(dest, tops.pop())
        if os.path.isdir(top) and not os.path.islink(top):
            return top
    return dest


def load_archive_file(archive_file):
    """fairseq's ``file_utils.load_archive_file`` (a name, URL, directory or archive -> a directory), extracting an
    archive with :func:`extract_archive`; the archive (or fairseq's cached download of it) is left as it is."""
    from fairseq import file_utils

    try:
        resolved = file_utils.cached_path(archive_file, cache_dir=None)
    except EnvironmentError:
        logger.info(f"Archive name '{archive_file}' was not found in archive name list. We assumed "
                    f"'{archive_file}' was a path or URL but couldn't find any file associated to this path or URL.")
        return None
    if os.path.isdir(resolved):
        return resolved
    return extract_archive(resolved, archive_file)


def install():
    """Idempotent: fairseq's hub unpacks archives with :func:`load_archive_file`."""
    from fairseq import file_utils

    if not getattr(file_utils.load_archive_file, "_fairseq_ext_wrapped", False):
        load_archive_file._fairseq_ext_wrapped = True
        file_utils.load_archive_file = load_archive_file
