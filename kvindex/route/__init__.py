"""The request path: kvindex inside an Envoy gateway, as its endpoint picker (``pick``) or as a
zero-change observer of the gateway's own routing (``observe``).

Data flows one way: ``h2`` (HTTP/2 frames) -> ``grpc`` (calls and messages) -> ``extproc``
(Envoy's ext_proc messages <-> typed events) -> ``exchange`` (one HTTP request's protocol) ->
``path`` (read, predict, score with ``scorers``, route; record the decision when the answer has
passed) over ``endpoints`` (the engines one can route to), ``load`` (their /metrics) and
``inflight`` (predictions waiting for answers). Once answered, every decision is shadowed by
every routing policy (``policies``, ``shadows``: the what-if). ``server`` serves the port; ``envoy`` writes the
Envoy configuration and ``gateway`` runs Envoy beside kvindex; ``build`` assembles the parts.
"""
