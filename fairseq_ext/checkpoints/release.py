"""Release checkpoints: a trained model made small and checkable, and the check before it is used.

    python -m fairseq_ext.release pack --checkpoint CKPT --name ARCH --release-dir releases/bible-de-en \\
        --dict BIN/dict.de.txt --spm-model DATA/spm.model [--meta FILE.json]
    python -m fairseq_ext.release verify --release-dir releases/bible-de-en --name ARCH
    python -m fairseq_ext.release scrub-paths --release-dir releases/bible-de-en

A release directory holds the sentencepiece model (``spm.model``) and the joined fairseq dictionary
(``dict.txt``) its models were trained with, one ``ARCH.pt`` per architecture and ``MANIFEST.json``: the sha256
and size of every file, and per model what ``--meta`` gave (how it was trained: the command, updates, wall and CPU
time, valid BLEU; tools/train_release.py writes it).

``pack`` reads the checkpoint through the safe loader (:func:`fairseq_ext.checkpoints.load_checkpoint_file`)
and keeps what a user needs to translate with it or train on from it: the weights in fp16, the config, the update
count; no optimizer state, no meters. A release is a public file, so it holds no path of the machine that trained
it: every path field of the config, in every section and in the model's flat args, gets a machine-free value
(:data:`PATH_DEFAULTS`: ``save_dir`` -> ``checkpoints``, ``data`` -> ``""``, ``user_dir``, ``bert_model_name`` ->
None, ...), and any other absolute path keeps only its file name (``sat_initialised_from`` -> ``transformer.pt``);
the manifest's commands name directories outside the repository as ``DIR``. It writes through a temporary file and
an atomic rename. ``verify`` checks the model, ``spm.model`` and ``dict.txt`` against the manifest, and that the
model's config and its manifest entry carry no absolute path (fairseq's own defaults, such as ``/tmp/plasma``,
excepted), and prints the model's path (each file is read once: the config checked is that of the bytes hashed;
a program that then opens the printed path reads the file again); a malformed manifest, a ``file`` entry that is
not a plain file name of the release directory, a file that does not match or a path is refused with one line.
``scrub-paths`` applies pack's path rule to the models already in a release (deterministic: the same input gives
the same bytes) and records their new sha256. Loading a release (``fairseq-generate --path``, ``fairseq-train
--finetune-from-model``) goes through the safe loader like any checkpoint once ``fairseq_ext`` is imported
(``--user-dir``); the weights are cast back to the model's dtype (fp32 on CPU) when loaded. BERT-JAM releases hold
no BERT path: give ``--bert-model-name``.
"""

import argparse
import copy
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import stat
import sys

from fairseq_ext.common.errors import FairseqExtError, report

MANIFEST = "MANIFEST.json"
SHARED_FILES = ("spm.model", "dict.txt")
# config fields (in any section, and in the model's flat args) that name paths of the machine that trained the
# model, and what a release holds instead
PATH_DEFAULTS = {"user_dir": None, "tensorboard_logdir": None, "save_dir": "checkpoints", "finetune_from_model": None,
                 "restore_file": "checkpoint_last.pt", "data": "", "log_file": None, "results_path": None,
                 "bert_model_name": None, "bert_feature_cache": None, "sat_init_from": None, "wandb_project": None,
                 "aim_repo": None}
_ABS_PATH = re.compile(r"(?<![\w.:/-])(?:/|~/)[^\s'\"]*")  # an absolute path inside a command line


class ReleaseError(FairseqExtError):
    pass


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(release_dir, missing_ok=True):
    """The release's manifest, checked for the structure ``pack`` writes (ReleaseError naming the file)."""
    path = os.path.join(release_dir, MANIFEST)
    if not os.path.isfile(path):
        if missing_ok:
            return {"files": {}, "models": {}}
        raise ReleaseError(f"{path} does not exist; restore the release (git checkout -- {release_dir}) or use "
                           "--from-scratch")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8, a 5000-digit number
        raise ReleaseError(f"{path} is not readable JSON ({type(exc).__name__}: {str(exc)[:80]}); restore it "
                           f"(git checkout -- {path}) or use --from-scratch") from None
    why = _manifest_problem(manifest)
    if why:
        raise ReleaseError(f"{path} is not a release manifest: {why}; restore it (git checkout -- {path}) or use "
                           "--from-scratch")
    return manifest


def _plain_file_name(name):
    return isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name and \
        "/" not in name and "\\" not in name and "\0" not in name


