"""Average the parameters of several fairseq checkpoints (what fairseq's ``scripts/average_checkpoints.py``
does; that script is not installed by pip).

    python -m fairseq_ext.average_checkpoints --inputs CKPT_DIR --num-epoch-checkpoints 5 --output avg.pt
    python -m fairseq_ext.average_checkpoints --inputs CKPT_DIR --num-update-checkpoints 5 --output avg.pt
    python -m fairseq_ext.average_checkpoints --inputs a.pt b.pt c.pt --output avg.pt

Floating-point parameters are summed in float64 and divided once, so the result is the element-wise mean
rounded once to the parameters' dtype; integer buffers get the floor of the mean, as in fairseq. Everything
else in the output (config, task state, optimizer history) comes from the first input: the newest with
``--num-epoch-checkpoints`` / ``--num-update-checkpoints``, the first one named otherwise. Inputs are read
with the safe loader of :mod:`fairseq_ext.checkpoints` (a checkpoint it refuses stops the averaging with one
line naming the file and, for a config that fairseq would ``eval()``, the field), and the output is written
atomically.
"""

import argparse
import collections
import os
import re
import sys

import torch

from fairseq_ext.checkpoints.loading import load_checkpoint_file
from fairseq_ext.checkpoints.saving import atomic_torch_save
from fairseq_ext.common.errors import FairseqExtError, command


def average_checkpoints(inputs):
    """Return the state of ``inputs[0]`` with ``model`` replaced by the mean over all inputs."""
    if not inputs:
        raise FairseqExtError("average_checkpoints: no input checkpoints")
    sums, keys, new_state = collections.OrderedDict(), None, None
    for path in inputs:
        state = load_checkpoint_file(path)
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise FairseqExtError(f"average_checkpoints: {path} has no 'model' dict of weights; is it a fairseq "
                                  "checkpoint? leave it out of --inputs")
        params = state["model"]
        if new_state is None:
            new_state, keys = state, list(params.keys())
        elif list(params.keys()) != keys:
            raise FairseqExtError(
                f"average_checkpoints: {path} holds parameters {sorted(set(params) ^ set(keys))[:5]} that "
                f"{inputs[0]} does not (or misses some): average checkpoints of one model only"
            )
        for k in keys:
            p = params[k]
            if not torch.is_tensor(p):
                raise FairseqExtError(
                    f"average_checkpoints: {path} holds {type(p).__name__} under model[{str(k)[:80]!r}] where a "
                    "fairseq checkpoint holds a tensor; the file is damaged or not a fairseq checkpoint: leave it "
                    "out of --inputs")
            if sums.get(k) is None:
                sums[k] = p.detach().to(torch.float64).clone() if p.is_floating_point() else p.detach().clone()
            else:
                if p.shape != sums[k].shape:
                    raise FairseqExtError(
                        f"average_checkpoints: parameter {k} has shape {tuple(p.shape)} in {path} but "
                        f"{tuple(sums[k].shape)} in {inputs[0]}"
                    )
                sums[k] += p.detach().to(sums[k].dtype)
    n = len(inputs)
    averaged = collections.OrderedDict()
    for k in keys:
        ref = new_state["model"][k]
        averaged[k] = (sums[k] / n).to(ref.dtype) if ref.is_floating_point() else sums[k] // n
    new_state["model"] = averaged
    return new_state


def last_n_checkpoints(directory, n, update_based, upper_bound=None):
    """Paths of the newest ``n`` epoch (``checkpointE.pt``) or update (``checkpoint_E_U.pt``) checkpoints."""
    if not os.path.isdir(directory):
        raise FairseqExtError(
            f"average_checkpoints: --inputs '{directory}' must be one directory when --num-*-checkpoints is given"
        )
    pattern = re.compile(r"checkpoint_\d+_(\d+)\.pt" if update_based else r"checkpoint(\d+)\.pt")
    entries = []
    for name in os.listdir(directory):
        m = pattern.fullmatch(name)
        if m is not None and (upper_bound is None or int(m.group(1)) <= upper_bound):
            entries.append((int(m.group(1)), name))
    if len(entries) < n:
        kind = "update" if update_based else "epoch"
        raise FairseqExtError(
            f"average_checkpoints: found {len(entries)} {kind} checkpoints in {directory} but "
            f"--num-{kind}-checkpoints asks for {n}"
            + (" (save them with --save-interval-updates)" if update_based else "")
        )
    return [os.path.join(directory, name) for _, name in sorted(entries, reverse=True)[:n]]


@command
def main(argv=None):
    p = argparse.ArgumentParser(description="Average the parameters of fairseq checkpoints.")
    p.add_argument("--inputs", required=True, nargs="+", help="checkpoint files, or one directory with "
                   "--num-epoch-checkpoints / --num-update-checkpoints")
    p.add_argument("--output", required=True, help="where to write the averaged checkpoint")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=int, help="average the last N checkpointE.pt files")
    group.add_argument("--num-update-checkpoints", type=int, help="average the last N checkpoint_E_U.pt files")
    p.add_argument("--checkpoint-upper-bound", type=int,
                   help="ignore checkpoints after this epoch (or update, with --num-update-checkpoints)")
    args = p.parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):  # checked before the inputs are read (minutes for large checkpoints)
        raise FairseqExtError(f"average_checkpoints: --output {args.output}: directory {out_dir} does not exist; "
                              "create it first (mkdir -p) or write elsewhere")
    if os.path.isdir(args.output):
        raise FairseqExtError(f"average_checkpoints: --output {args.output} is a directory; give a file name "
                              "(e.g. checkpoint_avg.pt)")
    inputs = args.inputs
    n = args.num_epoch_checkpoints or args.num_update_checkpoints
    if n is not None:
        if n < 1:
            raise FairseqExtError("average_checkpoints: the number of checkpoints must be >= 1")
        if len(inputs) != 1:
            raise FairseqExtError("average_checkpoints: give one directory with --num-*-checkpoints")
        inputs = last_n_checkpoints(inputs[0], n, args.num_update_checkpoints is not None,
                                    args.checkpoint_upper_bound)
    print("averaging checkpoints:", *inputs, sep="\n  ")
    state = average_checkpoints(inputs)
    try:
        atomic_torch_save(state, args.output)
    except (OSError, RuntimeError) as exc:  # e.g. no permission, disk full (torch reports some as RuntimeError)
        raise FairseqExtError(f"average_checkpoints: cannot write --output {args.output} ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else ''}); nothing was written there")
    print(f"wrote the average of {len(inputs)} checkpoints to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
