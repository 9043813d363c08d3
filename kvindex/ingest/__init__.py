"""Ingest: engine frames in, ordered per engine, judged by seq, applied to the precise store.

``transport`` (ZeroMQ SUB, replay DEALER) -> the adapter's decoder -> ``sequencer`` (pure seq/gap/restart
rules) -> ``writer`` (store calls); ``lane`` runs one engine's loop, ``life`` asks which life of the
engine a batch is of (duplicate or restart, a restart while kvindex was down), ``fleet`` holds the lanes.
"""
