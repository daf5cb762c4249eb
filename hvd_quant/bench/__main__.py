"""``python -m hvd_quant.bench <command> [options]`` (see ``hvd_quant.bench``)."""
import sys

from hvd_quant.bench import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
