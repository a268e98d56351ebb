"""The hivemind transport: peers on a DHT, averaging in groups found by matchmaking.

- ``backend.py``       ``HivemindBackend``: a worker's DHT peer, its averagers and its roster record;
                       how a round is matched, retried, and its state offered and downloaded
- ``averager.py``      hivemind's averager made bit-identical across peers, with byte counts
                       and the robust screening of declared norms
- ``gathered.py``      a reducer's reply for a codec that gathers (top-k): the kept payloads, not their mean
- ``gloo_plane.py``    a bulk data plane beside it: fp32 rounds through a gloo all-reduce
- ``roster.py``        who is in the run now (heartbeats on the DHT) and the group size a round waits for
- ``reachability.py``  whether a joining worker can be dialled (else it joins as a client)
- ``run_key.py``       the run key: HMAC-signed DHT records and a keyed schema hash
- ``owned_dht.py``     a DHT process that dies with the worker that started it

Nothing is imported here: ``diloco status`` reads the roster without loading the averager.
"""
