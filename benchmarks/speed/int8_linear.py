"""The int8 linear paths of the libraries against float32, on the decoder's linear shapes of the release models,
by row count: which one to use per shape (the fastest int8 contender, by the geometric mean over the row counts).

    OMP_NUM_THREADS=1 python -m benchmarks.speed.int8_linear [--dims 128 256 512] [--rows 1 2 4 8 64]
        [--vocab 8000] [--threads 1] [--passes 10] [--budget 0.01] [--compile-limit 60] [--no-compile]
        [--json FILE] [--quick]

Shapes (outputs x inputs) for each model width d: the fused q/k/v projection 3d x d, the attention's output
projection d x d, the FFN's 4d x d and d x 4d, and the softmax projection V x d (--vocab). Contenders:

* ``float32``: ``torch.nn.functional.linear``, the reference;
* ``fbgemm``: PyTorch's dynamically quantised ``Linear`` (``torch.ao.quantization.quantize_dynamic``, the
  ``int8-*`` flags);
* ``onednn``: oneDNN's int8 kernel (``torch.ops.onednn.qlinear_prepack`` / ``qlinear_pointwise``) on fbgemm's
  int8 weights with a 7-bit activation quantisation, called as ``Int8RowsLinear`` calls it; run wherever the op
  works (with or without AMX tiles: the header names the implementation oneDNN picked);
* ``torchao``: torchao's int8 dynamic-activation / int8-weight quantisation, eager;
* ``torchao+compile``: the same through ``torch.compile`` (inductor, ``freezing`` on, as torchao advises on a
  CPU); dropped for the rest of the run, with a line, if a compile fails or takes over --compile-limit seconds.

A contender that cannot run here (torchao not installed) is skipped with a line. Each measurement point times all
contenders interleaved: --passes passes, each timing every contender over about --budget seconds of calls, the
fastest pass kept (microseconds per call), so a shared machine slows every contender alike. Printed: microseconds
and speed-up over float32 (float32 us / contender us), the fastest contender, and each contender's largest error
against the float32 output relative to its largest value. Last, per shape, the int8 contender with the best
geometric mean over the row counts of its speed-up over float32 (the decision line). ``--json`` writes it all.
``--quick`` (the test's run): d 128, the q/k/v and softmax shapes, rows 1 and 8, a short budget, no compile.
"""

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import re
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

from fairseq_ext.inference.lean_decoder import int8_weight_rows

CONTENDERS = {"float32": "float32", "fbgemm": "fbgemm", "onednn": "oneDNN", "torchao": "torchao",
              "torchao_compiled": "torchao+compile"}
INT8 = [k for k in CONTENDERS if k != "float32"]
TORCHAO_PIP = ".venv/bin/python -m pip install --no-deps torchao==0.18.0"


def shapes(d: int, vocab: int, quick: bool):
    """(name, outputs N, inputs K) of the decoder's products at width d."""
    every = [("QKV", 3 * d, d), ("out-proj", d, d), ("FFN in", 4 * d, d), ("FFN out", d, 4 * d),
             ("softmax", vocab, d)]
    return [s for s in every if s[0] in ("QKV", "softmax")] if quick else every


def interleaved_best_us(fns: dict, passes: int, budget_s: float) -> dict:
    """Microseconds per call of each function: each pass times every function in turn over about ``budget_s``
    seconds of calls (after a warm-up); the fastest pass of each is kept."""
    calls = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        fn()
        calls[name] = max(1, min(5000, int(budget_s / max(time.perf_counter() - t0, 1e-7))))
    best = {name: math.inf for name in fns}
    for _ in range(passes):
        for name, fn in fns.items():
            n = calls[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    return best


def onednn_isa() -> str:
    """The implementation oneDNN picks for a small int8 matmul (its verbose line), e.g. brg_matmul:avx512_core_vnni
    or one with amx; the CPU's ISA line when oneDNN prints it; 'unknown' when neither can be read."""
    w = torch.randint(-127, 128, (64, 64), dtype=torch.int8)
    x = torch.randint(0, 128, (4, 64), dtype=torch.uint8)
    sys.stdout.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                torch.ops.onednn.qlinear_pointwise(x, 0.1, 0, torch.ops.onednn.qlinear_prepack(w, None),
                                                   torch.ones(64), torch.zeros(64, dtype=torch.int64), None, 1.0,
                                                   0, torch.float32, "none", [], "")
        except RuntimeError:  # the op's own failure shows in the table's oneDNN column
            pass
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")
    impl = re.search(r"primitive,exec,cpu,matmul,([^,]+),", text)
    isa = re.search(r"info,cpu,isa:([^\n]+)", text)
    found = [f"implementation {impl.group(1)}" if impl else "", f"oneDNN's ISA: {isa.group(1).strip()}" if isa else ""]
    return "; ".join(s for s in found if s) or "unknown"


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or ['(no message)'])[0][:200]}"


