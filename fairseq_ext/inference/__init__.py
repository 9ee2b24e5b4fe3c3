"""Faster decoding on a CPU, shared by every transformer-shaped decoder (fairseq's ``transformer`` and ``sat``):

    lean_decoder.py   the lean incremental decoder step (the SAT generator's default) and its reorder; a decoder
                      opts in by declaring ``supports_lean_step`` (read here; this package imports no paper folder)
    lean_encoder.py   the lean encoder layer (``lean-encoder``)
    speedups.py       the speed-ups by name: ``--inference-speedups``, :func:`apply_speedups` (int8, prepack, lean)

Everything runs on PyTorch's own kernels (MKL, oneDNN, fbgemm): the package builds no native code.

``python -m benchmarks.speed.kernels`` and ``benchmarks/speed/sat.py`` measure them (benchmarks/README.md).
"""
