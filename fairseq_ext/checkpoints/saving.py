"""Atomic, durable checkpoint writes: a temporary file in the target's directory, fsynced, renamed over the
target (:func:`atomic_write`, :func:`atomic_torch_save`); fairseq's copies of a checkpoint (``checkpoint_last.pt``,
``checkpoint_best.pt``) go the same way once :func:`install_atomic_copies` ran. Temporary files a killed process
left behind are removed at the next write (:func:`remove_stale_temporaries`)."""

import os
import shutil

import torch


def _tmp_name(path):
    return f"{path}.tmp.{os.getpid()}"


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def remove_stale_temporaries(path):
    """Delete the ``<path>.tmp.<pid>`` files that a process of this machine, now dead, left behind (a kill
    during a copy or save: ``finally`` does not run on SIGKILL). Returns the removed paths. (A process of another
    machine writing the same file in a shared directory would look dead: fairseq saves from rank 0 only.)"""
    directory, base = os.path.split(os.path.abspath(path))
    prefix = f"{base}.tmp."
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix):]
        if name.startswith(prefix) and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            try:
                os.remove(os.path.join(directory, name))
                removed.append(os.path.join(directory, name))
            except OSError:
                pass
    return removed


def _fsync(path, directory=False):
    try:
        fd = os.open(path, os.O_RDONLY if directory else os.O_RDWR)
    except OSError:
        if not directory:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if not directory:  # some file systems cannot fsync a directory
            raise
    finally:
        os.close(fd)


def atomic_write(path, fill):
    """``fill(tmp)`` a temporary file beside ``path``, fsync it, rename it to ``path``, fsync the directory:
    a kill leaves the previous ``path`` intact, and after the rename the new content is on disk."""
    remove_stale_temporaries(path)
    tmp = _tmp_name(path)
    try:
        fill(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(os.path.dirname(os.path.abspath(path)), directory=True)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_torch_save(obj, path):
    """Write ``obj`` to ``path`` through a temporary file in the same directory and an atomic rename."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def install_atomic_copies():
    from fairseq.file_io import PathManager

    original = PathManager.copy
    if getattr(original, "_fairseq_ext_wrapped", False):
        return

    def copy(src_path, dst_path, overwrite=False):
        if "://" in str(src_path) or "://" in str(dst_path):
            return original(src_path, dst_path, overwrite)
        if not overwrite and os.path.exists(dst_path):
            return False

        atomic_write(dst_path, lambda tmp: shutil.copyfile(src_path, tmp))
        return True

    copy._fairseq_ext_wrapped = True
    PathManager.copy = staticmethod(copy)
