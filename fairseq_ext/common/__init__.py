"""What every part of the package shares, and nothing paper-specific:

    errors.py            the error class and the one place that prints it (``error: ...``, no traceback)
    fairseq_fixes.py     fixes to fairseq's own behaviour, each named after the bug, guarded by fairseq's version
    building.py          whether a model is being rebuilt from a checkpoint, and which file a loaded model came from
    decoder_features.py  the first and last lines of fairseq's decoder, shared by the MSC, SAT and BERT-JAM decoders
"""
