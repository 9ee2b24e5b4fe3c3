"""Faster decoding on a CPU, shared by every transformer-shaped decoder (fairseq's ``transformer`` and ``sat``):

    lean_decoder.py   the lean incremental decoder step (the SAT generator's default) and its reorder; a decoder
                      opts in by declaring ``supports_lean_step`` (read here; this package imports no paper folder)
    lean_encoder.py   the lean encoder layer (``lean-encoder``)
    speedups.py       the speed-ups by name: ``--inference-speedups``, :func:`apply_speedups` (int8, prepack, lean)
    amx_int8.py       int8 linear layers on Intel AMX tiles (``amx-int8-*``; C in kernels/amx_int8.c)
    native.py         builds, caches and loads the C of ``kernels/`` (and of ``sat/kernels/``); one switch,
                      ``FAIRSEQ_EXT_NATIVE=0``, keeps every decode in PyTorch

``python benchmarks/bench_kernels.py`` and ``benchmarks/bench_sat.py`` measure them (benchmarks/README.md).
"""
