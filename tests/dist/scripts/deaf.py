"""A rank script for launcher tests that ignores SIGTERM, so only SIGKILL ends it."""

import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("deaf rank started", flush=True)
while True:
    time.sleep(0.1)
