"""The static step compiled ahead of time: ``torch.export`` and AOTInductor, once per model and machine, cached on
disk.

The static step's graph (:class:`~fairseq_ext.inference.static_step.StepGraph`) is traced at once by
``torch.jit.trace`` (milliseconds). AOTInductor compiles the same module into a shared library of fused C++ loops
around the matrix products, with no interpreter between the operations: faster per call, but compiling takes about a
minute and a C++ compiler. The products are inductor's C++ GEMM template wherever its compile-time timing picks it
over PyTorch's (``max_autotune`` with the ``CPP`` and ``ATEN`` backends; the weights, constants of the graph, packed
into the template's blocks at compile time): at a few rows a product is a read of its weights, which the template
streams without MKL's per-call setup. ``python -m benchmarks.speed.decode --capture`` times the traced step and
AOTInductor with and without the template. So, where a model's step is not yet in the cache, a background process
(niced, one thread) exports and compiles it while the search decodes on the traced graph; every search that starts
after the package is written takes it (the same process, or any later run: the second run pays nothing).

``FAIRSEQ_EXT_STEP_CAPTURE``: ``aot`` (the default, as above), ``trace`` (the traced graph only, nothing compiled or
started) or ``eager`` (the module op by op, nothing traced). ``FAIRSEQ_EXT_CACHE``: the cache directory (default
``$XDG_CACHE_HOME/fairseq_ext``, else ``~/.cache/fairseq_ext``); packages live in its ``static_step/``.

A package's name is a hash of what it computes: the graph module's weights (their bytes), settings and fixed input
sizes (K positions a call, layers, heads), the source of the files that define it (and of those its
``source_files`` name), the PyTorch and Python versions, the machine and the CPU capability PyTorch dispatches to
(a package compiled for AVX-512 is never loaded on a CPU without it). A package that fails to load is removed and
compiled again; a compile that failed leaves ``KEY.failed`` (its log) and is not retried. The packages are shared
libraries that this process loads and runs: the cache directory is made ``0o700``, and one that another user owns
or others can write into is neither read nor written (one log line). int8 graphs stay traced.

The compiled graph takes its inputs contiguous (the state keeps its caches so) and writes the caches in place as the
traced one does; its sums are ordered by its own kernels (differences ~1e-6, within the searches' near-tie margin:
``fairseq_ext.sat.step_rules.TIE_MARGIN``).
"""

import hashlib
import inspect
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

logger = logging.getLogger(__name__)

CAPTURE = "FAIRSEQ_EXT_STEP_CAPTURE"
CACHE = "FAIRSEQ_EXT_CACHE"
MODES = ("aot", "trace", "eager")
STALE_LOCK_SECONDS = 3600  # a compile's lock older than this is from a process that died


def mode() -> str:
    """``FAIRSEQ_EXT_STEP_CAPTURE`` (module docstring): ``aot``, ``trace`` or ``eager``."""
    from fairseq_ext.common.errors import FairseqExtError

    m = os.environ.get(CAPTURE, "").strip().lower() or "aot"
    if m not in MODES:
        raise FairseqExtError(f"{CAPTURE}={os.environ[CAPTURE]!r}: use one of {', '.join(MODES)} (the static "
                              f"decoder step compiled ahead of time, traced only, or op by op)")
    return m


def cache_dir() -> str:
    root = os.environ.get(CACHE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fairseq_ext")
    return os.path.join(root, "static_step")


def _feed(h, obj, seen) -> None:
    """Everything of a graph module's state that defines what it computes, into the hash ``h``."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.view(torch.uint8).reshape(-1).numpy())
    elif isinstance(obj, torch.nn.Module):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        h.update(f"M{type(obj).__module__}.{type(obj).__qualname__}".encode())
        _feed(h, {k: v for k, v in vars(obj).items() if not k.endswith("_hooks")}, seen)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(f"K{k}".encode())
            _feed(h, obj[k], seen)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _feed(h, v, seen)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        h.update(f"V{obj!r}".encode())
    elif callable(obj):
        h.update(f"F{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}".encode())
    else:
        h.update(f"O{type(obj).__module__}.{type(obj).__qualname__}".encode())


def package_key(module: torch.nn.Module, example, gemm_template: bool = True) -> str:
    """The name of ``module``'s package in the cache (module docstring: what the hash covers)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}|"
             f"{torch.backends.cpu.get_cpu_capability()}|{gemm_template}".encode())
    files = {__file__} | {inspect.getfile(c) for m in module.modules() for c in type(m).__mro__
                          if c.__module__.startswith("fairseq_ext")} | set(getattr(module, "source_files", ()))
    for f in sorted(files):
        with open(f, "rb") as fh:
            h.update(fh.read())
    _feed(h, module, set())
    for t in example:  # the static sizes among them (K positions a call, layers, heads, head width) too
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    return h.hexdigest()


