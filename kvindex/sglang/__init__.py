"""SGLang's external KV indexer API (``kv_indexer.v1.KVIndexer``, ``kvindex serve --grpc-port``).

Data flows one way: ``kvindex.route.grpc`` (HTTP/2 frames, gRPC calls) -> ``service`` (the four
unary methods, auth, metrics) -> ``wire`` (their protobuf messages <-> typed values) ->
``placements`` (SGLang's placement rules on kvindex's precise index: applies as index events, the
queries through each worker's own engine hashes). ``kv_indexer.proto`` states the schema.
"""
