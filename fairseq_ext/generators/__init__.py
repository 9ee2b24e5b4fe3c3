"""Sequence generators that fairseq's own SequenceGenerator cannot express (imported by the tasks that
build them)."""
