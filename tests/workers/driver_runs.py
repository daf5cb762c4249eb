"""Several runs of the PyTorch driver (examples/pytorch/train.py) in one Horovod job: one world
started once instead of one launch per run. argv[1] is a JSON file with a list of
``[name, [driver arguments]]``; before each run every rank prints ``== RUN <name>``, so a test can
cut the job's output into runs. A run that raises ends the job with its traceback, as a launch of the
driver alone would.
"""
import json
import sys

from examples.pytorch import train

for name, argv in json.load(open(sys.argv[1])):
    print(f"== RUN {name}", flush=True)
    train.main(argv)
