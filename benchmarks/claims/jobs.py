"""The job scheduler of python -m benchmarks.claims: resumable jobs, run one or two at a time, each in its own
process.

A job is a named step (train a model, decode a split, distil a corpus, time decoders) with the settings that
define its output. Its result (a JSON dictionary) is stored in ``WORKDIR/results/NAME.json`` with a hash of those
settings and of the settings of the jobs it depends on: a re-run skips every job whose result is there with the
same hash, and re-runs a job (and everything after it) whose settings changed. Jobs run in worker threads, each
one driving child processes (fairseq's command lines, or ``python -m benchmarks.claims.work`` for the Python
steps) with ``OMP_NUM_THREADS`` set to the job's thread count; ``--jobs 2`` runs two one-thread jobs side by side
on a 2-core machine (``OMP_WAIT_POLICY=PASSIVE``: spinning OpenMP threads of two processes on two cores slow both
many times over). A job marked ``exclusive`` (timings) runs alone.

With a ``store`` (``python -m benchmarks.claims`` keeps one per paper in the repository, ``benchmarks/claims/store``),
each result is also written there, and a step whose result is in the store with the same hash is skipped even when
the work directory is new: a run too long for one machine session goes on in the next one from the results that
were committed. The files of a step (a corpus, a checkpoint, hypotheses) are not kept there, except the
checkpoints it names to keep (below): a step still to run that depends on a finished step whose result came from
the store, or whose files named in its result are gone, runs that step again first (and, the same way, what it
depends on), so that a re-run makes the files it reads. Such a
re-run keeps the step's recorded result (what later steps already used) and adds what it made under ``remade``.
A step can name checkpoints to keep (``Job.keep``: keys of its result): those are copied into the store
(``STORE/files``, without the optimizer's state) when the step ends, and put back in a later session instead of
training again, so that a step reading them (a timing, a release) can run sessions after the training.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

POLL = 0.05  # seconds between looks at the running steps
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ClaimsError(Exception):
    """A one-line error for the user (a failed step names its log)."""


class ClaimsPaused(ClaimsError):
    """No training started past the run's start window (``--start-within``) and nothing else could run: what
    finished is kept, the same command goes on."""


def read_json(path, default=None):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deep
        return default


def read_object(path):
    """(the JSON object in ``path`` or None, why it is damaged or None); a missing file is not damaged."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, RecursionError) as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object"
    return obj, None


def write_json(path, obj):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
    os.replace(path + ".tmp", path)


_COMMIT = None


def code_commit() -> str:
    """The commit of the code a result is computed with: ``git rev-parse HEAD``, with ``+changes`` when the
    package or the benchmarks differ from it ("unknown" outside a git checkout). Recorded in every result, not
    hashed: a new commit does not re-run finished steps, the report says when its results come from several."""
    global _COMMIT
    if _COMMIT is None:
        try:
            head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "fairseq_ext", "benchmarks",
                                    ":(exclude)benchmarks/claims/store"],  # results, not code
                                   cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
            _COMMIT = (head + ("+changes" if dirty else "")) if head else "unknown"
        except (OSError, subprocess.SubprocessError):
            _COMMIT = "unknown"
    return _COMMIT


def rebase(obj, old: Optional[str], new: str):
    """``obj`` with every path under the work directory ``old`` under ``new`` instead (a result from the store,
    recorded in another work directory, names the files its step makes here)."""
    if not old or old == new:
        return obj
    if isinstance(obj, str):
        return new + obj[len(old):] if obj == old or obj.startswith(old + os.sep) else obj
    if isinstance(obj, dict):
        return {k: rebase(v, old, new) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rebase(v, old, new) for v in obj]
    return obj


