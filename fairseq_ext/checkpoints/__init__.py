"""Checkpoints: reading them safely, writing them atomically, and the files built from them.

    loading.py        the safe loader: torch's weights-only unpickler with the allow-list, the checks below, one
                      line per refusal; every torch.load of fairseq's checkpoint_utils goes through it
    allow_list.py     the classes fairseq checkpoints hold (SAFE_GLOBALS), allowed only while our loads run
    checks.py         the zip's CRC-32s, finite weights and their dtypes, plain data outside the config, meters
    config.py         the config strings fairseq evaluates (EVAL_FIELDS) and registry names, as plain literals
    mismatch.py       the dictionary or weights that do not fit, named in one line; checkpoint_of(model)
    saving.py         atomic, durable writes and fairseq's checkpoint copies
    save_dir_lock.py  one fairseq-train per --save-dir
    archives.py       the hub's model archives, unpacked without leaving their directory
    average.py        python -m fairseq_ext.average_checkpoints
    release.py        python -m fairseq_ext.release pack|verify|scrub-paths: the release checkpoints

What is guaranteed, and how it is tested: docs/RELIABILITY.md.
"""

from fairseq_ext.checkpoints.allow_list import SAFE_GLOBALS, allow_listed  # noqa: F401
from fairseq_ext.checkpoints.checks import CorruptCheckpointError, UnsafeCheckpointError  # noqa: F401
from fairseq_ext.checkpoints.config import EVAL_FIELDS, REGISTRY_FIELDS, check_config, literal_value  # noqa: F401
from fairseq_ext.checkpoints.loading import (  # noqa: F401
    ConfigConversionError, check_contents, load_checkpoint_file, load_checkpoint_fileobj)
from fairseq_ext.checkpoints.mismatch import (  # noqa: F401
    CheckpointMismatchError, DictionaryMismatchError, checkpoint_of)
from fairseq_ext.checkpoints.saving import atomic_torch_save, atomic_write, remove_stale_temporaries  # noqa: F401

_installed = False


def install():
    """Idempotent; called by ``import fairseq_ext``."""
    global _installed
    if _installed:
        return
    from fairseq_ext.checkpoints import archives, loading, mismatch, save_dir_lock, saving

    loading.install()
    mismatch.install()
    saving.install_atomic_copies()
    save_dir_lock.install()
    archives.install()  # the hub's model archives, unpacked without leaving their directory
    _installed = True
