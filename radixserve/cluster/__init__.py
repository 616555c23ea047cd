"""Scale-out: many engine replicas on Ray Serve behind one OpenAI API, routed by their caches.

`index` and `routing` are plain Python (no Ray): the routing rule and the exact per-replica
cache index that both the Ray Serve request router and `bench simulate --replicas` use;
`feed` (a replica's event fan-out), `view` (the ingress's shared state), `stats` and
`protocol` need no Ray either. `replica`, `router`, `engine`, `deploy` and `cli` need the
optional extra (`pip install -e '.[cluster]'`, which brings Ray Serve).
"""
