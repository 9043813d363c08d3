"""Adapters: one module per outside system. The core imports none of them; only the composition
root (``kvindex.daemon``) picks a dialect by name from ``adapters.dialects.DIALECTS``.
"""