def dynamic_shapes(example):
    """Which dimensions of the step's inputs vary (module docstring of static_step: rows N, cache length T,
    sources B, memory lengths S): every dimension of the inputs that are not empty, but the positions (K), the
    layers, heads and head width, which ``torch.export`` keeps static (``Dim.AUTO``). A module with inputs of its
    own says which of them vary (its ``dynamic_shapes(example)``)."""
    from torch.export import Dim

    tokens, idx, *rest = example
    return ({0: Dim.AUTO}, None) + tuple({1: Dim.AUTO, 3: Dim.AUTO} if t.dim() == 5 else
                                         {0: Dim.AUTO, 3: Dim.AUTO} if t.dim() == 4 else None for t in rest)


class AOTGraph:
    """A compiled package run through PyTorch's C++ loader. ``torch._inductor.aoti_load_package`` would import
    inductor and probe the CPU's vector ISAs with the C++ compiler (seconds at every start; the package key already
    holds the CPU capability) and its model parses its call spec at every call (~60 us); the loader loads in
    milliseconds and takes the flat list of tensors."""

    def __init__(self, path: str):
        self.path = path
        self.loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        self._run = self.loader.run

    def forward(self, *inputs):
        """A step graph's call (the caches, inputs 2 and 3, written in place)."""
        flat = [t if t.is_contiguous() else t.contiguous() for t in inputs]
        out = self._run(flat)
        for i in (2, 3):  # the caches are written in place
            if flat[i] is not inputs[i]:
                inputs[i].copy_(flat[i])
        return tuple(out)

    def run(self, *inputs):
        """A graph's call that writes none of its inputs."""
        return tuple(self._run([t if t.is_contiguous() else t.contiguous() for t in inputs]))

    __call__ = forward


class Pending:
    """A package being compiled (by this process's child, or by another process holding the lock)."""

    def __init__(self, path: str, proc: Optional[subprocess.Popen]):
        self.path, self.proc, self.failed = path, proc, False

    def ready(self) -> Optional[AOTGraph]:
        """The compiled graph once its package is written, else None (``failed`` once it cannot be)."""
        if os.path.exists(self.path):
            return _load(self.path)
        if os.path.exists(self.path[: -len(".pt2")] + ".failed") or (
                self.proc is not None and self.proc.poll() not in (None, 0)):
            self.failed = True
        return None

    def wait(self, timeout: float = 900.0) -> Optional[AOTGraph]:
        """Blocks until the package is written (benchmarks and tests)."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
                except subprocess.TimeoutExpired:
                    return None
            graph = self.ready()
            if graph is not None or self.failed:
                return graph
            time.sleep(1.0)
        return None


def _load(path: str) -> Optional[AOTGraph]:
    try:
        return AOTGraph(path)
    except Exception as e:  # noqa: BLE001  (a damaged or foreign package: compiled again next time)
        logger.info(f"static step: the compiled package {path} does not load ({type(e).__name__}: {e}); removed, "
                    f"decoding on the traced step")
        try:
            os.remove(path)
        except OSError:
            pass
        return None


def compiler_missing() -> Optional[str]:
    """Why AOTInductor cannot compile here (no C++ compiler), or None."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return None if any(shutil.which(n) for n in names) else f"no C++ compiler ({' / '.join(names)}) on PATH"


def unsafe_cache(d: str) -> Optional[str]:
    """Why the packages of the cache directory ``d`` must not be loaded (another user owns it or can write into
    it: a package is code this process runs), or None."""
    try:
        st = os.stat(d)
    except OSError:
        return None
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{d} belongs to another user"
    if st.st_mode & 0o022:
        return f"{d} is writable by others than its owner (chmod 700 it)"
    return None


