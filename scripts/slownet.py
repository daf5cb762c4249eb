#!/usr/bin/env python3
"""Run a Horovod job whose ranks talk over a slow link, on one machine.

Each rank runs in its own Linux network namespace; the namespaces are joined by veth pairs to a
bridge namespace whose ports are rate-limited by a ``tc`` token bucket (default 1 Gbit/s each way),
and Gloo carries the traffic between them. That is the bandwidth-bound regime of multi-node training,
reproduced on a single host, so that compressed and uncompressed exchanges can be timed side by side.
Needs root (``ip netns``). Addresses come from the benchmarking range 198.18.0.0/15 and exist only
inside the namespaces, which are deleted on exit.

    sudo python scripts/slownet.py --np 2 --rate 1gbit -- python -m hvd_quant.bench exchange --numel 25600000

``--torch`` starts torch.distributed processes instead (``env://``: MASTER_ADDR is rank 0's address,
RANK, WORLD_SIZE, LOCAL_RANK; Gloo on each rank's link), e.g. a DDP job of the training benchmark:

    sudo python scripts/slownet.py --torch -- python -m hvd_quant.bench._train_worker --method ddp-fp32 \
        --model cpu_resnet --device cpu

``--nodes K`` groups the ranks into K emulated nodes of ``np / K`` ranks: one namespace per node, its
ranks talking over the namespace's own addresses (unlimited, as inside a machine) and to other nodes
over the node's rate-limited link; Horovod sees K hosts (local and cross ranks as on a cluster). At
the end each node's link reports the bytes it carried (``ip -s link`` counters of its veth in the
bridge namespace, each direction), and with ``--bytes-json FILE`` they are written there.
"""
import argparse
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

PREFIX = "hq"
SUBNET = "198.18.0"


def sh(cmd, check=True):
    return subprocess.run(cmd, shell=True, check=check, capture_output=True, text=True)


def teardown(np_):
    for r in range(np_):
        sh(f"ip netns del {PREFIX}{r}", check=False)
        shutil.rmtree(f"/etc/netns/{PREFIX}{r}", ignore_errors=True)
    sh(f"ip netns del {PREFIX}br", check=False)


def link_bytes(nodes):
    """{node: (bytes the node sent, bytes it received)} over its link, from the bridge side's counters."""
    out = {}
    for r in range(nodes):
        stats = json.loads(sh(f"ip -s -j -n {PREFIX}br link show dev {PREFIX}{r}b").stdout)[0]["stats64"]
        out[r] = (stats["rx"]["bytes"], stats["tx"]["bytes"])      # the bridge receives what the node sends
    return out


def setup(np_, rate, delay):
    teardown(np_)
    sh(f"ip netns add {PREFIX}br")
    sh(f"ip netns exec {PREFIX}br ip link add br0 type bridge")
    sh(f"ip netns exec {PREFIX}br ip link set br0 up")
    for r in range(np_):
        ns = f"{PREFIX}{r}"
        sh(f"ip netns add {ns}")
        sh(f"ip link add {ns}a netns {ns} type veth peer name {ns}b netns {PREFIX}br")
        sh(f"ip netns exec {ns} ip addr add {SUBNET}.{r + 1}/24 dev {ns}a")
        sh(f"ip netns exec {ns} ip link set {ns}a up")
        sh(f"ip netns exec {ns} ip link set lo up")
        # Horovod 0.28.1 opens its process-set Gloo contexts on the address the host name resolves to,
        # whatever HOROVOD_GLOO_IFACE says; `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts,
        # so inside each namespace the host name resolves to that rank's own address.
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        with open(f"/etc/netns/{ns}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n{SUBNET}.{r + 1} {socket.gethostname()}\n")
        sh(f"ip netns exec {PREFIX}br ip link set {ns}b master br0")
        sh(f"ip netns exec {PREFIX}br ip link set {ns}b up")
        netem = f" delay {delay}" if delay else ""
        # Egress limit on both ends of each veth: rank -> bridge and bridge -> rank.
        for side, dev in ((ns, f"{ns}a"), (f"{PREFIX}br", f"{ns}b")):
            sh(f"ip netns exec {side} tc qdisc add dev {dev} root handle 1: tbf rate {rate} burst 256kb latency 100ms")
            if netem:
                sh(f"ip netns exec {side} tc qdisc add dev {dev} parent 1:1 handle 10: netem{netem}")


