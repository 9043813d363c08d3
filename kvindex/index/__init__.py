"""The indexes: contracts (``protocol``), the readable reference, the fast in-memory index and its
backends (memory, Redis), the guard that turns store failures into 503s, and the factory.
"""
