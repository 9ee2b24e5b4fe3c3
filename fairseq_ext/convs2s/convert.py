"""Convert a trained fairseq ``fconv`` checkpoint into an ``fconv_glu`` one (same weights, same translations)::

    python -m fairseq_ext.convs2s.convert --convert-from-fconv IN.pt OUT.pt

Parameters are renamed by :func:`fairseq_ext.convs2s.model.upgrade_fconv_state_dict`, the architecture name is
mapped (``fconv_iwslt_de_en`` -> ``fconv_glu_iwslt_de_en``, ...), and the result is written atomically.

The optimizer state (``last_optimizer_state``, e.g. NAG's momentum) is dropped, not converted: fairseq's optimizer
state is positional, and ``fconv`` registers all decoder convolutions before all attention layers where
``fconv_glu`` interleaves them per layer, so it would give layers another layer's momentum (or fail on shapes).
``fairseq-train --restore-file OUT`` therefore continues from the converted weights with a fresh optimizer and
learning-rate schedule (fairseq restores both only together with the optimizer state); the epoch and the data
iterator position are kept.
"""

import argparse
import sys

import torch

from fairseq_ext.checkpoints import atomic_torch_save, load_checkpoint_file
from fairseq_ext.convs2s.model import upgrade_fconv_state_dict
from fairseq_ext.common.errors import FairseqExtError, command

_FCONV_TO_GLU = {
    "fconv": "fconv_glu",
    "fconv_iwslt_de_en": "fconv_glu_iwslt_de_en",
    "fconv_wmt_en_ro": "fconv_glu_wmt_en_ro",
    "fconv_wmt_en_de": "fconv_glu_wmt_en_de",
    "fconv_wmt_en_fr": "fconv_glu_wmt_en_fr",
}


def convert_fconv_checkpoint(src, dst):
    """Convert a fairseq ``fconv*`` checkpoint file into an ``fconv_glu*`` one (same weights)."""
    state = load_checkpoint_file(src)
    if "model" not in state:
        raise FairseqExtError(f"{src} is not a fairseq checkpoint (no 'model' entry)")

    def rename(ns):
        if ns is None:
            return
        get = ns.get if isinstance(ns, dict) else lambda k, d=None: getattr(ns, k, d)
        put = ns.__setitem__ if isinstance(ns, dict) else lambda k, v: setattr(ns, k, v)
        for k in ("arch", "_name"):
            arch = get(k)
            if isinstance(arch, str) and arch.startswith("fconv") and not arch.startswith("fconv_glu"):
                if arch not in _FCONV_TO_GLU:
                    raise FairseqExtError(f"{src}: architecture {arch} has no fconv_glu counterpart "
                                          f"({', '.join(sorted(_FCONV_TO_GLU))})")
                put(k, _FCONV_TO_GLU[arch])

    arch = None
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        m = cfg["model"]
        arch = m.get("arch") if isinstance(m, dict) else getattr(m, "arch", None)
        rename(m)
    if state.get("args") is not None:
        arch = arch or getattr(state["args"], "arch", None)
        rename(state["args"])
    if arch is None or not str(arch).startswith("fconv") or str(arch) not in _FCONV_TO_GLU:
        raise FairseqExtError(f"{src}: not a fairseq fconv checkpoint (architecture {arch!r}); "
                              f"expected one of {', '.join(sorted(_FCONV_TO_GLU))}")
    upgrade_fconv_state_dict(state["model"])
    state.pop("last_optimizer_state", None)  # positional, in fconv's parameter order (see the module docstring)
    atomic_torch_save(state, dst)
    return state


@command
def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_ext.convs2s.convert",
        description="Convert a trained fairseq fconv checkpoint into an fconv_glu checkpoint (same weights, "
                    "same translations; load it with --user-dir fairseq_ext).")
    parser.add_argument("--convert-from-fconv", nargs=2, metavar=("IN", "OUT"), required=True,
                        help="fairseq fconv*.pt checkpoint to read, fconv_glu checkpoint to write")
    args = parser.parse_args(argv)
    src, dst = args.convert_from_fconv
    state = convert_fconv_checkpoint(src, dst)
    n = sum(v.numel() for v in state["model"].values() if torch.is_tensor(v))
    print(f"wrote {dst} ({n} parameters; the optimizer state is not converted: fairseq-train --restore-file "
          f"{dst} continues with a fresh optimizer and learning-rate schedule)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
