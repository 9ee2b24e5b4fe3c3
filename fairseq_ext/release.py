"""``python -m fairseq_ext.release pack|verify|scrub-paths``: the release checkpoints
(:mod:`fairseq_ext.checkpoints.release`)."""

import sys

from fairseq_ext.checkpoints.release import main

if __name__ == "__main__":
    sys.exit(main())