def _depth(obj, limit):
    """How deep ``obj`` nests (lists and dicts), counted up to ``limit + 1`` without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack and deepest <= limit:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


MAX_DEPTH = 16  # pack writes 4 levels


def _manifest_problem(manifest):
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    if _depth(manifest, MAX_DEPTH) > MAX_DEPTH:
        return f"it nests deeper than {MAX_DEPTH} levels"
    for key in ("files", "models"):
        if not isinstance(manifest.get(key), dict):
            return f"it has no '{key}' object"
    for name, entry in manifest["files"].items():
        if name not in SHARED_FILES or not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            return f"files[{name!r}] is not one of {', '.join(SHARED_FILES)} with a sha256"
    for name, entry in manifest["models"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            return f"models[{name!r}] has no sha256"
        if not _plain_file_name(entry.get("file")):
            return (f"models[{name!r}].file {str(entry.get('file'))[:80]!r} is not the name of a file in the release "
                    "directory")
    return None


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _fairseq_default_paths():
    """{field: default} of fairseq's config fields whose default is an absolute path (e.g. plasma_path)."""
    import dataclasses

    from fairseq.dataclass.configs import FairseqConfig

    out = {}
    for section in dataclasses.fields(FairseqConfig):
        if isinstance(section.type, type) and dataclasses.is_dataclass(section.type):
            for f in dataclasses.fields(section.type):
                if isinstance(f.default, str) and os.path.isabs(f.default):
                    out[f.name] = f.default
    return out


def _is_machine_path(field, value, allowed):
    return isinstance(value, str) and (os.path.isabs(value) or value.startswith("~")) and allowed.get(field) != value


def _config_entries(obj, where="", depth=0):
    """(owner, key, where, value) of every value under ``obj`` (dicts, DictConfigs, Namespaces, lists)."""
    import argparse as _argparse

    from omegaconf import DictConfig, ListConfig

    if depth > 32:
        return
    if isinstance(obj, _argparse.Namespace):
        items = list(vars(obj).items())
    elif isinstance(obj, (dict, DictConfig)):
        items = list(obj.items())
    elif isinstance(obj, (list, ListConfig)):
        items = list(enumerate(obj))
    else:
        return
    for key, value in items:
        sub = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        yield obj, key, sub, value
        yield from _config_entries(value, sub, depth + 1)


def machine_paths(state):
    """(where, value) of every absolute path in the ``args`` / ``cfg`` of a checkpoint ``state`` (fairseq's own
    defaults excepted)."""
    allowed = _fairseq_default_paths()
    return [(where, value) for section in ("args", "cfg")
            for _, key, where, value in _config_entries(state.get(section), section)
            if _is_machine_path(key, value, allowed)]


def _set(owner, key, value):
    if isinstance(owner, (dict, list)) or hasattr(owner, "__setitem__"):
        owner[key] = value
    else:
        setattr(owner, key, value)


def public_config(cfg):
    """Give every path field of ``cfg`` (changed in place) its machine-free value (module docstring)."""
    allowed = _fairseq_default_paths()
    for owner, key, _, value in list(_config_entries(cfg)):
        if key in PATH_DEFAULTS and isinstance(value, str):
            _set(owner, key, PATH_DEFAULTS[key])
        elif _is_machine_path(key, value, allowed):
            _set(owner, key, os.path.basename(value.rstrip("/")))
    return cfg


