"""``python -m fairseq_ext.average_checkpoints``: fairseq's checkpoint averaging through the safe loader
(:mod:`fairseq_ext.checkpoints.average`)."""

import sys

from fairseq_ext.checkpoints.average import main

if __name__ == "__main__":
    sys.exit(main())
