"""Two parts of a beam step in C, for the SAT generator on the CPU (``fairseq_ext/sat/kernels/search_kernels.c``,
built once with the system C compiler and cached: :mod:`fairseq_ext.inference.native`). At batch 1 a step's
PyTorch ops each cost a few microseconds whatever their size; these two replace about 35 of them. The group step is
plain C; the log-softmax uses AVX-512F intrinsics (x86-64, a CPU that has them: read from /proc/cpuinfo). Where
no C compiler builds the file (or not on a POSIX system), :func:`refusal` says why in one line and the generator
keeps its PyTorch ops; where only the CPU lacks AVX-512F, :func:`top_refusal` says so and the log-softmax stays
PyTorch's.

* :func:`log_softmax_top` (the generator's default with the lean step; ``--no-lean-step`` turns both off). A beam
  step reads, of each row's log-softmax ``lp = log_softmax(x)`` over V words, only its B best words (EOS and pad
  excluded) and the EOS column. PyTorch writes the whole row, then the search masks pad and EOS and ranks the row
  again (:func:`fairseq_ext.sat.generator.top_b`). The kernel reads each row twice:

      m = max_v x[v],   s = log sum_v exp(x[v] - m),   lp[v] = (x[v] - m) - s     (PyTorch's order of operations)

  keeping the B largest x[v] of the candidate columns on the way (a block of 16 is looked at only when one of its
  values beats the B-th so far). Its exponential is its own (a degree-6 polynomial after Cephes' ``expf``) and its
  sum runs in another order than PyTorch's, so its values need not be PyTorch's bit for bit.
  ``tests/sat/test_search_kernels.py`` checks, on random rows of 5 to 8,003 words (logits of scale 1 and 30), that
  each value (the B best and EOS) is within 1e-6 + 2.4e-7 |v| of v, the exact log-softmax (computed in float64,
  rounded once to float32), and that the words are those of the top B of that row, equal values ranking the
  smaller word first. A row whose maximum or sum is not finite (a NaN anywhere, +inf, every value -inf) is not
  computed: the call returns None and the caller takes PyTorch's path, where fairseq's rules for those apply. The
  kernel runs on the calling thread, so the generator leaves calls of over :data:`SERIAL_MAX_ROWS` rows to
  PyTorch's parallel ops when it has more than two threads (batched decoding on a larger machine).
* :func:`enumerated_group`: the generator's enumerated group step (every parent's candidate prefixes scored at
  once, then a top B per position; ``_enumerated_group``) with the same float32 numbers as its PyTorch ops, which
  are about 25 ops a call. It changes no number, so the generator uses it wherever the library builds
  (``native_group_step``), for K = 1 too (a beam step is the enumeration with one position).

``python benchmarks/bench_kernels.py --parts 6`` times both against PyTorch's ops in isolation (``--threads 2``
for PyTorch's ops on two threads), ``python benchmarks/bench_beam_parts.py`` inside a search.

Float32 on the CPU only. Both wrappers check what they hand to C before the call (dtype, device, shape, and the
index values the C code reads memory with) and refuse anything else with one line; an input that is not contiguous
is copied. ``FAIRSEQ_EXT_NATIVE=0`` keeps the generator on PyTorch's ops (:mod:`fairseq_ext.inference.native`).
"""

import ctypes
import os
import sys
import weakref
from pathlib import Path
from typing import Optional, Tuple

import torch

from fairseq_ext.errors import FairseqExtError
from fairseq_ext.inference.native import NativeLibrary, cpu_flags

SOURCE = Path(__file__).with_name("kernels") / "search_kernels.c"
CFLAGS = ["-O3", "-shared", "-fPIC"]  # the log-softmax function asks for AVX-512F itself (target attribute)

_top_cpu = None  # "" once the CPU is known to run log_softmax_top, else why it cannot


def _platform_refusal() -> Optional[str]:
    if os.name != "posix":
        return f"they are built and cached on POSIX systems only (this is {sys.platform})"
    return None


def _avx512f_refusal() -> Optional[str]:
    """None when the CPU has AVX-512F (read from /proc/cpuinfo: Linux), else why not."""
    try:
        return None if "avx512f" in cpu_flags() else "this CPU lacks avx512f"
    except FairseqExtError as e:
        return f"AVX-512F is looked up in /proc/cpuinfo: {e}"


