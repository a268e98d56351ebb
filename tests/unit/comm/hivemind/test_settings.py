"""comm.hivemind's settings live beside the transport, yet reading the config loads no hivemind."""

from __future__ import annotations

import subprocess
import sys

from diloco.comm.config import CommConfig
from diloco.comm.hivemind.settings import HivemindConfig


def test_the_comm_section_nests_hiveminds_settings():
    assert isinstance(CommConfig().hivemind, HivemindConfig)


def test_reading_the_comm_settings_loads_no_hivemind():
    code = "import sys, diloco.comm.config; print(sorted(m for m in sys.modules if m.split('.')[0] == 'hivemind'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