RENDEZVOUS = """
import sys, time
from horovod.runner.http.http_server import RendezvousServer
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
np_ = int(sys.argv[1])
server = RendezvousServer(verbose=0)
port = server.start()
nodes = int(sys.argv[2])
server.init(get_host_assignments(parse_hosts(",".join(f"h{r}:{np_ // nodes}" for r in range(nodes))), np_))
print(port, flush=True)
while True:
    time.sleep(3600)
"""


def main():
    global PREFIX
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="tc rate of every link, each direction (default 1gbit)")
    ap.add_argument("--delay", default="", help="optional netem delay per hop, e.g. 0.1ms")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--nodes", type=int, default=None,
                    help="emulated nodes (default: one per rank), each with np/nodes ranks (module doc)")
    ap.add_argument("--bytes-json", default=None, help="write each node link's bytes here at the end")
    ap.add_argument("--torch", action="store_true", help="torch.distributed processes (env://), not Horovod")
    ap.add_argument("--prefix", default=PREFIX,
                    help=f"namespace names PREFIX0.., PREFIXbr (default {PREFIX}); two jobs at once need two")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command to run after --")
    if os.geteuid() != 0:
        sys.exit("slownet.py needs root for ip netns")
    PREFIX = args.prefix
    nodes = args.nodes or args.np
    if nodes < 1 or args.np % nodes:
        ap.error(f"--nodes must divide --np ({args.np})")
    per = args.np // nodes          # ranks per node
    atexit.register(teardown, nodes)
    setup(nodes, args.rate, args.delay)
    print(f"[slownet] {nodes} namespaces at {SUBNET}.1-{nodes} ({per} rank(s) each), links limited to "
          f"{args.rate}{' + ' + args.delay + ' delay' if args.delay else ''}", flush=True)
    server = None
    if not args.torch:
        server = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}0", sys.executable, "-c", RENDEZVOUS,
                                   str(args.np), str(nodes)], stdout=subprocess.PIPE, text=True,
                                  start_new_session=True)
        port = server.stdout.readline().strip()
    procs, start = [], link_bytes(nodes)
    try:
        for r in range(args.np):
            node, local = divmod(r, per)
            if args.torch:
                env = dict(os.environ, MASTER_ADDR=f"{SUBNET}.1", MASTER_PORT="29500", RANK=str(r),
                           WORLD_SIZE=str(args.np), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per),
                           GLOO_SOCKET_IFNAME=f"{PREFIX}{node}a", PYTHONUNBUFFERED="1")
            else:
                env = dict(os.environ,
                           HOROVOD_GLOO_RENDEZVOUS_ADDR=f"{SUBNET}.1", HOROVOD_GLOO_RENDEZVOUS_PORT=port,
                           HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
                           HOROVOD_GLOO_IFACE=f"{PREFIX}{node}a", HOROVOD_HOSTNAME=f"h{node}",
                           HOROVOD_RANK=str(r), HOROVOD_SIZE=str(args.np), HOROVOD_LOCAL_RANK=str(local),
                           HOROVOD_LOCAL_SIZE=str(per), HOROVOD_CROSS_RANK=str(node),
                           HOROVOD_CROSS_SIZE=str(nodes), PYTHONUNBUFFERED="1")
            # The "hosts" share this machine's cores: give each rank its share of threads (Numba's
            # pool and OpenMP's would otherwise each take every core), unless the caller chose.
            share = str(max(1, len(os.sched_getaffinity(0)) // args.np))
            for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS"):
                env.setdefault(var, share)
            procs.append(subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}{node}", *cmd], env=env,
                                          start_new_session=True))
        deadline = time.time() + args.timeout
        codes = [None] * args.np
        while any(c is None for c in codes):
            if time.time() > deadline:
                raise TimeoutError(f"job did not finish in {args.timeout}s")
            for i, p in enumerate(procs):
                codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
        end = link_bytes(nodes)
        carried = {r: [b - a for a, b in zip(start[r], end[r])] for r in range(nodes)}
        for r, (sent, received) in carried.items():
            print(f"[slownet] node {r} link: sent {sent} bytes, received {received} bytes", flush=True)
        if args.bytes_json:
            with open(args.bytes_json, "w") as f:
                json.dump({"nodes": nodes, "np": args.np, "rate": args.rate,
                           "links": {str(r): {"sent": s_, "received": r_} for r, (s_, r_) in carried.items()}}, f)
        rc = max((c or 0) for c in codes)
        if any(c is None for c in codes) or rc:
            print(f"[slownet] a rank failed: exit codes {codes}", file=sys.stderr)
            rc = rc or 1
    finally:
        for p in procs + ([server] if server else []):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    sys.exit(rc)


if __name__ == "__main__":
    main()
