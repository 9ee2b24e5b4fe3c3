"""Command-line tools of fairseq-ext (run with ``python -m fairseq_ext.scripts.<name>``)."""
