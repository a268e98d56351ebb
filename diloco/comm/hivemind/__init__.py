"""The hivemind transport: peers on a DHT, averaging in groups found by matchmaking.

- ``backend.py``         ``HivemindBackend``: a worker's transport, composed of the parts below
- ``settings.py``        ``HivemindConfig``, its settings (``comm.hivemind``): imports nothing of hivemind
- ``peer.py``            its DHT peer: start-up, reachability and client mode, bounded DHT calls;
                         the short-lived peers ``diloco status`` and ``diloco join`` read the roster with
- ``averaging.py``       a round's averaging: one averager per fragment, the retry among survivors,
                         the outer step alone when nobody else is left
- ``group_round.py``     one attempt in a group: matchmaking, the all-reduce, screening, the result
                         (and whether the group held two models: a split run met again)
- ``others.py``          the other workers as the roster's records tell them (gone, done with a round,
                         ahead); a client's round postponed, or failed, when no group formed
- ``state_exchange.py``  the worker's state offered to peers and taken from them after a failed round
- ``state_offers.py``    the offers as the DHT carries them: (round, rank) packed in one priority
- ``membership.py``      the worker's roster record and its view of who is live
- ``averager.py``        hivemind's averager made bit-identical across peers: its process, its group,
                         a part for a group it is not in refused
- ``exact_allreduce.py`` the bit-exact all-reduce: a reducer hands out the average itself, not a delta
- ``exact_reducing.py``  its reducer's side: the senders of our share served their parts' average
- ``wire.py``            the parts on the wire: codec payloads in hivemind's messages, part sizes
- ``screening.py``       robust aggregation in the all-reduce: declared norms screened, parts checked
- ``traffic.py``         bytes on the wire and a round's counts, shared with the worker's process
- ``state_serving.py``   our state served to the peers that download it, whole or in parts
- ``state_download.py``  a peer's state downloaded, in parts from several peers at once
- ``log_filters.py``     hivemind's tracebacks of failures the worker reports itself left out
- ``overrides.py``       every hivemind method overridden or relied on, as hivemind 1.1.12 has it
- ``reducer.py``         the reducer of our share: ends without senders; leaves out those we exclude
- ``exclusion.py``       each peer's standing across rounds (``comm.exclude_after``), kept in the averager
- ``gathered.py``        a reducer's reply for a codec that gathers (top-k): the kept payloads, not their mean
- ``gloo_plane.py``      a bulk data plane beside it: fp32 rounds through a gloo all-reduce
- ``roster.py``          who is in the run now (heartbeats on the DHT) and the group size a round waits for
- ``roster_records.py``  a roster record's parts: membership, telemetry, round-protocol state, params declared
- ``redial.py``          the run's peers found again after the network between them healed (a split run)
- ``reachability.py``    whether a joining worker can be dialled (else it joins as a client)
- ``run_key.py``         the run key: HMAC-signed DHT records and a keyed schema hash
- ``owned_dht.py``       a DHT process that dies with the worker that started it

Nothing is imported here: ``diloco status`` reads the roster without loading the averager.
"""
