#!/bin/sh
# OpenMPI launch agent (mpirun --mca plm_rsh_agent THIS) for emulated nodes on one machine: runs the
# daemon command here, whatever host it was meant for. With a hostfile of 127.0.0.2 and 127.0.0.3
# (loopback addresses that are not an interface's own, so OpenMPI treats them as remote hosts) each
# "host" gets its own daemon and Horovod's local and cross ranks come out as on two nodes.
shift
exec sh -c "$*"
