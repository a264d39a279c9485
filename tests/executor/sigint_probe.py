"""A stand-in worker for the start-up Ctrl-C test: says which SIGINT action it runs under, then naps (0.3 s)."""

import signal
import time

if __name__ == "__main__":
    print("up", int(signal.getsignal(signal.SIGINT)), flush=True)
    time.sleep(0.3)
