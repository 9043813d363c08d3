"""Where the indexes live: the contracts (``base``) and their backends (``memory``, ``redis``)."""
