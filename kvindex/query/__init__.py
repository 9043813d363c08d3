"""Queries and decisions: a request in, both indexes' answers per pod out (``service``), what a
query answers (``answers``), routing decisions in and their log (``decisions``), and the drift
audit that re-checks them (``drift``), every decision beside what each routing policy would have
picked (``whatif``). Above the indexes and ingest; below the HTTP and gRPC
front doors (``kvindex.http``, ``kvindex.route``)."""
