"""``--workers N``: worker processes that own some engines' lanes, the typed channel to them, and
the parent's view of their precise index.
"""
