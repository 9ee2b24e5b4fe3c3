"""``python -m fairseq_ext`` prints the directory to pass as ``--user-dir`` from anywhere::

    fairseq-train --user-dir "$(python -m fairseq_ext)" ...
"""
import os

import fairseq_ext

print(os.path.dirname(os.path.abspath(fairseq_ext.__file__)))
