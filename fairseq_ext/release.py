"""Release checkpoints: a trained model made small and checkable, and the check before it is used.

    python -m fairseq_ext.release pack --checkpoint CKPT --name ARCH --release-dir releases/bible-de-en \\
        --dict BIN/dict.de.txt --spm-model DATA/spm.model [--meta FILE.json]
    python -m fairseq_ext.release verify --release-dir releases/bible-de-en --name ARCH

A release directory holds the sentencepiece model (``spm.model``) and the joined fairseq dictionary
(``dict.txt``) its models were trained with, one ``ARCH.pt`` per architecture and ``MANIFEST.json``: the sha256
and size of every file, and per model what ``--meta`` gave (how it was trained: the command, updates, wall and CPU
time, valid BLEU; tools/train_release.py writes it).

``pack`` reads the checkpoint through the safe loader (:func:`fairseq_ext.checkpoint_io.load_checkpoint_file`)
and keeps what a user needs to translate with it or train on from it: the weights in fp16, the config (with the
paths of the machine that trained it cleared), the update count; no optimizer state, no meters. It writes through
a temporary file and an atomic rename. ``verify`` checks the model, ``spm.model`` and ``dict.txt`` against the
manifest and prints the model's path; a file that does not match is refused with one line. Loading a release
(``fairseq-generate --path``, ``fairseq-train --finetune-from-model``) goes through the safe loader like any
checkpoint once ``fairseq_ext`` is imported (``--user-dir``); the weights are cast back to the model's dtype
(fp32 on CPU) when loaded.
"""

import argparse
import copy
import fcntl
import hashlib
import json
import os
import shutil
import sys

from fairseq_ext.errors import FairseqExtError

MANIFEST = "MANIFEST.json"
SHARED_FILES = ("spm.model", "dict.txt")
# config fields that name paths of the machine that trained the model, and what a release holds instead
_PATH_FIELDS = {("common", "user_dir"): None, ("common", "tensorboard_logdir"): None,
                ("checkpoint", "save_dir"): "checkpoints", ("checkpoint", "finetune_from_model"): None,
                ("checkpoint", "restore_file"): "checkpoint_last.pt", ("task", "data"): ""}


class ReleaseError(FairseqExtError):
    pass


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(release_dir):
    path = os.path.join(release_dir, MANIFEST)
    if not os.path.isfile(path):
        return {"files": {}, "models": {}}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _clear_paths(cfg):
    for (section, field), value in _PATH_FIELDS.items():
        sub = cfg.get(section) if hasattr(cfg, "get") else None
        if sub is not None and field in sub:
            sub[field] = value


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
        "args": state.get("args"),
        "optimizer_history": kept_history,
        # the data position only: fairseq adds "previous_training_time" to the time --stop-time-hours counts, even
        # for --finetune-from-model, so a release that kept it would stop a continuation before its first update
        "extra_state": {k: extra[k] for k in ("train_iterator",) if k in extra},
        "release": {"num_updates": num_updates, "dtype": "float16"},
    }
    if out["cfg"] is not None:
        out["cfg"] = copy.deepcopy(out["cfg"])
        _clear_paths(out["cfg"])
    return out


def pack(checkpoint, name, release_dir, dict_path, spm_model, meta=None):
    """Write ``release_dir``/``name``.pt from ``checkpoint`` and record it in the manifest; the release's
    ``spm.model`` and ``dict.txt`` are copied there the first time and must be identical afterwards."""
    os.makedirs(release_dir, exist_ok=True)
    with open(os.path.join(release_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two packs at once (e.g. two archs trained side by side) lose no entry
        return _pack_locked(checkpoint, name, release_dir, dict_path, spm_model, meta)


def _pack_locked(checkpoint, name, release_dir, dict_path, spm_model, meta):
    from fairseq_ext.checkpoint_io import atomic_torch_save, load_checkpoint_file

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
    entry = dict(meta or {})
    entry.update({"file": f"{name}.pt", "sha256": sha256(out), "bytes": os.path.getsize(out),
                  "parameters": n_params, "num_updates": state["release"]["num_updates"], "dtype": "float16",
                  "optimizer_state": False})
    manifest["models"][name] = entry
    _write_json(os.path.join(release_dir, MANIFEST), manifest)
    return out, entry


def verify(release_dir, name, if_present=False):
    """The path of ``release_dir``/``name``.pt after checking it, ``spm.model`` and ``dict.txt`` against the
    manifest; ReleaseError (one line) when anything is missing or differs. ``if_present``: None instead of an error
    when the manifest has no model ``name``."""
    manifest = read_manifest(release_dir)
    entry = manifest["models"].get(name)
    if entry is None and if_present:
        return None
    if entry is None:
        have = ", ".join(sorted(manifest["models"])) or "none"
        raise ReleaseError(f"{release_dir} has no release of '{name}' (it has: {have}); train one with "
                           f"tools/train_release.py --arch {name}, or use --from-scratch")
    checks = [(entry["file"], entry["sha256"])] + [(f, manifest["files"][f]["sha256"]) for f in SHARED_FILES]
    for file_name, want in checks:
        path = os.path.join(release_dir, file_name)
        if not os.path.isfile(path):
            raise ReleaseError(f"release file {path} is missing; restore it (git checkout -- {path}) or use "
                               "--from-scratch")
        if sha256(path) != want:
            raise ReleaseError(f"release file {path} does not match its sha256 in {os.path.join(release_dir, MANIFEST)}"
                               f" (changed or damaged); restore it (git checkout -- {path}) or use --from-scratch")
    return os.path.join(release_dir, entry["file"])


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
    args = p.parse_args(argv)
    try:
        if args.command == "pack":
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
        print(f"fairseq_ext.release: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
