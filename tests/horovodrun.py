"""``horovodrun`` for the tests: Horovod's own launcher (``horovod.runner.launch.run_commandline``), as
the installed ``horovodrun`` runs it, but for its Gloo build probe. That probe forks a process that
imports TensorFlow at every launch (seconds of CPU per job, on 2 cores shared by the ranks);
tests/launch.py probes once per test process and passes the answer on (``HVDQ_GLOO_BUILT=1``).
Without it this launcher probes as horovodrun does."""
import os
import sys

import horovod.runner.launch as launch

if __name__ == "__main__":
    if os.environ.get("HVDQ_GLOO_BUILT") == "1":
        launch.gloo_built = lambda verbose=False: True
    sys.argv[0] = "horovodrun"
    sys.exit(launch.run_commandline())
