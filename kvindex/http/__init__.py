"""The HTTP layer: ``bodies`` checks every body, ``native`` and ``dynamo`` answer, ``app`` wires them.
"""