def load_torchao(notes: list):
    """(quantize_, config factory) of the installed torchao, or None with a note."""
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:  # its CUDA extensions' "Failed to load" lines on a CPU build, an Enum registration notice
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao
            from torchao.quantization import quantize_
            try:
                from torchao.quantization import Int8DynamicActivationInt8WeightConfig as config
            except ImportError:  # torchao before the Config classes
                from torchao.quantization import int8_dynamic_activation_int8_weight as config
    except Exception as e:  # not installed, or built for another torch (its import raises what it raises)
        missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "torchao"
        why = "not installed" if missing else f"does not import ({first_line(e)})"
        notes.append(f"torchao skipped: {why}; `{TORCHAO_PIP}` (run from the repository root) adds it")
        return None
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    notes.append(f"torchao {getattr(torchao, '__version__', '?')}: {config.__name__}")
    return quantize_, config


def amx_tiles() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - an older or different PyTorch build
        return False


def onednn_available(notes: list) -> bool:
    if "onednn" not in torch.backends.quantized.supported_engines or not hasattr(torch.ops.onednn,
                                                                                 "qlinear_pointwise"):
        notes.append("oneDNN skipped: this PyTorch build has no onednn int8 engine or qlinear_pointwise op")
        return False
    return True


def build(lin: torch.nn.Linear, available: dict, torchao_api) -> dict:
    """contender -> a function of the input rows, for the contenders available."""
    w, b = lin.weight.detach(), lin.bias.detach()
    fns = {"float32": lambda x: F.linear(x, w, b)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        from torch.ao.quantization import quantize_dynamic

        fbgemm = quantize_dynamic(torch.nn.Sequential(copy.deepcopy(lin)), {torch.nn.Linear}, dtype=torch.qint8)[0]
    fns["fbgemm"] = fbgemm
    if available["onednn"]:
        qw, qb = fbgemm._packed_params._weight_bias()
        values, scales = int8_weight_rows(qw)  # fbgemm's int8 weights, one scale per output row
        packed = torch.ops.onednn.qlinear_prepack(values, None)
        scales, zps, K, N = scales.float(), torch.zeros(qw.size(0), dtype=torch.int64), lin.in_features, qw.size(0)

        def onednn(x):  # Int8RowsLinear.forward's oneDNN call
            qx = torch.quantize_per_tensor_dynamic(x.reshape(-1, K), torch.quint8, True)
            y = torch.ops.onednn.qlinear_pointwise(qx.int_repr(), qx.q_scale(), qx.q_zero_point(), packed, scales,
                                                   zps, qb, 1.0, 0, torch.float32, "none", [], "")
            return y.view(*x.shape[:-1], N)

        fns["onednn"] = onednn
    if torchao_api is not None:
        quantize_, config = torchao_api
        ao = torch.nn.Sequential(copy.deepcopy(lin))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_(ao, config())
        fns["torchao"] = ao
        if available["torchao_compiled"]:
            # every module shares forward's code, whose compiled versions dynamo caches up to its recompile
            # limit and then runs eagerly without a word: each shape starts from an empty cache
            torch._dynamo.reset()
            fns["torchao_compiled"] = torch.compile(ao, dynamic=True)
    return fns


def measure(a, available, torchao_api, notes):
    """One dict per (d, shape, rows): microseconds, speed-ups over float32, errors, the best library path."""
    results, compile_s = [], {}
    for d in a.dims:
        for name, N, K in shapes(d, a.vocab, a.quick):
            g = torch.Generator().manual_seed(d * 7 + N)
            lin = torch.nn.Linear(K, N)
            with torch.no_grad():
                lin.weight.normal_(0, K ** -0.5, generator=g)
            fns = build(lin, available, torchao_api)
            for R in a.rows:
                x = torch.randn(R, K, generator=g)
                ref = F.linear(x, lin.weight, lin.bias)
                err = {}
                for key in list(fns):
                    t0 = time.perf_counter()
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            y = fns[key](x)
                    except Exception as e:  # a compile failure: one line, the run goes on
                        if key != "torchao_compiled":
                            raise
                        notes.append(f"torchao+compile dropped: compiling {N} x {K} for {R} rows failed "
                                     f"({first_line(e)})")
                        available["torchao_compiled"] = False
                        del fns[key]
                        continue
                    took = time.perf_counter() - t0
                    if key == "torchao_compiled":
                        compile_s[f"d{d} {N}x{K} rows {R}"] = round(took, 2)
                        if took > a.compile_limit:
                            notes.append(f"torchao+compile dropped after {N} x {K}, {R} rows: a compile took "
                                         f"{took:.0f} s (over --compile-limit {a.compile_limit:g} s)")
                            available["torchao_compiled"] = False
                    err[key] = (y - ref).abs().max().item() / ref.abs().max().item()
                us = interleaved_best_us({k: (lambda f=f: f(x)) for k, f in fns.items()}, a.passes, a.budget)
                if not available["torchao_compiled"]:
                    fns.pop("torchao_compiled", None)
                results.append({
                    "d": d, "shape": name, "N": N, "K": K, "rows": R, "us": us, "err": err,
                    "x_float32": {k: us["float32"] / t for k, t in us.items()}, "fastest": min(us, key=us.get)})
    return results, compile_s


def fmt(v, spec, width):
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"


def report(results, notes, header):
    for line in header + notes:
        print(line)
    shown = [k for k in CONTENDERS if any(k in r["us"] for r in results)] or ["float32"]
    int8 = [k for k in shown if k != "float32"]
    print("\nmicroseconds per call (x: float32 us / contender us; fastest: of all contenders, float32 included)")
    top = f"{'d':>4} {'shape':<9} {'N x K':>11} {'rows':>4} {'float32 us':>10}"
    top += "".join(f" {CONTENDERS[k] + ' us':>{len(CONTENDERS[k]) + 3}} {'x':>6}" for k in int8)
    print(top + f" {'fastest':>15}")
    for r in results:
        nk = f"{r['N']} x {r['K']}"
        line = f"{r['d']:>4} {r['shape']:<9} {nk:>11} {r['rows']:>4} {r['us']['float32']:>10.1f}"
        for k in int8:
            line += f" {fmt(r['us'].get(k), '.1f', len(CONTENDERS[k]) + 3)} {fmt(r['x_float32'].get(k), '.2f', 5)}"
            line += " " if k not in r["us"] else "x"
        print(line + f" {CONTENDERS[r['fastest']]:>15}")
    print("\nlargest error against float32, relative to the largest |float32 output|")
    print(f"{'d':>4} {'shape':<9} {'rows':>4}" + "".join(f" {CONTENDERS[k]:>15}" for k in shown))
    for r in results:
        print(f"{r['d']:>4} {r['shape']:<9} {r['rows']:>4}" + "".join(f" {fmt(r['err'].get(k), '.1e', 15)}"
                                                                     for k in shown))


def decisions(results):
    """Per shape: the int8 contender with the best geometric mean over the row counts of float32 us / its us (the
    path to use for that shape), and the line to print."""
    out = []
    for key in dict.fromkeys((r["d"], r["shape"], r["N"], r["K"]) for r in results):
        group = [r for r in results if (r["d"], r["shape"], r["N"], r["K"]) == key]
        gmean = {k: math.exp(sum(math.log(r["x_float32"][k]) for r in group) / len(group))
                 for k in INT8 if all(k in r["x_float32"] for r in group)}
        what = f"d {key[0]:>3} {key[1]:<9} {key[2]:>5} x {key[3]:<5}"
        best = max(gmean, key=gmean.get)
        others = ", ".join(f"{CONTENDERS[k]} {v:.2f}x" for k, v in gmean.items() if k != best)
        out.append({"d": key[0], "shape": key[1], "fastest_int8": best, "x_float32": gmean,
                    "line": f"{what} fastest int8: {CONTENDERS[best]} {gmean[best]:.2f}x float32 [{others}]"})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.int8_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[128, 256, 512], help="model widths d")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 64])
    p.add_argument("--vocab", type=int, default=8000, help="V of the softmax projection V x d")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--passes", type=int, default=10, help="timed passes per point; the fastest is kept")
    p.add_argument("--budget", type=float, default=0.01, help="seconds of calls per contender and pass")
    p.add_argument("--compile-limit", type=float, default=60.0,
                   help="a torch.compile over this many seconds drops torchao+compile for the rest of the run")
    p.add_argument("--no-compile", action="store_true", help="skip torchao+compile")
    p.add_argument("--json", metavar="FILE", help="write the settings, notes, results and decisions here")
    p.add_argument("--quick", action="store_true",
                   help="d 128, the q/k/v and softmax shapes, rows 1 and 8, 2 passes of 2 ms, no compile")
    a = p.parse_args(argv)
    if a.quick:
        a.dims, a.rows, a.passes, a.budget, a.no_compile = [128], [1, 8], 2, 0.002, True
    if min(a.dims + a.rows + [a.vocab, a.threads, a.passes]) < 1 or a.budget <= 0 or a.compile_limit <= 0:
        p.error("--dims, --rows, --vocab, --threads, --passes, --budget and --compile-limit must be positive")
    threads, lock_log = torch.get_num_threads(), logging.getLogger("filelock")
    level = lock_log.level
    torch.set_num_threads(a.threads)
    lock_log.setLevel(logging.WARNING)  # fairseq's import sets the root logger to DEBUG; inductor takes file locks
    try:
        return run(a)
    finally:
        torch.set_num_threads(threads)
        lock_log.setLevel(level)


