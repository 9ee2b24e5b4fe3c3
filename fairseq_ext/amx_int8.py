"""Int8 linear layers on Intel AMX tiles for CPU decoding (opt-in: ``--inference-speedups amx-int8-decoder``
and ``amx-int8-encoder``, or :func:`fairseq_ext.inference.amx_quantize_decoder` / ``amx_quantize_encoder``).

PyTorch's dynamically quantised ``Linear`` (fbgemm, the ``int8-*`` flags) spends most of a small call outside
the product: on the quickstart model's 256 x 256 projections about 22 us for 1 row and 29 us for 16, and its
per-row cost is what keeps a SAT call of K x B rows (a beam's K new positions for B hypotheses) well above a
4-row call (docs/sat_transformer.md, "Run M"). A CPU with AMX tiles (Intel Sapphire Rapids and later)
multiplies 16 rows of int8 by a 16 x 64 int8 tile in one instruction, so up to 16 rows cost what one row
costs. This module runs every ``nn.Linear`` of the decoder (encoder) through a small kernel on those tiles
(``fairseq_ext/native/amx_int8.c``, plain C, built once on first use with the system C compiler and cached):

    y[m, n] = sum_k qx[m, k] * qW[n, k] * sx[m] * sW[n] + b[n]

* weights: int8, one symmetric scale per output row, sW[n] = max_k |W[n, k]| / 127, made once from the float
  weight; the packed layout (16 outputs x 64 inputs per tile) is made at the same time;
* inputs: each row quantised on every call with its own symmetric scale, sx[m] = max_k |x[m, k]| / 127,
  rounded half to even (fbgemm's dynamic quantisation uses one 7-bit scale for the whole call);
* the int32 sums are exact; the scales and the bias are applied in float32 (one fused multiply-add).

:class:`AmxInt8Linear` equals that formula evaluated in float64 within float32 rounding (``tests/test_amx_int8.py``
checks 1e-6 of the output's scale, for 1 to 40 rows and sizes that are not multiples of the tile). A row with a
NaN or an infinity gives NaN outputs. The queries, keys and values of an attention layer can run as one call
(:meth:`AmxInt8Linear.stacked`: the outputs equal the three calls' bit for bit), which the lean decoder and
encoder use.

Inference only: the layers hold int8 copies, not parameters (``state_dict`` omits them; train and save the
float model), take float32 inputs on the CPU, and refuse autograd with one line. The kernel runs on the calling
thread, except calls of :data:`THREADED_WORK` multiply-adds or more (batched decoding), whose outputs are split
over ``torch.get_num_threads()`` threads (the same numbers). Where the CPU, the operating system or the compiler
cannot run it, the flags are refused with one line that says why; ``int8-decoder`` /
``int8-encoder`` then remain. ``FAIRSEQ_EXT_CACHE`` (default ``~/.cache/fairseq_ext``) holds the built
library, named by a hash of the source and the flags and loaded as it is found there, so a directory that
another user owns or that group or others can write is refused. ``CC`` picks the compiler (default ``cc``, GCC 11 / Clang 12 or newer).
"""

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import torch

from fairseq_ext.errors import FairseqExtError

SOURCE = Path(__file__).with_name("native") / "amx_int8.c"
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mamx-tile", "-mamx-int8", "-shared",
          "-fPIC", "-pthread"]
# calls of at least this many multiply-adds (rows x outputs x inputs; e.g. 128 rows of an 8,000 x 256 softmax
# projection) split their outputs over torch.get_num_threads() threads; a new thread costs ~0.1 ms here
THREADED_WORK = 1 << 28
CPU_FLAGS = ("amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512dq")

_lib = None  # the loaded kernel library
_refusal = None  # why it cannot run here (one line), once known


def _cpu_refusal() -> Optional[str]:
    if sys.platform != "linux" or not hasattr(os, "sched_getaffinity"):
        return f"it runs on Linux only (this is {sys.platform})"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError as e:
        return f"/proc/cpuinfo cannot be read ({e})"
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)} (AMX int8 needs Intel Sapphire Rapids or later)"
    return None


