"""The algorithm: inner steps, pseudo-gradients and the outer step, and when a round ends.

- ``inner.py``        the inner step (bf16 autocast) and its optimizer (AdamW, fused on CUDA), the lr schedule
- ``outer.py``        pseudo-gradients and the outer optimizer: **the outer step happens here**
- ``overlap.py``      outer steps overlapped with compute (delayed, streaming fragments)
- ``recovery.py``     **what happens after a failed round**: after a round that failed, was partial or ran in a
                      smaller group, at an overlapped run's end, and for a worker that starts behind the run, it
                      takes a better peer's state
- ``rounds.py``       when a round ends: every H steps, or a time budget (dynamic local steps)
- ``host_copies.py``  the outer step's copies between the model's device and (pinned) host memory
- ``digest.py``       the params' digest every worker records after a round (identical params: identical digests)
- ``evaluation.py``   the held-out loss
"""
