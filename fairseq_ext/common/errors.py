"""The one error class of fairseq-ext and the one place that prints it.

A :class:`FairseqExtError` says what is wrong and what to do. Raised anywhere under a fairseq command line
(``fairseq-train/-generate/-interactive --user-dir fairseq_ext``) or one of our ``python -m`` tools, it reaches
:func:`install_excepthook`'s hook, which prints ``error: <message>`` on one line instead of a traceback.
Set ``FAIRSEQ_EXT_TRACEBACK=1`` to get the full traceback as well (for bug reports).
"""

import os
import sys
import traceback


class FairseqExtError(Exception):
    """An error whose message tells the user what is wrong and what to do; the CLI prints only it."""


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        if isinstance(exc, FairseqExtError):
            report(exc)
            return
        previous(exc_type, exc, tb)

    hook._fairseq_ext_hook = True
    return hook


def install_excepthook():
    """Idempotent; called by ``import fairseq_ext``."""
    if not getattr(sys.excepthook, "_fairseq_ext_hook", False):
        sys.excepthook = _excepthook(sys.excepthook)


def report(exc):
    """Print a FairseqExtError as the one line a user sees (after its traceback with FAIRSEQ_EXT_TRACEBACK=1)."""
    if os.environ.get("FAIRSEQ_EXT_TRACEBACK", "") not in ("", "0"):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(f"error: {exc}", file=sys.stderr)


def command(main):
    """Decorator for the ``main(argv=None)`` of our ``python -m`` tools: a :class:`FairseqExtError` is reported
    in one line by :func:`report` and ``main`` returns 1 (so tests can call it; ``sys.exit(main())`` exits 1)."""
    import functools

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except FairseqExtError as exc:
            report(exc)
            return 1

    return wrapper
