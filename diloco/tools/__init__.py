"""Tools around the workers.

- ``launcher.py``  ``diloco local``: a bootstrap peer and M workers on one machine, with a live view
- ``testbed.py``   network namespaces on shaped links, NAT routers among them (root)
- ``status.py``    ``diloco status``: a live run's workers, read from the roster on the DHT
- ``plot.py``      ``diloco plot``: loss against tokens, wall time and bytes for runs
"""