def settings_hash(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Job:
    name: str  # unique, used in file names: "sat-k2", "sat-k2-eval"
    run: Callable[["Job", "Scheduler"], dict]  # does the work, returns the result
    settings: dict  # what defines the output
    deps: List[str] = field(default_factory=list)
    threads: int = 1
    exclusive: bool = False  # runs alone (a timing)
    what: str = ""  # a few words for the progress line
    keep: List[str] = field(default_factory=list)  # keys of its result naming checkpoints the store keeps
    reads_files: bool = True  # False: it reads only its deps' results (their files need not be here)
    training: bool = False  # none starts after the run's start window (``Scheduler.start_by``)


class Scheduler:
    """Runs jobs in dependency order, ``jobs`` at a time (exclusive ones alone), skipping finished ones."""

    def __init__(self, workdir: str, jobs: int = 1, say=print, store: Optional[str] = None):
        self.W = os.path.abspath(workdir)
        self.store = os.path.abspath(store) if store else None
        self.from_store: set = set()  # steps whose result came from the store: their files are not here
        self.remaking: Dict[str, dict] = {}  # steps run again to make their files: their recorded results
        self.max_jobs = jobs
        self.say = say
        self.jobs: Dict[str, Job] = {}
        self.results: Dict[str, dict] = {}
        self.hashes: Dict[str, str] = {}
        self.lock = threading.Lock()
        self.start_by: Optional[float] = None  # time.time() after which no training starts (``--start-within``)

    def add(self, job: Job) -> Job:
        if job.name in self.jobs:
            raise ClaimsError(f"two jobs are named {job.name}")
        self.jobs[job.name] = job
        return job

    # -- paths -------------------------------------------------------------------------------------------
    def result_path(self, name):
        return os.path.join(self.W, "results", f"{name}.json")

    def stored_path(self, name):
        return os.path.join(self.store, f"{name}.json")

    def kept_path(self, name, key):
        return os.path.join(self.store, "files", f"{name}.{key}.pt")

    def keep(self, name):
        """Copies the checkpoints that the result of ``name`` names under its job's ``keep`` keys into the store
        (:func:`work.keep`: without the optimizer's state) and records each copy's sha256 in the stored result."""
        job, res = self.jobs[name], self.results[name]
        kept = dict(res.get("kept") or {})
        for key in job.keep if self.store else ():
            path = res.get(key)
            if key in kept or not isinstance(path, str) or not os.path.isfile(path):
                continue
            out = self.kept_path(name, key)
            got = self.worker("keep", {"ckpt": path, "output": out}, self.log(name, "keep.log"))
            kept[key] = {"file": os.path.relpath(out, self.store), "sha256": got["sha256"]}
            self.say(f"kept   {name}'s {key} in the store: {os.path.relpath(out, ROOT)} "
                     f"({got['bytes'] / 2 ** 20:.1f} MiB)")
        if kept != (res.get("kept") or {}):
            res = {**res, "kept": kept}
            write_json(self.result_path(name), res)
            write_json(self.stored_path(name), res)
            with self.lock:
                self.results[name] = res

    def restore(self, name) -> bool:
        """Puts the checkpoints the store keeps for ``name`` back where its result names them (when their sha256
        is the recorded one); True when every file its job keeps is then here."""
        from fairseq_ext.checkpoints.release import sha256

        job, res = self.jobs[name], self.results[name]
        kept = res.get("kept") or {}
        if not job.keep or any(key not in kept for key in job.keep):
            return False
        for key in job.keep:
            dest, src = res.get(key), os.path.join(self.store or "", kept[key]["file"])
            if not isinstance(dest, str) or not dest.startswith(self.W + os.sep):
                return False
            if os.path.isfile(dest):
                continue
            if not os.path.isfile(src) or sha256(src) != kept[key]["sha256"]:
                self.say(f"warning: {src}, kept for {name}, is missing or not the file kept: {name} runs again")
                return False
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(src, dest + ".tmp")
            os.replace(dest + ".tmp", dest)
            self.say(f"restored {name}'s {key} from the store")
        return True

    def has_files(self, name) -> bool:
        """Whether the files later steps read of the finished step ``name`` are here (put back from the store
        where it keeps them)."""
        job, res = self.jobs[name], self.results[name]
        if job.keep:
            return all(isinstance(res.get(k), str) and os.path.isfile(res[k]) for k in job.keep) or self.restore(name)
        return name not in self.from_store and not self.missing_files(res)

    def log(self, name, what="log"):
        os.makedirs(os.path.join(self.W, "logs"), exist_ok=True)
        return os.path.join(self.W, "logs", f"{name}.{what}")

    def dir(self, *parts):
        d = os.path.join(self.W, *parts)
        os.makedirs(d, exist_ok=True)
        return d

    # -- hashing and skipping ------------------------------------------------------------------------------
    def job_hash(self, name) -> str:
        if name not in self.hashes:
            job = self.jobs[name]
            self.hashes[name] = settings_hash({"settings": job.settings,
                                               "deps": [self.job_hash(d) for d in job.deps]})
        return self.hashes[name]

    def done(self, name) -> Optional[dict]:
        """The result of ``name`` from the work directory, else from the store, where its hash is the job's."""
        paths = [self.result_path(name)] + ([self.stored_path(name)] if self.store else [])
        for path in paths:
            old, damaged = read_object(path)
            if damaged:
                self.say(f"warning: the result file {path} is damaged ({damaged}): step {name} runs again"
                         + (" unless the store holds its result" if path != paths[-1] else ""))
            if old and old.get("settings_hash") == self.job_hash(name) and old.get("ok"):
                if path != paths[0]:
                    self.from_store.add(name)
                return rebase(old, old.get("workdir"), self.W)
        return None

    def missing_files(self, result) -> List[str]:
        """The paths of the work directory that ``result`` names and that do not exist (a result from the store)."""
        out: List[str] = []
        stack = [result]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                if v.startswith(self.W + os.sep) and not os.path.exists(v):
                    out.append(v)
            elif isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
        return out

    def result(self, name) -> dict:
        return self.results[name]

    # -- running ----------------------------------------------------------------------------------------
    def run_all(self, names: Optional[List[str]] = None):
        wanted = self._closure(names or list(self.jobs))
        pending = [n for n in self.jobs if n in wanted]  # in the order they were added
        for n in list(pending):
            old = self.done(n)
            if old is not None:
                self.results[n] = old
                pending.remove(n)
        # a finished step whose files are not here (its result from the store, or files it names gone) runs again
        # where a step to run depends on it
        again, stack = [], list(pending)
        while stack:
            job = self.jobs[stack.pop()]
            for d in job.deps if job.reads_files else ():
                if d in self.results and d not in pending and not self.has_files(d):
                    self.remaking[d] = self.results.pop(d)
                    pending.append(d)
                    again.append(d)
                    stack.append(d)
        order = list(self.jobs)
        pending.sort(key=order.index)
        self.from_store.difference_update(again)
        if again:
            self.say(f"{len(again)} finished steps run again to remake the files later steps read (their results "
                     f"came from the store): {', '.join(sorted(again, key=order.index))}")
        skipped = len(wanted) - len(pending)
        if skipped:
            self.say(f"{skipped} of {len(wanted)} steps finished earlier with the same settings: skipped")
        running: Dict[str, threading.Thread] = {}
        errors: List[str] = []
        t_start = time.time()
        while pending or running:
            for n, th in list(running.items()):
                if not th.is_alive():
                    th.join()
                    del running[n]
            if errors:
                if not running:
                    raise ClaimsError(errors[0])
                time.sleep(POLL)
                continue
            started = False
            closed = self.start_by is not None and time.time() > self.start_by
            for n in list(pending):
                job = self.jobs[n]
                if closed and job.training:
                    continue
                if any(d not in self.results for d in job.deps):
                    continue
                if running and (job.exclusive or any(self.jobs[r].exclusive for r in running)):
                    break
                if len(running) >= self.max_jobs:
                    break
                pending.remove(n)
                th = threading.Thread(target=self._run_one, args=(job, errors), daemon=True)
                running[n] = th
                th.start()
                started = True
                if job.exclusive:
                    break
            if not started:
                if not running and pending and closed:
                    raise ClaimsPaused(f"{len(pending)} steps left when the start window closed ("
                                       f"{', '.join(pending[:3])}{', ...' if len(pending) > 3 else ''}); run the "
                                       f"same command again to go on")
                if not running and pending:
                    stuck = ", ".join(pending[:3])
                    raise ClaimsError(f"steps {stuck} wait for steps that did not run")
                time.sleep(POLL)
        return time.time() - t_start

    def _closure(self, names):
        out, stack = set(), list(names)
        while stack:
            n = stack.pop()
            if n in out:
                continue
            if n not in self.jobs:
                raise ClaimsError(f"no step named {n}")
            out.add(n)
            stack.extend(self.jobs[n].deps)
        return out

    def _run_one(self, job: Job, errors: List[str]):
        t0 = time.time()
        self.say(f"start  {job.name}: {job.what or job.name}")
        try:
            res = job.run(job, self) or {}
        except ClaimsError as e:
            errors.append(f"{job.name}: {e}")
            self.say(f"FAILED {job.name}: {e}")
            return
        except Exception as e:  # noqa: BLE001  (reported with its traceback in the job's log)
            with open(self.log(job.name, "error"), "w") as f:
                traceback.print_exc(file=f)
            errors.append(f"{job.name}: {type(e).__name__}: {e} (traceback in {self.log(job.name, 'error')})")
            self.say(f"FAILED {job.name}: {type(e).__name__}: {e}")
            return
        res = {"ok": True, "settings_hash": self.job_hash(job.name), "minutes": (time.time() - t0) / 60,
               "threads": job.threads, "code_commit": code_commit(), "workdir": self.W, **res}
        old = self.remaking.pop(job.name, None)
        if old is not None:  # later steps used the recorded result: it stands, with what this run made beside it
            files = {k: v for k, v in res.items() if isinstance(v, str) and v.startswith(self.W + os.sep)}
            res = {**{k: v for k, v in old.items() if k != "kept"}, **files,
                   "remade": {k: v for k, v in res.items() if k not in ("ok", "settings_hash")}}
        write_json(self.result_path(job.name), res)
        if self.store:
            write_json(self.stored_path(job.name), res)
        with self.lock:
            self.results[job.name] = res
        summary = (res.get("remade") or res).get("summary")
        self.say(f"done   {job.name} in {(time.time() - t0) / 60:.1f} min" + (f": {summary}" if summary else "")
                 + (" (made again: its recorded result stands)" if old is not None else ""))
        if job.keep:
            try:
                self.keep(job.name)
            except ClaimsError as e:  # the result stands; a later session trains it again to read its files
                self.say(f"warning: {job.name}'s files were not kept in the store: {e}")

    # -- child processes --------------------------------------------------------------------------------
    def env(self, threads: int) -> dict:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                    "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "PYTHONUNBUFFERED": "1"})
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def sh(self, cmd: List[str], log: str, threads: int = 1, what: str = "") -> float:
        """Runs ``cmd`` (its output appended to ``log``); raises ClaimsError naming the log when it fails.
        Returns the child's CPU seconds."""
        cmd = [str(c) for c in cmd]
        with open(log, "a", encoding="utf-8") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            before = os.times()
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env(threads))
            after = os.times()
        if rc != 0:
            raise ClaimsError(f"{what or cmd[2]} failed (exit {rc}); see {log}")
        return (after.children_user - before.children_user) + (after.children_system - before.children_system)

    def fairseq(self, tool: str, argv: List[str], log: str, threads: int = 1) -> float:
        """A fairseq command line (``train``, ``generate``, ``preprocess``) in a child process."""
        return self.sh([sys.executable, "-m", f"fairseq_cli.{tool}", *argv], log, threads, f"fairseq-{tool}")

    def worker(self, fn: str, kwargs: dict, log: str, threads: int = 1) -> dict:
        """A Python step of benchmarks/claims/work.py (``fn``) in a child process; returns its result."""
        spec = os.path.join(self.dir("tmp"), f"worker-{os.getpid()}-{threading.get_ident()}.json")
        write_json(spec, {"fn": fn, "kwargs": kwargs})
        out = spec + ".out"
        if os.path.exists(out):
            os.remove(out)
        self.sh([sys.executable, "-m", "benchmarks.claims.work", spec, out], log, threads, fn)
        res, damaged = read_object(out)
        if res is None:
            raise ClaimsError(f"{fn} wrote no result object ({damaged or 'no file'}: {out}); see {log}")
        return res