def _declare(lib) -> Optional[str]:
    P, L = ctypes.c_void_p, ctypes.c_int64
    lib.fx_log_softmax_top_built.restype = ctypes.c_int
    lib.fx_log_softmax_top.argtypes = [P, L, L, L, ctypes.c_int, L, L, L, P, P, P]
    lib.fx_log_softmax_top.restype = ctypes.c_int
    lib.fx_enumerated_group.argtypes = [P, P, P, P, L, L, L, L, L, P, P, L, P, P, P, P, P]
    lib.fx_enumerated_group.restype = None
    return None


LIBRARY = NativeLibrary("search kernels", SOURCE, CFLAGS, "a C99 compiler with GCC's target attribute: gcc >= 5 "
                        "or clang", lambda: _platform_refusal(), _declare)


def kernel():
    """The loaded library (ctypes); raises FairseqExtError with one line when it cannot be built or loaded here."""
    return LIBRARY.load()


def refusal() -> Optional[str]:
    """None when the library (the group step) runs here, else the reason (one line)."""
    return LIBRARY.refusal()


def top_refusal() -> Optional[str]:
    """None when :func:`log_softmax_top` runs here (the library and a CPU with AVX-512F), else the reason (one
    line). The CPU is looked at once."""
    global _top_cpu
    why = refusal()
    if why is not None:
        return why
    if _top_cpu is None:
        cpu = _avx512f_refusal()
        if cpu is None and not kernel().fx_log_softmax_top_built():
            cpu = "the library was built for a CPU without AVX-512F intrinsics"
        _top_cpu = cpu or ""
    return f"log-softmax kernel unavailable: {_top_cpu}" if _top_cpu else None


