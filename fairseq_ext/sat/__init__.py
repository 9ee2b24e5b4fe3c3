"""SAT: "Semi-Autoregressive Neural Machine Translation" (Wang, Zhang and Chen, EMNLP 2018), as
``--arch sat_transformer*`` with ``--task translation_sat``.

K words per decoder call: the group-level chain rule, long-distance prediction from K start symbols and the
relaxed causal mask (Sec. 3), initialisation from a trained Transformer and sequence-level distillation (Sec. 4).

    model.py        the SAT decoder (relaxed causal mask, SAT decoder input), ``sat_transformer``,
                    ``--sat-group-size K`` (read by :func:`~fairseq_ext.sat.model.group_size`),
                    ``--sat-init-from``
    generator.py    the semi-autoregressive generator (greedy and group beam search)
    group_step.py   the beam's group step: the exact top B K-word continuations (enumerated or pruned)
    task.py         ``--task translation_sat``: fairseq's translation task with that generator, and
                    :func:`~fairseq_ext.sat.task.build_sat_generator` (plain, group beam or speculative)
    speculative.py  ``--sat-draft-path SAT.pt``: lossless speculative greedy decoding of an autoregressive verifier
                    with a SAT drafter
    distill.py      ``python -m fairseq_ext.sat.distill``: a distilled training set from fairseq-generate output
    position_ce.py  ``python -m fairseq_ext.sat.position_ce``: cross-entropy by target position (Figure 6)

The decoder step and the opt-in speed-ups are shared with fairseq's transformer: :mod:`fairseq_ext.inference`.
Guides: docs/sat_transformer.md, docs/sat_speculative.md (``--sat-draft-path``); benchmarks: python -m
benchmarks.speed.sat and benchmarks/README.md.
"""

from fairseq_ext.sat import model, task  # noqa: F401  (registers sat_transformer and translation_sat)
