"""A stand-in worker for the start-up Ctrl-C test: says which SIGINT action it runs under, then naps (0.3 s)."""

import signal
import sys
import time

if __name__ == "__main__":
    # One write: the worker runs unbuffered, and print() writes its arguments one by one, so a SIGINT between them
    # left "up" without its number (seen once in CI's load).
    sys.stdout.write(f"up {int(signal.getsignal(signal.SIGINT))}\n")
    sys.stdout.flush()
    time.sleep(0.3)
