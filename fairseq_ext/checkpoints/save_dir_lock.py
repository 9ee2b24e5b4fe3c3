"""One training per save directory: ``fairseq-train`` locks ``--save-dir`` before it reads or writes anything there.

The process that writes the checkpoints (fairseq's master rank, the one that calls
``checkpoint_utils.verify_checkpoint_directory`` at the start of ``fairseq_cli.train.main``) takes an exclusive
``fcntl.flock`` on ``SAVE_DIR/.fairseq-train.lock`` and holds it until it exits; a second training given that
directory gets one line naming it and the holder's pid. The kernel drops the lock when its holder dies, so the
file left by a killed training blocks nothing; a single-process run removes it when it exits (a rank 0 started by
multiprocessing spawn leaves it, unlocked). Other ranks share the directory and do not lock.
"""

import atexit
import fcntl
import functools
import os
import stat

from fairseq_ext.common.errors import FairseqExtError

LOCK_NAME = ".fairseq-train.lock"
_held = {}  # realpath of a save dir -> the open lock file (this process)


class SaveDirInUseError(FairseqExtError):
    pass


def _holder(fd):
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def acquire(save_dir):
    """Lock ``save_dir`` for this process (idempotent); SaveDirInUseError when another process holds it."""
    key = os.path.realpath(save_dir)
    if key in _held:
        return
    path = os.path.join(save_dir, LOCK_NAME)
    while True:
        try:  # no link followed, no truncation before the lock is ours
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise SaveDirInUseError(f"--save-dir {save_dir}: cannot open its lock file {path} ({e.strerror}); remove "
                                    "what is there, or give another --save-dir") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SaveDirInUseError(f"--save-dir {save_dir}: {path} is not a regular file; remove it, or give "
                                    "another --save-dir")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = _holder(fd)
            os.close(fd)
            who = f"pid {pid}" if pid else "another process"
            raise SaveDirInUseError(f"--save-dir {save_dir} is in use by another training ({who} holds {path}); "
                                    "wait for it to end, or give this run another --save-dir") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except OSError:
            same = False
        if same:
            break
        os.close(fd)  # removed or replaced by its holder's exit between our open and our lock: take the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held[key] = (fd, path, os.getpid())


def release_all():
    """Remove and unlock this process's lock files (at exit; not in forked children)."""
    for key, (fd, path, pid) in list(_held.items()):
        if pid != os.getpid():
            continue
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                os.unlink(path)  # while still locked: whoever opened it before retries on the new file
        except OSError:
            pass
        os.close(fd)
        del _held[key]


def install():
    """Idempotent; called by :func:`fairseq_ext.checkpoints.install`."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.verify_checkpoint_directory
    if getattr(original, "_fairseq_ext_locks", False):
        return

    @functools.wraps(original)
    def verify_checkpoint_directory(save_dir):
        os.makedirs(save_dir, exist_ok=True)
        acquire(save_dir)
        return original(save_dir)

    verify_checkpoint_directory._fairseq_ext_locks = True
    checkpoint_utils.verify_checkpoint_directory = verify_checkpoint_directory
    atexit.register(release_all)