def run(a):
    notes = []
    available = {"onednn": onednn_available(notes)}
    torchao_api = load_torchao(notes)
    available["torchao_compiled"] = torchao_api is not None and not a.no_compile
    if torchao_api is not None and a.no_compile:
        notes.append("torchao+compile skipped (--no-compile" + (", implied by --quick)" if a.quick else ")"))
    isa = onednn_isa() if available["onednn"] else "-"
    cpu = {"capability": torch.backends.cpu.get_cpu_capability(), "amx_tiles": amx_tiles(), "onednn": isa,
           "quantized_engine": torch.backends.quantized.engine}
    header = [f"int8 linear layers against float32: torch {torch.__version__}, {a.threads} thread(s), fastest of "
              f"{a.passes} interleaved passes of ~{a.budget * 1e3:g} ms per contender",
              f"CPU: PyTorch capability {cpu['capability']}, AMX tiles: {'yes' if cpu['amx_tiles'] else 'no'}; "
              f"oneDNN int8 matmul: {isa}; fbgemm via the '{cpu['quantized_engine']}' quantized engine"]
    compiling = torch._inductor.config.patch(freezing=True) if available["torchao_compiled"] else \
        contextlib.nullcontext()
    with torch.inference_mode(), compiling:
        results, compile_s = measure(a, available, torchao_api, notes)
    if compile_s:
        slowest = max(compile_s, key=compile_s.get)
        notes.append(f"torch.compile: first calls took {sum(compile_s.values()):.0f} s in all, the longest "
                     f"{compile_s[slowest]:.1f} s ({slowest}; each in the JSON)")
    report(results, notes, header)
    lines = decisions(results)
    print("\ndecision per shape (geometric mean over the row counts of float32 us / contender us):")
    for line in lines:
        print(line["line"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(a).items() if k != "json"}, "cpu": cpu, "notes": notes,
                       "contenders": CONTENDERS, "compile_s": compile_s, "results": results, "decisions": lines},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
