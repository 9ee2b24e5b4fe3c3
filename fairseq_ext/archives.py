"""Model archives of the hub (``from_pretrained("model.tar.gz", ...)`` of fairseq's models and ours), unpacked the
safe way; installed by ``import fairseq_ext`` (:func:`fairseq_ext.checkpoint_io.install`).

fairseq's ``file_utils.load_archive_file`` (which ``hub_utils.from_pretrained`` calls for the model and the data
argument) unpacks a ``.tar.*`` with ``tarfile.extractall`` and no filter, so a member named ``/abs/path`` or
``../../x``, or a link, writes anywhere the user may write (a ``.pth`` file in a site-packages directory runs at
the next Python start), and then it deletes the user's archive and puts the unpacked directory in its place.
:func:`load_archive_file` replaces it:

* every member is checked before anything is written, with tarfile's ``data`` filter (PEP 706; what pip uses for
  sdists) and for an absolute name (which the filter would make relative): an absolute name, a name that leaves
  the directory (``..``), a link whose target is absolute or leaves it, a device or FIFO is refused with one line
  naming the archive and the member, and nothing is extracted;
  the rest is extracted with that filter (no set-uid/executable bits from the archive, no owners);
* into a new private directory (``tempfile.mkdtemp``, removed when the process exits), never beside the archive;
* the archive itself is only read: never removed, renamed or replaced.

A directory (or a name fairseq's cache resolves to a directory) is used as it is. Not covered: the size of what an
archive unpacks to (a small archive may fill the temporary directory's disk), and the files' contents (the
checkpoint is then read by the safe loader, the dictionaries and BPE models as data).
"""

import atexit
import logging
import os
import shutil
import tarfile
import tempfile

from fairseq_ext.errors import FairseqExtError

logger = logging.getLogger(__name__)


class UnsafeArchiveError(FairseqExtError):
    pass


class _AbsolutePath(tarfile.TarError):
    pass


def _data_filter(member, dest):
    """tarfile's ``data`` filter (Python >= 3.11.4; before it, the same refusals done here), refusing an absolute
    name too (the filter would strip its leading ``/``)."""
    name = member.name
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise _AbsolutePath(name)
    if hasattr(tarfile, "data_filter"):
        return tarfile.data_filter(member, dest)
    if ".." in name.replace("\\", "/").split("/"):
        raise tarfile.TarError(f"{name!r} is outside the destination")
    if member.issym() or member.islnk() or member.isdev() or member.isfifo():
        raise tarfile.TarError(f"{name!r} is a link or a special file")
    return member


def extract_archive(path, label=None):
    """Unpack the tar archive ``path`` into a new private directory (see the module docstring) and return the
    directory holding its files (the archive's one top directory, when it has one)."""
    label = label or path
    try:
        archive = tarfile.open(path, "r:*")
    except (tarfile.TarError, OSError) as exc:
        raise FairseqExtError(f"model archive {label} is neither a directory nor a tar archive ({type(exc).__name__}: "
                              f"{str(exc)[:100]}); give the model's directory or its .tar.gz") from None
    dest = tempfile.mkdtemp(prefix="fairseq_ext-archive-")
    atexit.register(shutil.rmtree, dest, True)
    with archive:
        try:
            members = archive.getmembers()
            for member in members:
                try:
                    _data_filter(member, dest)
                except tarfile.TarError as exc:
                    raise UnsafeArchiveError(
                        f"refusing to unpack model archive {label}: member {member.name[:200]!r} {_why(exc)}; nothing "
                        "was extracted (only use archives from a source you trust)") from None
            logger.info(f"extracting archive file {label} to temp dir {dest}")
            if hasattr(tarfile, "data_filter"):
                archive.extractall(dest, filter="data")
            else:
                archive.extractall(dest)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise FairseqExtError(f"model archive {label} is truncated or corrupted ({type(exc).__name__}: "
                                  f"{str(exc)[:100]}); download it again") from None
    tops = {m.name.split("/", 1)[0] for m in members if m.name not in ("", ".")}
    if len(tops) == 1:
        top = os.path.join(dest, tops.pop())
        if os.path.isdir(top) and not os.path.islink(top):
            return top
    return dest


def _why(exc):
    kind = type(exc).__name__
    return {"_AbsolutePath": "has an absolute path", "AbsolutePathError": "has an absolute path",
            "OutsideDestinationError": "would be written outside the directory it is unpacked into",
            "AbsoluteLinkError": "is a link to an absolute path",
            "LinkOutsideDestinationError": "is a link that leads outside the directory it is unpacked into",
            "SpecialFileError": "is a device or FIFO"}.get(kind, f"is refused ({kind}: {str(exc)[:100]})")


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