def start(module: torch.nn.Module, example, what: str = "static step", meanwhile: str = "decoding on the traced step",
          gemm_template: bool = True) -> "Optional[AOTGraph | Pending]":
    """The compiled graph of ``module`` from the cache, or a :class:`Pending` compile started in the background
    (one log line), or None where the step stays traced (int8, another capture mode, no compiler, an unsafe or
    unwritable cache, a failed compile: one log line). The log lines name ``what`` is compiled and what runs
    ``meanwhile``; ``gemm_template=False`` leaves every product to PyTorch's (the benchmark's comparison)."""
    if mode() != "aot" or len(getattr(module, "int8", ())) or not hasattr(torch._C, "_aoti"):
        return None
    d = cache_dir()
    why = unsafe_cache(d)
    if why:
        logger.info(f"{what}: not compiled ahead of time ({why}); {meanwhile}")
        return None
    key = package_key(module, example, gemm_template)
    path = os.path.join(d, key + ".pt2")
    if os.path.exists(path):
        graph = _load(path)
        if graph is not None:
            return graph
    failed = os.path.join(d, key + ".failed")
    if os.path.exists(failed):
        logger.info(f"{what}: compiling it ahead of time failed earlier (log: {failed}); {meanwhile}")
        return None
    why = compiler_missing()
    if why:
        logger.info(f"{what}: not compiled ahead of time ({why}); {meanwhile}")
        return None
    lock = os.path.join(d, key + ".lock")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_SECONDS:
            os.remove(lock)
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:  # another process compiles it
        return Pending(path, None)
    except OSError as e:
        logger.info(f"{what}: not compiled ahead of time ({d}: {e.strerror}; {CACHE} names another "
                    f"directory); {meanwhile}")
        return None
    work = None
    try:
        work = tempfile.mkdtemp(prefix=key[:8] + "-", dir=d)
        torch.save({"module": module, "example": tuple(example), "gemm_template": gemm_template},
                   os.path.join(work, "spec.pt"))
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        with open(os.path.join(d, key + ".log"), "w") as log:
            proc = subprocess.Popen([sys.executable, "-c", "import sys; from fairseq_ext.inference.aot_step import "
                                     "main; sys.exit(main(sys.argv[1:]))", work, path], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=work,
                                    start_new_session=True)
    except OSError as e:  # a full disk, no fork: nothing half-written is left behind
        os.remove(lock)
        if work:
            shutil.rmtree(work, ignore_errors=True)
        logger.info(f"{what}: not compiled ahead of time ({type(e).__name__}: {e}); {meanwhile}")
        return None
    logger.info(f"{what}: compiling it ahead of time in the background (pid {proc.pid}, about a minute, once "
                f"per model; {path}); {meanwhile} until then ({CAPTURE}=trace: never)")
    return Pending(path, proc)


def compile_package(work: str, path: str) -> None:
    """The background process: the module saved in ``work`` exported and compiled into ``path`` (written under
    another name, then renamed: a reader never sees half a package)."""
    torch.set_num_threads(1)
    try:
        os.nice(10)
    except (AttributeError, OSError):
        pass
    spec = torch.load(os.path.join(work, "spec.pt"), weights_only=False)
    module, example = spec["module"], spec["example"]
    import torch._inductor.config as inductor_config
    from torch._inductor import aoti_compile_and_package

    if spec.get("gemm_template", True):  # the products: the template or PyTorch's, whichever times faster
        inductor_config.freezing = True  # the weights are constants the template packs
        inductor_config.max_autotune = True
        inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
    with torch.no_grad():
        shapes = module.dynamic_shapes(example) if hasattr(module, "dynamic_shapes") else dynamic_shapes(example)
        ep = torch.export.export(module, example, dynamic_shapes=shapes, strict=False)
        tmp = os.path.join(work, "package.pt2")
        aoti_compile_and_package(ep, package_path=tmp)
    os.replace(tmp, path)


def main(argv) -> int:
    """The background process of :func:`start`: ``WORK PATH``."""
    work, path = argv[:2]
    key = path[: -len(".pt2")]
    try:
        compile_package(work, path)
        return 0
    except BaseException:  # noqa: BLE001  (its log says why; never retried for this key)
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        shutil.copyfile(key + ".log", key + ".failed") if os.path.exists(key + ".log") else open(
            key + ".failed", "w").close()
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
        try:
            os.remove(key + ".lock")
        except OSError:
            pass

