"""Int8 linear layers on Intel AMX tiles for CPU decoding (opt-in: ``--inference-speedups amx-int8-decoder``
and ``amx-int8-encoder``, or :func:`fairseq_ext.inference.speedups.amx_quantize_decoder` /
``amx_quantize_encoder``).

PyTorch's dynamically quantised ``Linear`` (fbgemm, the ``int8-*`` flags) spends most of a small call outside
the product, and its per-row cost is what keeps a SAT call of K x B rows (a beam's K new positions for B
hypotheses) well above a 4-row call (``python benchmarks/bench_kernels.py --parts 5`` times both by row count;
docs/sat_transformer.md, "The AMX int8 kernel in isolation"). A CPU with AMX tiles (Intel Sapphire Rapids and later)
multiplies 16 rows of int8 by a 16 x 64 int8 tile in one instruction, so up to 16 rows cost what one row
costs. This module runs every ``nn.Linear`` of the decoder (encoder) through a small kernel on those tiles
(``fairseq_ext/inference/kernels/amx_int8.c``, plain C, built once on first use with the system C compiler and
cached):

    y[m, n] = sum_k qx[m, k] * qW[n, k] * sx[m] * sW[n] + b[n]

* weights: int8, one symmetric scale per output row, sW[n] = max_k |W[n, k]| / 127, made once from the float
  weight; the packed layout (16 outputs x 64 inputs per tile) is made at the same time;
* inputs: each row quantised on every call with its own symmetric scale, sx[m] = max_k |x[m, k]| / 127,
  rounded half to even (fbgemm's dynamic quantisation uses one 7-bit scale for the whole call);
* the int32 sums are exact; the scales and the bias are applied in float32 (one fused multiply-add).

:class:`AmxInt8Linear` equals that formula evaluated in float64 within float32 rounding
(``tests/inference/test_amx_int8.py`` checks 1e-6 of the output's scale, for 1 to 40 rows and sizes that are not
multiples of the tile). A row with a NaN or an infinity gives NaN outputs. The queries, keys and values of an
attention layer can run as one call (:meth:`AmxInt8Linear.stacked`: the outputs equal the three calls' bit for
bit), which the lean decoder and encoder use.

Inference only: the layers hold int8 copies, not parameters (``state_dict`` omits them; train and save the
float model), take float32 inputs on the CPU, and refuse autograd with one line. The kernel runs on the calling
thread, except calls of :data:`THREADED_WORK` multiply-adds or more (batched decoding), whose outputs are split
over ``torch.get_num_threads()`` threads (the same numbers). Where the CPU, the operating system or the compiler
cannot run it, the flags are refused with one line that says why; ``int8-decoder`` / ``int8-encoder`` then
remain. The library is built, cached and loaded by :mod:`fairseq_ext.inference.native` (``FAIRSEQ_EXT_CACHE``,
default ``~/.cache/fairseq_ext``, refused where another user could change what is loaded from it; ``CC``, GCC 11 /
Clang 12 or newer; ``FAIRSEQ_EXT_NATIVE=0`` turns it off). The layer checks what it hands to C (dtype, device,
shapes) and refuses anything else with one line.
"""

import ctypes
from pathlib import Path
from typing import List, Optional

import torch

from fairseq_ext.errors import FairseqExtError
from fairseq_ext.inference.native import NativeLibrary, build, cpu_flags

SOURCE = Path(__file__).with_name("kernels") / "amx_int8.c"
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mamx-tile", "-mamx-int8", "-shared",
          "-fPIC", "-pthread"]
# calls of at least this many multiply-adds (rows x outputs x inputs; e.g. 128 rows of an 8,000 x 256 softmax
# projection) split their outputs over torch.get_num_threads() threads; below it a new thread costs more than it
# saves (``python benchmarks/bench_kernels.py --parts 5 --threads 2 --qkv-rows 64 128 256`` times calls either side)
THREADED_WORK = 1 << 28
CPU_FLAGS = ("amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512dq")


def _cpu_refusal() -> Optional[str]:
    try:
        flags = cpu_flags()
    except FairseqExtError as e:
        return str(e)
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)} (AMX int8 needs Intel Sapphire Rapids or later)"
    return None


def _declare(lib) -> Optional[str]:
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.fx_amx_init.restype = I
    lib.fx_amx_packed_bytes.argtypes, lib.fx_amx_packed_bytes.restype = [I, I], ctypes.c_size_t
    lib.fx_amx_pack.argtypes, lib.fx_amx_pack.restype = [P, I, I, P], None
    lib.fx_amx_linear.argtypes, lib.fx_amx_linear.restype = [P, I, I, P, P, P, I, P, I], I
    if lib.fx_amx_init() != 0:
        return "the operating system refused the AMX tile state (Linux 5.16 or later grants it)"
    return None


NEEDS = "AMX intrinsics need gcc >= 11 or clang >= 12"
LIBRARY = NativeLibrary("AMX int8 kernel", SOURCE, CFLAGS, NEEDS, lambda: _cpu_refusal(), _declare)


def _build() -> Path:
    """The kernel library, compiled on first use and cached (:func:`fairseq_ext.inference.native.build`)."""
    return build(SOURCE, CFLAGS, NEEDS)


def kernel():
    """The loaded kernel (ctypes library); raises FairseqExtError with one line when it cannot run here."""
    return LIBRARY.load()


def refusal() -> Optional[str]:
    """None when the kernel runs here, else the reason (one line)."""
    return LIBRARY.refusal()


class AmxInt8Linear(torch.nn.Module):
    """An ``nn.Linear`` for inference on AMX tiles (module docstring): int8 weights with one scale per output row,
    each input row quantised with its own scale. Made by :meth:`from_linear`; holds no parameters."""

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        # what the C code reads: an int8 [N, K] weight, N float scales, N float biases, all in CPU memory
        ok = (torch.is_tensor(weight_int8) and weight_int8.dtype is torch.int8 and weight_int8.is_cpu
              and weight_int8.dim() == 2 and weight_int8.numel() > 0)
        N = weight_int8.size(0) if ok else -1

        def vector(t):
            return torch.is_tensor(t) and t.is_cpu and t.is_floating_point() and tuple(t.shape) == (N,)

        ok = ok and vector(weight_scale) and (bias is None or vector(bias))
        if not ok:
            raise FairseqExtError(
                f"AmxInt8Linear: takes an int8 CPU weight [N, K] and float CPU scales and bias [N] (got "
                f"{getattr(weight_int8, 'dtype', '?')} {tuple(getattr(weight_int8, 'shape', ()))}, scales "
                f"{tuple(getattr(weight_scale, 'shape', ()))}, bias "
                f"{None if bias is None else tuple(getattr(bias, 'shape', ()))})")
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
        if x.dtype is not torch.float32 or x.device.type != "cpu" or x.dim() < 1 or \
                (x.requires_grad and torch.is_grad_enabled()):
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
        if M and LIBRARY.lib.fx_amx_linear(x.data_ptr(), M, K, self.packed.data_ptr(), self.weight_scale.data_ptr(),
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