def public_text(text, root=None):
    """``text`` (a command line) with the repository's root dropped from paths under it and every other
    absolute path shown as ``DIR``."""
    root = os.path.abspath(root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

    def sub(m):
        path = m.group(0)
        return path[len(root) + 1:] if path.startswith(root + os.sep) else "DIR"

    return _ABS_PATH.sub(sub, text) if isinstance(text, str) else text


def _public_meta(entry):
    for key, value in list(entry.items()):
        if isinstance(value, str):
            entry[key] = public_text(value)
        elif isinstance(value, dict):
            _public_meta(value)
    return entry


def _meta_paths(entry, where="models"):
    for key, value in entry.items():
        if isinstance(value, str) and _ABS_PATH.search(value):
            yield f"{where}.{key}", _ABS_PATH.search(value).group(0)
        elif isinstance(value, dict):
            yield from _meta_paths(value, f"{where}.{key}")


def release_state(state):
    """The release form of a fairseq checkpoint ``state`` (a new dict; ``state`` is not changed)."""
    import torch

    model, seen = {}, []  # tied weights (equal tensors, e.g. shared embeddings) are stored once
    for k, v in state["model"].items():
        if torch.is_tensor(v) and v.is_floating_point():
            v = v.detach()
            twin = next((h for f, h in seen if f.shape == v.shape and torch.equal(f, v)), None)
            if twin is None:
                twin = v.to(torch.float16)
                seen.append((v, twin))
            v = twin
        model[k] = v
    history = state.get("optimizer_history") or []
    last = dict(history[-1]) if history else {}
    num_updates = last.get("num_updates", 0)
    kept_history = [{k: last[k] for k in ("criterion_name", "optimizer_name", "lr_scheduler_state", "num_updates")
                     if k in last}]
    extra = state.get("extra_state") or {}
    out = {
        "model": model,
        "cfg": state.get("cfg"),
        "args": copy.deepcopy(state.get("args")),
        "optimizer_history": kept_history,
        # the data position only: fairseq adds "previous_training_time" to the time --stop-time-hours counts, even
        # for --finetune-from-model, so a release that kept it would stop a continuation before its first update
        "extra_state": {k: extra[k] for k in ("train_iterator",) if k in extra},
        "release": {"num_updates": num_updates, "dtype": "float16"},
    }
    if out["cfg"] is not None:
        out["cfg"] = copy.deepcopy(out["cfg"])
    public_config(out["cfg"])
    public_config(out["args"])
    return out


def pack(checkpoint, name, release_dir, dict_path, spm_model, meta=None):
    """Write ``release_dir``/``name``.pt from ``checkpoint`` and record it in the manifest; the release's
    ``spm.model`` and ``dict.txt`` are copied there the first time and must be identical afterwards."""
    os.makedirs(release_dir, exist_ok=True)
    with open(os.path.join(release_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two packs at once (e.g. two archs trained side by side) lose no entry
        return _pack_locked(checkpoint, name, release_dir, dict_path, spm_model, meta)


def _pack_locked(checkpoint, name, release_dir, dict_path, spm_model, meta):
    from fairseq_ext.checkpoints import atomic_torch_save, load_checkpoint_file

    manifest = read_manifest(release_dir)
    for src, dst_name in ((spm_model, "spm.model"), (dict_path, "dict.txt")):
        dst = os.path.join(release_dir, dst_name)
        digest = sha256(src)
        if not os.path.exists(dst):
            shutil.copyfile(src, dst)
        elif sha256(dst) != digest:
            raise ReleaseError(f"{src} differs from the release's {dst}: the models of one release share their "
                               "sentencepiece model and dictionary (train with --spm-model of the release, or use "
                               "another --release-dir)")
        manifest["files"][dst_name] = {"sha256": digest, "bytes": os.path.getsize(dst)}
    state = release_state(load_checkpoint_file(checkpoint))
    out = os.path.join(release_dir, f"{name}.pt")
    atomic_torch_save(state, out)
    unique = {v.data_ptr(): v for v in state["model"].values() if v.is_floating_point()}
    n_params = sum(v.numel() for v in unique.values())
    entry = _public_meta(dict(meta or {}))
    entry.update({"file": f"{name}.pt", "sha256": sha256(out), "bytes": os.path.getsize(out),
                  "parameters": n_params, "num_updates": state["release"]["num_updates"], "dtype": "float16",
                  "optimizer_state": False})
    manifest["models"][name] = entry
    _write_json(os.path.join(release_dir, MANIFEST), manifest)
    return out, entry


def verify(release_dir, name, if_present=False):
    """The path of ``release_dir``/``name``.pt after checking it, ``spm.model`` and ``dict.txt`` against the
    manifest and the model's config and manifest entry for paths of the machine that built it; ReleaseError (one
    line) when anything is missing, differs or carries such a path. Each file is read once, through one descriptor;
    the model's config is checked on the bytes that were hashed. What the caller then opens by the returned path
    is read again. ``if_present``: None instead of an error when the manifest has no model ``name``."""
    manifest = read_manifest(release_dir, missing_ok=if_present)
    entry = manifest["models"].get(name)
    if entry is None and if_present:
        return None
    if entry is None:
        have = ", ".join(sorted(manifest["models"])) or "none"
        raise ReleaseError(f"{release_dir} has no release of '{name}' (it has: {have}); train one with "
                           f"tools/train_release.py --arch {name}, or use --from-scratch")
    missing = [f for f in SHARED_FILES if f not in manifest["files"]]
    if missing:
        raise ReleaseError(f"{os.path.join(release_dir, MANIFEST)} records no {missing[0]}; restore the manifest "
                           f"(git checkout -- {release_dir}) or use --from-scratch")
    checks = [(entry["file"], entry["sha256"])] + [(f, manifest["files"][f]["sha256"]) for f in SHARED_FILES]
    verified = {}
    for file_name, want in checks:
        path = os.path.join(release_dir, file_name)
        data = _read_regular_file(path)
        if data is None:
            raise ReleaseError(f"release file {path} is missing (or a link); restore it (git checkout -- {path}) or "
                               "use --from-scratch")
        if hashlib.sha256(data).hexdigest() != want:
            raise ReleaseError(f"release file {path} does not match its sha256 in {os.path.join(release_dir, MANIFEST)}"
                               f" (changed or damaged); restore it (git checkout -- {path}) or use --from-scratch")
        verified[file_name] = data
    path = os.path.join(release_dir, entry["file"])
    found = next(iter(_meta_paths(entry, f"models.{name}")), None)
    if found is None:
        found = next(iter(machine_paths(_load_bytes(verified[entry["file"]], path))), None)
    if found is not None:
        raise ReleaseError(f"release {path} carries a path of the machine that built it ({found[0]} = "
                           f"{str(found[1])[:80]!r}); a release must not: rewrite it with python -m "
                           f"fairseq_ext.release scrub-paths --release-dir {release_dir}")
    return path


def _read_regular_file(path):
    """The bytes of ``path`` read through one descriptor, or None if it is missing, a link or not a regular file:
    what is hashed is what is loaded, whatever happens to the path meanwhile."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO does not block
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read()


def _load_bytes(data, path):
    """The checkpoint held in ``data`` (read from ``path``), through the safe loader, with its one-line errors."""
    from fairseq_ext.checkpoints.loading import load_checkpoint_fileobj

    return load_checkpoint_fileobj(io.BytesIO(data), path)


def scrub_paths(release_dir, names=None):
    """Apply pack's path rule (module docstring) to the models ``names`` (default: all) of a release and to their
    manifest entries, recording the new sha256 and size; returns {name: (old sha256, new sha256)}. The same input
    gives the same bytes, so a second run changes nothing."""
    from fairseq_ext.checkpoints import atomic_torch_save, load_checkpoint_file

    with open(os.path.join(release_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = read_manifest(release_dir, missing_ok=False)
        done = {}
        for name in names or sorted(manifest["models"]):
            if name not in manifest["models"]:
                raise ReleaseError(f"{release_dir} has no release of '{name}'")
            entry = manifest["models"][name]
            path = os.path.join(release_dir, entry["file"])
            if sha256(path) != entry["sha256"]:
                raise ReleaseError(f"release file {path} does not match its sha256 in the manifest; restore it "
                                   f"(git checkout -- {path}) before rewriting it")
            old = entry["sha256"]
            state = load_checkpoint_file(path)
            public_config(state.get("cfg"))
            public_config(state.get("args"))
            atomic_torch_save(state, path)
            _public_meta(entry)
            entry.update({"sha256": sha256(path), "bytes": os.path.getsize(path)})
            done[name] = (old, entry["sha256"])
        _write_json(os.path.join(release_dir, MANIFEST), manifest)
    return done


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fairseq_ext.release", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="make a release checkpoint and record it in the manifest")
    pk.add_argument("--checkpoint", required=True)
    pk.add_argument("--name", required=True, help="the model's name in the release (the quickstart's --arch)")
    pk.add_argument("--release-dir", required=True)
    pk.add_argument("--dict", required=True, help="the joined fairseq dictionary the model was trained with")
    pk.add_argument("--spm-model", required=True, help="the sentencepiece model the data was encoded with")
    pk.add_argument("--meta", help="a JSON file of facts to record with the model (how it was trained)")
    vf = sub.add_parser("verify", help="check a release model and its shared files against the manifest")
    vf.add_argument("--release-dir", required=True)
    vf.add_argument("--name", required=True)
    vf.add_argument("--if-present", action="store_true",
                    help="print nothing and succeed when the release has no model NAME (the quickstart's check)")
    sc = sub.add_parser("scrub-paths", help="rewrite a release's models without the paths of the machine that "
                        "built them (pack's rule) and record their new sha256")
    sc.add_argument("--release-dir", required=True)
    sc.add_argument("--name", action="append", help="only this model (repeatable; default: all)")
    args = p.parse_args(argv)
    try:
        if args.command == "scrub-paths":
            for name, (old, new) in scrub_paths(args.release_dir, args.name).items():
                print(f"{name}: sha256 {old} -> {new}" if old != new else f"{name}: unchanged, sha256 {new}")
        elif args.command == "pack":
            meta = None
            if args.meta:
                with open(args.meta, encoding="utf-8") as f:
                    meta = json.load(f)
            out, entry = pack(args.checkpoint, args.name, args.release_dir, args.dict, args.spm_model, meta)
            print(f"{out}: {entry['parameters']:,} parameters, {entry['num_updates']} updates, "
                  f"{entry['bytes'] / 2**20:.1f} MiB, sha256 {entry['sha256']}")
        else:
            path = verify(args.release_dir, args.name, args.if_present)
            if path is not None:
                print(path)
    except FairseqExtError as exc:
        report(exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
