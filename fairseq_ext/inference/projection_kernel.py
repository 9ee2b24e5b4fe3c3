"""Which of PyTorch's float32 products the static step's vocabulary projection takes, measured once per CPU.

The projection (a few rows against the [V, C] output embedding, V ~ 8,000) reads the whole weight at every call, so
its time is the CPU's memory path, and which of two library products is faster depends on the CPU: MKL's ``addmm``
with the weight stored ``[C, V]``, or oneDNN's product on a weight prepacked for it. On one CPU oneDNN was several
times faster from 2 rows on; on another MKL was faster at every row count up to 128 (``python -m
benchmarks.speed.decode --capture`` times both per row count). So the step measures both once, at the row counts
of :data:`ROWS`, on the model's own weight, and keeps the answer on disk for that CPU and weight shape: the fewest
rows from which oneDNN takes the call, or None (MKL always). The measurement takes well under a second, logged in one
line; every later run on the machine reads it.

The answer lives in ``projection_kernel.json`` of :func:`fairseq_ext.inference.aot_step.cache_dir` (the static
step's cache), keyed by the CPU (model name, a digest of its feature flags and cache size, PyTorch's dispatch
capability, machine), the PyTorch version and the weight's shape. Only a row count of :data:`ROWS` (an integer) or
null is read back; anything else in the file is measured again.
The two products order their float32 sums differently (differences ~1e-6), which the searches' near-tie guard
covers (``fairseq_ext.sat.step_rules.TIE_MARGIN``).
"""

import hashlib
import json
import logging
import os
import platform
import time
from typing import Callable, Dict, Optional

import torch

from fairseq_ext.checkpoints.saving import atomic_write
from fairseq_ext.inference import aot_step

logger = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)  # the row counts measured (the static step runs calls of up to 128 rows)
MARGIN = 0.9  # oneDNN takes a row count only where it needs at most this share of MKL's time (noise stays on MKL)
FILE = "projection_kernel.json"


def cpu_key() -> str:
    """The CPU as the choice depends on it: model name, a digest of its feature flags and cache size (virtual
    machines often name every model alike), PyTorch's dispatch capability, machine, PyTorch version."""
    info = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "cache size") and key not in info:
                    info[key] = value.strip()
                if not line.strip() and info:  # the first processor's block is enough
                    break
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or "unknown CPU"
    digest = hashlib.blake2b(f"{info.get('flags', '')}|{info.get('cache size', '')}".encode(), digest_size=4)
    return (f"{name}|{digest.hexdigest()}|{torch.backends.cpu.get_cpu_capability()}|{platform.machine()}|"
            f"torch {torch.__version__}")


def _time(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def measure(mkl: Callable[[torch.Tensor], torch.Tensor], onednn: Callable[[torch.Tensor], torch.Tensor],
            width: int, rounds: int = 3) -> Dict[int, tuple]:
    """{rows: (MKL seconds, oneDNN seconds)} per call at each row count of :data:`ROWS`: the fastest of ``rounds``
    interleaved rounds, so that the machine's load falls on both alike."""
    best = {n: [float("inf"), float("inf")] for n in ROWS}
    xs = {n: torch.randn(n, width) for n in ROWS}
    with torch.no_grad():
        for n in ROWS:  # warm both up (first calls allocate and pack)
            mkl(xs[n]), onednn(xs[n])
        for _ in range(rounds):
            for n in ROWS:
                calls = max(3, 64 // n)
                for i, fn in enumerate((mkl, onednn)):
                    best[n][i] = min(best[n][i], _time(lambda fn=fn: fn(xs[n]), calls))
    return {n: tuple(v) for n, v in best.items()}


def onednn_from(times: Dict[int, tuple]) -> Optional[int]:
    """The fewest rows from which oneDNN is faster (at most :data:`MARGIN` of MKL's time) at that row count and at
    every larger one measured, or None."""
    start = None
    for n in sorted(times, reverse=True):
        mkl, onednn = times[n]
        if onednn > MARGIN * mkl:
            break
        start = n
    return start


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(d: str, path: str, data: dict) -> None:
    """``data`` into ``path`` through the package's atomic write (a reader never sees half a file); a cache that
    cannot be written is left as it is (the choice is measured again next time)."""
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        atomic_write(path, lambda tmp: _dump(data, tmp))
    except OSError as e:
        logger.info(f"static step: the projection's kernel choice is not cached ({d}: {e.strerror})")


def _dump(data: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def choose(mkl: Callable[[torch.Tensor], torch.Tensor], onednn: Callable[[torch.Tensor], torch.Tensor],
           shape) -> Optional[int]:
    """The fewest rows from which the projection of a weight of ``shape`` [V, C] takes oneDNN on this CPU (None:
    MKL always): from the cache, else measured (:func:`measure`) and cached."""
    d = aot_step.cache_dir()
    path = os.path.join(d, FILE)
    entry = f"{cpu_key()}|{shape[0]}x{shape[1]}"
    safe = aot_step.unsafe_cache(d) is None
    data = _read(path) if safe else {}
    if entry in data and (data[entry] is None or (type(data[entry]) is int and data[entry] in ROWS)):
        return data[entry]
    times = measure(mkl, onednn, shape[1])
    start = onednn_from(times)
    logger.info("static step: the vocabulary projection (%dx%d) takes %s on this CPU (measured once, us per call "
                "MKL / oneDNN by rows: %s)", shape[0], shape[1],
                "MKL at every row count" if start is None else f"oneDNN from {start} rows, MKL below",
                ", ".join(f"{n}: {1e6 * m:.0f} / {1e6 * o:.0f}" for n, (m, o) in sorted(times.items())))
    if safe:
        data = _read(path)  # another process may have added its own entries meanwhile
        data[entry] = start
        _write(d, path, data)
    return start