def log_softmax_top(x: torch.Tensor, B: int, skip: Tuple[int, int], keep: int
                    ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For logits ``x`` [..., V] (float32 on the CPU; copied first where not contiguous): the B best
    log-probabilities of each row over the columns not in ``skip`` and their columns ([..., B] each, best first),
    and the log-probability of column ``keep`` ([...]). None when a row is not finite (module docstring). Raises
    FairseqExtError where it cannot run (:func:`top_refusal`)."""
    if _top_cpu != "" or LIBRARY.lib is None:
        why = top_refusal()
        if why is not None:
            raise FairseqExtError(why)
    if getattr(x, "dtype", None) is not torch.float32 or not x.is_cpu or not x.dim():
        raise FairseqExtError(f"log_softmax_top: the logits must be a float32 CPU tensor [..., V] (got "
                              f"{getattr(x, 'dtype', type(x).__name__)} on {getattr(x, 'device', '?')})")
    V = x.shape[-1]
    if not 1 <= B <= V or not 0 <= keep < V:
        raise FairseqExtError(f"log_softmax_top: B={B} and column {keep} for rows of {V}")
    if not x.is_contiguous():
        x = x.contiguous()
    rows, shape = x.numel() // V, x.shape[:-1]
    vals = torch.empty(shape + (B,))
    words = torch.empty(shape + (B,), dtype=torch.long)
    keep_lp = torch.empty(shape)
    if rows and LIBRARY.lib.fx_log_softmax_top(x.data_ptr(), rows, V, V, B, skip[0], skip[1], keep, vals.data_ptr(),
                                               words.data_ptr(), keep_lp.data_ptr()):
        return None
    return vals, words, keep_lp


SERIAL_MAX_ROWS = 64  # rows up to which the one-thread kernel is used whatever torch.get_num_threads() is
GROUP_MAX_BEAM = 64  # the C step keeps a sentence's top B on its stack
_checked_candidates = {}  # id(ranks) -> (weakref to ranks, its version, weakref to lengths, its version, B, K)


def _version(t):
    """The tensor's in-place change counter (inference tensors have none: they are checked once)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _check_group_args(scores, vals, words, eos_lp, n, P, J, ranks, lengths):
    """Refuse (one line) what :func:`enumerated_group` must not hand to C: another dtype or device, shapes that do
    not fit each other, a beam over :data:`GROUP_MAX_BEAM`, ranks outside [0, B) or lengths outside [0, K] (the C
    code reads ``vals`` at those indices). The candidates (ranks, lengths) are checked once per tensor and again
    after an in-place change (the generator reuses one cached pair); the rest on every call."""
    F, L = torch.float32, torch.int64
    try:
        ok = (scores.dtype is F and vals.dtype is F and eos_lp.dtype is F and words.dtype is L and scores.is_cpu
              and vals.is_cpu and eos_lp.is_cpu and words.is_cpu)
        shape = vals.shape
    except AttributeError:
        ok = False
    if not ok:
        raise FairseqExtError("enumerated_group: scores, vals and eos_lp must be float32 and words int64 CPU tensors "
                              "(got " + ", ".join(f"{getattr(t, 'dtype', type(t).__name__)} on "
                                                 f"{getattr(t, 'device', '?')}" for t in (scores, vals, words, eos_lp))
                              + ")")
    if len(shape) != 3 or not 1 <= shape[2] <= GROUP_MAX_BEAM or words.shape != shape or \
            scores.shape != shape[:1] or eos_lp.shape != shape[:2] or n * P != shape[0] or not 0 <= J <= shape[1]:
        raise FairseqExtError(
            f"enumerated_group: shapes that do not fit: scores {tuple(scores.shape)}, vals {tuple(vals.shape)}, words "
            f"{tuple(words.shape)}, eos_lp {tuple(eos_lp.shape)}, n={n}, P={P}, J={J} (vals [N, K, B], N = n * P, "
            f"J <= K, 1 <= B <= {GROUP_MAX_BEAM})")
    K, B = shape[1], shape[2]
    seen = _checked_candidates.get(id(ranks))
    if seen is not None and seen[0]() is ranks and seen[2]() is lengths and seen[4] == B and seen[5] == K and \
            seen[1] == _version(ranks) and seen[3] == _version(lengths):
        return
    if not (torch.is_tensor(ranks) and torch.is_tensor(lengths) and ranks.dtype is L and lengths.dtype is L
            and ranks.is_cpu and lengths.is_cpu and ranks.dim() == 2 and ranks.size(1) == K
            and lengths.shape == ranks.shape[:1]):
        raise FairseqExtError(f"enumerated_group: ranks must be an int64 CPU tensor [C, {K}] and lengths one of [C] "
                              f"(got {getattr(ranks, 'dtype', '?')} {tuple(getattr(ranks, 'shape', ()))} and "
                              f"{getattr(lengths, 'dtype', '?')} {tuple(getattr(lengths, 'shape', ()))})")
    if ranks.numel() and (int(ranks.min()) < 0 or int(ranks.max()) >= B or int(lengths.min()) < 0
                          or int(lengths.max()) > K):
        raise FairseqExtError(f"enumerated_group: ranks must lie in [0, {B}) and lengths in [0, {K}]")
    if len(_checked_candidates) > 256:
        _checked_candidates.clear()
    _checked_candidates[id(ranks)] = (weakref.ref(ranks), _version(ranks), weakref.ref(lengths), _version(lengths),
                                      B, K)


def enumerated_group(scores: torch.Tensor, vals: torch.Tensor, words: torch.Tensor, eos_lp: torch.Tensor, n: int,
                     P: int, J: int, ranks: torch.Tensor, lengths: torch.Tensor):
    """The enumerated group step of :class:`fairseq_ext.sat.generator.SATSequenceGenerator` in one C call, with the
    same float32 numbers as its PyTorch ops (the cumulative sums in double, rounded per position). ``scores`` [N],
    ``vals`` / ``words`` [N, K, B], ``eos_lp`` [N, K], ``ranks`` [C, K], ``lengths`` [C] (N = n * P, J positions).
    Returns (cum [N, C, K], words [N, C, K], end [N, C], alive [N, C], fin [J, n, B]) as documented in
    ``fairseq_ext/sat/kernels/search_kernels.c``. Needs B <= :data:`GROUP_MAX_BEAM` and :func:`kernel`."""
    _check_group_args(scores, vals, words, eos_lp, n, P, J, ranks, lengths)
    N, K, B = vals.shape
    C = ranks.size(0)
    scores, vals, eos_lp, words = (t if t.is_contiguous() else t.contiguous() for t in (scores, vals, eos_lp, words))
    if not (ranks.is_contiguous() and lengths.is_contiguous()):
        ranks, lengths = ranks.contiguous(), lengths.contiguous()
    cum = torch.empty(N, C, K)
    cwords = torch.empty(N, C, K, dtype=torch.long)
    end = torch.empty(N, C)
    alive = torch.empty(N, C)
    fin = torch.empty(J, n, B, dtype=torch.long)
    kernel().fx_enumerated_group(scores.data_ptr(), vals.data_ptr(), words.data_ptr(), eos_lp.data_ptr(), n, P, K,
                                 B, J, ranks.data_ptr(), lengths.data_ptr(), C, cum.data_ptr(), cwords.data_ptr(),
                                 end.data_ptr(), alive.data_ptr(), fin.data_ptr())
    return cum, cwords, end, alive, fin
