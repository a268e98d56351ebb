"""hivemind's DHT peer, in a process that dies with the one that started it (``lifetime.py``).

``hivemind.DHT`` runs its node in a child process, which starts p2pd below it. Here the child
asks to be killed when its parent dies, and has its p2pd do the same, so that a worker or a
bootstrap peer killed with SIGKILL leaves no process behind on its port. A Ctrl-C or a SIGTERM
to the whole process group reaches the owner alone (``lifetime.shielded_from_interrupts``): it
shuts the peer down in order, after the worker's leaving record has gone out through it.
"""

from __future__ import annotations

import os
import signal

import hivemind

from diloco.comm.hivemind.forked import release_inherited_tensors
from diloco.lifetime import asyncio_children_die_with_this_process, die_with_parent, shielded_from_interrupts


class OwnedDHT(hivemind.DHT):
    def __init__(self, *args, **kwargs):
        self._owner_pid = os.getpid()  # before hivemind starts the process (in its __init__)
        super().__init__(*args, **kwargs)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        with shielded_from_interrupts():
            self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def run(self) -> None:
        die_with_parent(signal.SIGKILL, parent_pid=self._owner_pid)
        release_inherited_tensors()  # the worker's model, forked with us: never read here
        asyncio_children_die_with_this_process(signal.SIGTERM)  # p2pd
        super().run()
