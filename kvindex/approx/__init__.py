"""Request -> prompt string -> block hashes, as an approximate router computes them (Kthena, GIE v1.5).
"""
