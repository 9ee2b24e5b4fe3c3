"""Faster decoding on a CPU, shared by every transformer-shaped decoder (fairseq's ``transformer`` and ``sat``):

    lean_decoder.py   the lean incremental decoder step (where the static step does not apply) and its reorder; a
                      decoder opts in by declaring ``supports_lean_step`` (read here; this package imports no paper
                      folder)
    static_step.py    the static decoder step: one captured graph per call, caches preallocated for the search
                      (the default of the SAT generator and of --task translation)
    default_generator.py  --task translation decodes with the package's generator on the static step
                      (FAIRSEQ_EXT_STOCK_GENERATOR=1: fairseq's own)
    lean_encoder.py   the lean encoder layer (``lean-encoder``)
    speedups.py       the speed-ups by name: ``--inference-speedups``, :func:`apply_speedups` (int8, prepack, lean)

Everything runs on PyTorch's own kernels (MKL, oneDNN, fbgemm): the package builds no native code.

``python -m benchmarks.speed.kernels`` and ``benchmarks/speed/sat.py`` measure them (benchmarks/README.md).
"""
