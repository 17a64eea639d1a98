#!/usr/bin/env python
"""A one-machine Ceph cluster with its S3 gateway, for tests and benchmarks.

One monitor, one memstore OSD (data in RAM) and ``radosgw`` (beast frontend) on free
loopback ports, all under one directory with its own ``ceph.conf``: no systemd, no
fixed ports, nothing written outside that directory. An S3 user is created; clients
use path-style addressing and region us-east-1. Needs Debian's (or Ubuntu's)
``ceph-mon``, ``ceph-osd``, ``radosgw`` and ``ceph-common`` packages; no root needed
to run it.

Usage::

    python tools/ceph_cluster.py [--dir DIR] [--bucket NAME]

starts a cluster, prints its endpoint, credentials and the ``export`` lines for the
``AWS_*`` variables kvstore reads, and keeps it up until Ctrl-C. From Python::

    with CephCluster() as ceph:
        s3 = ceph.client()
        s3.create_bucket(Bucket="kv")

Pure standard library (boto3 only for :meth:`CephCluster.client`): kvstore's tests
import it, and it works without kvstore.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Dict, List, Optional

BINARIES = (
    "ceph-mon",
    "ceph-osd",
    "radosgw",
    "radosgw-admin",
    "monmaptool",
    "ceph-authtool",
    "ceph",
)
# One keyring for every daemon and client (cephx: radosgw refuses auth "none").
# The monitor imports it at mkfs, so no key is added later.
_KEYS = (
    ("mon.", ["--cap", "mon", "allow *"]),
    ("client.admin", ["--cap", "mon", "allow *", "--cap", "osd", "allow *"]),
    ("osd.0", ["--cap", "mon", "allow profile osd", "--cap", "osd", "allow *"]),
    ("client.rgw.a", ["--cap", "mon", "allow rw", "--cap", "osd", "allow rwx"]),
)
PACKAGES = "ceph-mon ceph-osd radosgw ceph-common"
REGION = "us-east-1"

_CONF = """\
[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
run dir = {root}/run
admin socket = {root}/run/$cluster-$name.asok
pid file = {root}/run/$cluster-$name.pid
log file = {root}/log/$cluster-$name.log
crash dir = {root}/crash
exporter sock dir = {root}/run
keyring = {root}/keyring
mon data = {root}/mon/$cluster-$id
osd data = {root}/osd/$cluster-$id
rgw data = {root}/rgw/$cluster-$id
log to stderr = false
err to stderr = false
ms bind ipv6 = false
ms bind msgr1 = false
# Start in ~1.3 s instead of ~8 s: maps proposed and client ticks at short intervals.
paxos propose interval = 0.05
objecter tick interval = 0.5
# One OSD: size-1 pools, few PGs, no autoscaler or manager, no free-disk guard.
osd objectstore = memstore
memstore device bytes = {memstore_bytes}
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail crit = 0
mon data avail warn = 0
mon max pg per osd = 1000
osd crush chooseleaf type = 0
# A killed gateway's cache watch expires in 3 s, not 30: until then every bucket
# creation (a metadata write notifies all gateways' caches) waits for it.
osd client watch timeout = 3

[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw thread pool size = 64
# Deleted objects' data goes as soon as gc runs (the bench frees the OSD's RAM so).
rgw gc obj min wait = 0
"""


def missing() -> Optional[str]:
    """Why a cluster cannot start here (the missing programs), or None."""
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        return (
            f"Ceph is not installed ({', '.join(absent)} not on PATH; on Debian or "
            f"Ubuntu: apt-get install {PACKAGES})"
        )
    return None


def free_ports(n: int) -> List[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now (the kernel's picks; each socket
    held until all are picked, so no port is picked twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class CephError(RuntimeError):
    """The cluster could not start or a command failed; the message says which."""


class CephCluster:
    """A monitor, one OSD and a gateway under ``root`` (a new temp directory if None).

    Args:
        root: The cluster's directory (config, data, logs, sockets): new or empty,
            kept; None: a new temp directory, removed by :meth:`stop`.
        memstore_bytes: The OSD's capacity (held in RAM as it fills).
        timeout: Seconds each step of :meth:`start` may take.
    """

    def __init__(
        self,
        root: Optional[str] = None,
        *,
        memstore_bytes: int = 2 << 30,
        timeout: float = 60.0,
    ):
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="kvstore-ceph-")
        self.memstore_bytes = memstore_bytes
        self.timeout = timeout
        self.conf = os.path.join(self.root, "ceph.conf")
        self.procs: Dict[str, subprocess.Popen] = {}
        self.rgw_port = 0
        self.access_key = "kvstore-test-access"
        self.secret_key = "kvstore-test-secret-" + uuid.uuid4().hex
        self.startup_seconds: Optional[float] = None

    # -- lifecycle ---------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    def start(self) -> "CephCluster":
        """Bootstrap and start everything; the gateway answers S3 when this returns.

        Raises:
            CephError: a step failed or timed out (the message quotes its log).
        """
        reason = missing()
        if reason:
            raise CephError(reason)
        tic = time.monotonic()
        try:
            self._bootstrap()
            self.start_mon()
            self._create_osd()
            self.start_osd()
            self.start_rgw()
            self.admin(
                "user",
                "create",
                "--uid=kvstore",
                "--display-name=kvstore tests",
                f"--access-key={self.access_key}",
                f"--secret={self.secret_key}",
            )
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - tic
        return self

    def stop(self) -> None:
        """Stop the gateway, then the OSD, then the monitor (stopping the gateway and
        the OSD together can hang the gateway); remove ``root`` if this made it."""
        for name in ("rgw", "osd", "mon"):
            self._terminate(name)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "CephCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _bootstrap(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        if os.listdir(self.root):
            raise CephError(f"{self.root} is not empty: a new cluster needs its own")
        for d in ("run", "log", "crash", "mon", "osd", "rgw"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        self.fsid = str(uuid.uuid4())
        self.mon_port, self.rgw_port = free_ports(2)
        with open(self.conf, "w") as f:
            f.write(
                _CONF.format(
                    fsid=self.fsid,
                    mon_port=self.mon_port,
                    rgw_port=self.rgw_port,
                    root=self.root,
                    memstore_bytes=self.memstore_bytes,
                )
            )
        keyring = os.path.join(self.root, "keyring")
        for i, (name, caps) in enumerate(_KEYS):
            create = ["--create-keyring"] if i == 0 else []
            self._run("ceph-authtool", keyring, *create, "--gen-key", "-n", name, *caps)
        monmap = os.path.join(self.root, "monmap")
        self._run(
            "monmaptool",
            "--create",
            "--fsid",
            self.fsid,
            "--addv",
            "a",
            f"[v2:127.0.0.1:{self.mon_port}]",
            monmap,
        )
        self._run("ceph-mon", "-c", self.conf, "-i", "a", "--mkfs", "--monmap", monmap)

    def _create_osd(self) -> None:
        self.osd_uuid = str(uuid.uuid4())
        self.osd_id = self.ceph("osd", "new", self.osd_uuid).strip()
        os.makedirs(os.path.join(self.root, "osd", f"ceph-{self.osd_id}"))
        self._run(
            "ceph-osd",
            "-c",
            self.conf,
            "-i",
            self.osd_id,
            "--mkfs",
            "--osd-uuid",
            self.osd_uuid,
        )

    # -- daemons -----------------------------------------------------------------

    def start_mon(self) -> None:
        self._spawn("mon", ["ceph-mon", "-f", "-c", self.conf, "-i", "a"])
        self._wait(lambda: self._ok("ceph", "-c", self.conf, "mon", "stat"), "mon")

    def start_osd(self) -> None:
        self._spawn("osd", ["ceph-osd", "-f", "-c", self.conf, "-i", self.osd_id])
        self._wait(self._osd_up, "osd")

    def start_rgw(self) -> None:
        """Start the gateway (again) on its port; returns once it answers HTTP."""
        self._spawn("rgw", ["radosgw", "-f", "-c", self.conf, "-n", "client.rgw.a"])
        self._wait(self._rgw_answers, "rgw")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to daemon ``name`` (``mon``, ``osd`` or ``rgw``); with SIGKILL
        or SIGTERM, wait for it to exit."""
        proc = self.procs[name]
        proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.wait(self.timeout)
            del self.procs[name]

    def _spawn(self, name: str, argv: List[str]) -> None:
        log = open(os.path.join(self.root, "log", f"{name}.out"), "ab")
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()

    def _terminate(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused daemon cannot handle SIGTERM
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _wait(self, ready, name: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            proc = self.procs[name]
            if proc.poll() is not None:
                raise CephError(
                    f"{name} exited with {proc.returncode}: {self._tail(name)}"
                )
            if time.monotonic() > deadline:
                raise CephError(
                    f"{name} not ready after {self.timeout:g} s: {self._tail(name)}"
                )
            time.sleep(0.05)

    def _osd_up(self) -> bool:
        try:
            dump = json.loads(self.ceph("osd", "dump", "--format=json"))
        except CephError:
            return False
        return any(o["up"] for o in dump["osds"])

    def _rgw_answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1).close()
        except urllib.error.HTTPError:
            return True  # an S3 error answer: it serves
        except OSError:
            return False
        return True

    def _tail(self, name: str) -> str:
        out = []
        for fname in (
            f"{name}.out",
            f"ceph-{'client.rgw.a' if name == 'rgw' else name}.log",
        ):
            path = os.path.join(self.root, "log", fname)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f.read()[-2000:])
        return "\n".join(out) or "(no log)"

    # -- commands ----------------------------------------------------------------

    def _run(self, *argv: str, timeout: Optional[float] = None) -> str:
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout or self.timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise CephError(
                f"{' '.join(argv)}: no answer in {timeout or self.timeout:g} s"
            )
        if done.returncode != 0:
            raise CephError(
                f"{' '.join(argv)} exited with {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()[-2000:]}"
            )
        return done.stdout

    def _ok(self, *argv: str) -> bool:
        try:
            self._run(*argv, timeout=5)
        except CephError:
            return False
        return True

    def ceph(self, *args: str) -> str:
        """``ceph -c <conf> ARGS``'s output."""
        return self._run("ceph", "-c", self.conf, "--connect-timeout", "10", *args)

    def admin(self, *args: str) -> dict:
        """``radosgw-admin ARGS`` as the gateway's client; its JSON answer ({} if none)."""
        out = self._run("radosgw-admin", "-c", self.conf, "-n", "client.rgw.a", *args)
        return json.loads(out) if out.strip() else {}

    def gc(self) -> None:
        """Run the gateway's garbage collection now (deleted objects' data)."""
        self.admin("gc", "process", "--include-all")

    # -- clients -----------------------------------------------------------------

    def env(self) -> Dict[str, str]:
        """The ``AWS_*`` variables that point boto3 (and kvstore) at the gateway."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self, **config):
        """A boto3 S3 client of the gateway (path-style, us-east-1)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def version(self) -> str:
        return self._run("radosgw", "--version").strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dir", default=None, help="the cluster's directory (default: temp)"
    )
    p.add_argument(
        "--bucket", default="kv-cache", help="a bucket to create ('' for none)"
    )
    p.add_argument("--memstore-gib", type=float, default=2.0, help="the OSD's RAM")
    args = p.parse_args(argv)
    reason = missing()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cluster = CephCluster(args.dir, memstore_bytes=int(args.memstore_gib * (1 << 30)))
    try:
        cluster.start()
        if args.bucket:
            cluster.client().create_bucket(Bucket=args.bucket)
        print(f"{cluster.version()}: started in {cluster.startup_seconds:.2f} s")
        print(f"directory: {cluster.root}")
        for k, v in cluster.env().items():
            print(f"export {k}={v}")
        if args.bucket:
            print(f"# kvstore ... --remote s3://{args.bucket}/fleet")
        print("Ctrl-C stops it.", flush=True)
        while all(p.poll() is None for p in cluster.procs.values()):
            time.sleep(1)
        print("a daemon exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
