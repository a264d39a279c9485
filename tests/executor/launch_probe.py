"""A stand-in worker for the launcher's tests (``test_launch.py``): ``report DIR`` writes what the worker found when it
started (its rank's variables, its parent, its session, SIGINT's action, whether the launcher's preloaded module was
already imported) to ``DIR/rank{RANK}.json``; ``fail RANK STATUS`` makes that rank exit with STATUS after 0.2 s while
the others wait to be stopped; ``sleep`` waits to be stopped."""

import json
import os
import signal
import sys
import time
from pathlib import Path

#: The module the tests ask the launcher to preload: nothing else imports it.
PRELOADED = "wave"

if __name__ == "__main__":
    found = {"preloaded": PRELOADED in sys.modules, "rank": os.environ["RANK"],
             "local_rank": os.environ["LOCAL_RANK"], "world_size": os.environ["WORLD_SIZE"],
             "local_world_size": os.environ["LOCAL_WORLD_SIZE"], "rendezvous": os.environ.get("PIPEDEJAVU_RENDEZVOUS"),
             "parent": os.getppid(), "pid": os.getpid(), "session_leader": os.getsid(0) == os.getpid(),
             "sigint_default": signal.getsignal(signal.SIGINT) == signal.SIG_DFL, "argv": sys.argv[1:]}
    command = sys.argv[1]
    if command == "report":
        Path(sys.argv[2], f"rank{found['rank']}.json").write_text(json.dumps(found))
    elif command == "fail":
        if found["rank"] == sys.argv[2]:
            time.sleep(0.2)
            sys.exit(int(sys.argv[3]))
        time.sleep(60)
    elif command == "sleep":
        time.sleep(60)
