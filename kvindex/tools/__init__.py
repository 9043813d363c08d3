"""Tooling beside the daemon (demo, engine simulator, workload, capture format, recorder, fake
engine): imported only by their CLI subcommands, tests and benchmarks, never by core modules.
"""