def _build(source: Path = SOURCE, cflags: List[str] = CFLAGS,
           needs: str = "AMX intrinsics need gcc >= 11 or clang >= 12") -> Path:
    """The kernel library, compiled from ``source`` (default :data:`SOURCE`) on first use and cached by the
    source's and flags' hash; ``needs`` (what the compiler must support) goes into the refusal of a failed build.
    :mod:`fairseq_ext.search_kernels` builds its kernel through it too."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise FairseqExtError("no C compiler found (set CC or install gcc >= 11)")
    command = shlex.split(cc)  # CC may carry a wrapper or flags ("ccache gcc")
    tag = hashlib.sha256(source.read_bytes() + " ".join(command + cflags).encode()).hexdigest()[:16]
    cache = os.environ.get("FAIRSEQ_EXT_CACHE")
    if not cache:
        try:
            cache = Path.home() / ".cache" / "fairseq_ext"
        except RuntimeError:  # no home directory (some CI and container users)
            cache = Path(tempfile.gettempdir()) / f"fairseq_ext-{os.getuid()}"
    cache = Path(cache)
    lib = cache / f"{source.stem}-{tag}.so"
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = cache.stat()
    except OSError as e:
        raise FairseqExtError(f"cannot write the built kernel to {cache} ({e}); set FAIRSEQ_EXT_CACHE")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:  # a library found there is loaded: nobody else may write
        raise FairseqExtError(f"{cache} is not a directory of this user's alone (owner or group/other write); "
                              f"set FAIRSEQ_EXT_CACHE to one")
    if lib.exists():
        return lib
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
    except OSError as e:
        raise FairseqExtError(f"cannot write the built kernel to {cache} ({e}); set FAIRSEQ_EXT_CACHE")
    try:
        try:
            run = subprocess.run([*command, *cflags, str(source), "-o", tmp], capture_output=True, text=True)
        except OSError as e:
            raise FairseqExtError(f"cannot run the C compiler {cc!r} ({e}); set CC")
        if run.returncode != 0:
            first = next((line for line in run.stderr.splitlines() if "error" in line), run.stderr.strip()[:200])
            raise FairseqExtError(f"{cc} could not build {source.name} ({needs}): {first}")
        os.replace(tmp, lib)  # atomic: a concurrent build leaves one complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def kernel():
    """The loaded kernel (ctypes library); raises FairseqExtError with one line when it cannot run here."""
    global _lib, _refusal
    if _lib is not None:
        return _lib
    if _refusal is None:
        try:
            why = _cpu_refusal()
            if why is None:
                lib = ctypes.CDLL(str(_build()))
                P, I = ctypes.c_void_p, ctypes.c_int
                lib.fx_amx_init.restype = I
                lib.fx_amx_packed_bytes.argtypes, lib.fx_amx_packed_bytes.restype = [I, I], ctypes.c_size_t
                lib.fx_amx_pack.argtypes, lib.fx_amx_pack.restype = [P, I, I, P], None
                lib.fx_amx_linear.argtypes, lib.fx_amx_linear.restype = [P, I, I, P, P, P, I, P, I], I
                if lib.fx_amx_init() != 0:
                    why = "the operating system refused the AMX tile state (Linux 5.16 or later grants it)"
                else:
                    _lib = lib
                    return lib
        except FairseqExtError as e:
            why = str(e)
        except OSError as e:
            why = f"the built kernel does not load ({e})"
        _refusal = why
    raise FairseqExtError(f"AMX int8 kernel unavailable: {_refusal}")


def refusal() -> Optional[str]:
    """None when the kernel runs here, else the reason (one line)."""
    try:
        kernel()
        return None
    except FairseqExtError as e:
        return str(e)


class AmxInt8Linear(torch.nn.Module):
    """An ``nn.Linear`` for inference on AMX tiles (module docstring): int8 weights with one scale per output row,
    each input row quantised with its own scale. Made by :meth:`from_linear`; holds no parameters."""

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        lib = kernel()
        self.out_features, self.in_features = weight_int8.shape
        # plain attributes, not buffers: .to() / .half() of the model must not cast or move what the kernel reads
        self.weight_int8 = weight_int8.contiguous()
        self.weight_scale = weight_scale.to(torch.float32).contiguous()
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.packed = torch.empty(lib.fx_amx_packed_bytes(self.out_features, self.in_features), dtype=torch.int8)
        lib.fx_amx_pack(self.weight_int8.data_ptr(), self.out_features, self.in_features, self.packed.data_ptr())

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "AmxInt8Linear":
        if linear.weight.device.type != "cpu":
            raise FairseqExtError(f"amx-int8 layers run on the CPU; this model is on {linear.weight.device.type} "
                                  f"(load it on the CPU, or decode without amx-int8-*)")
        with torch.no_grad():
            w = linear.weight.detach().to(torch.float32)
            scale = w.abs().amax(dim=1) / 127  # Sw[n]
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
            q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale, linear.bias)

    @classmethod
    def stacked(cls, modules: List["AmxInt8Linear"]) -> "AmxInt8Linear":
        """One module whose outputs are ``modules``' outputs side by side, bit for bit (each output keeps its
        weights, scale and bias; the input rows are quantised once, as each call would)."""
        biases = [m.bias if m.bias is not None else torch.zeros(m.out_features) for m in modules]
        return cls(torch.cat([m.weight_int8 for m in modules]), torch.cat([m.weight_scale for m in modules]),
                   torch.cat(biases))

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not torch.float32 or x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
            raise FairseqExtError(
                f"AmxInt8Linear (amx-int8 speed-ups) is for float32 CPU inference without autograd (got a "
                f"{x.dtype} {x.device.type} input{' that requires grad' if x.requires_grad else ''}); "
                f"train, save or move the float model instead")
        K, N = self.in_features, self.out_features
        if x.size(-1) != K:
            raise FairseqExtError(f"AmxInt8Linear: input of {x.size(-1)} features, the layer takes {K}")
        if not x.is_contiguous():
            x = x.contiguous()
        M = x.numel() // K
        out = torch.empty(x.shape[:-1] + (N,))  # no reshape or view: each costs microseconds per call
        if M and _lib.fx_amx_linear(x.data_ptr(), M, K, self.packed.data_ptr(), self.weight_scale.data_ptr(),
                                    0 if self.bias is None else self.bias.data_ptr(), N, out.data_ptr(),
                                    torch.get_num_threads() if M * N * K >= THREADED_WORK else 1):
            raise MemoryError(f"AmxInt8Linear: no memory for {M} x {K} quantised inputs")
        return out


def replace_linears(module: torch.nn.Module, name: str) -> int:
    """Every ``nn.Linear`` under ``module`` becomes an :class:`AmxInt8Linear` (a module used in several places
    becomes one shared replacement); returns how many. ``name`` (the flag) prefixes the refusal."""
    try:
        kernel()
    except FairseqExtError as e:
        raise FairseqExtError(f"{name}: {e}; decode with int8-decoder / int8-encoder instead")
    done = {}
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                if id(child) not in done:
                    done[id(child)] = AmxInt8Linear.from_linear(child)
                setattr(parent, child_name, done[id(child)])
    return len(done)
