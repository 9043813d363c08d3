"""State that outlives the process: the write-ahead log, snapshots, recovery at start.
"""
