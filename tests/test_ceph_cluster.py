"""tools/ceph_cluster.py: the one-machine Ceph cluster the remote tests run against."""

import os
import signal
import subprocess
import sys

import boto3
import pytest
from conftest import _load_tool

pytestmark = pytest.mark.stress

ceph_cluster = _load_tool("ceph_cluster")
TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "ceph_cluster.py")


def daemons(root):
    """Programs running with ``root``'s ceph.conf."""
    conf = os.path.join(root, "ceph.conf").encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if conf in argv:
            out.append(os.path.basename(argv[0].decode()))
    return out


def test_without_ceph_it_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    reason = ceph_cluster.missing()
    assert "radosgw" in reason and "apt-get install" in reason
    with pytest.raises(ceph_cluster.CephError, match="apt-get install"):
        ceph_cluster.CephCluster(str(tmp_path / "c")).start()
    out = subprocess.run(
        [sys.executable, TOOL], capture_output=True, text=True, env=dict(os.environ)
    )
    assert out.returncode == 2 and "apt-get install" in out.stderr


def test_a_directory_in_use_is_refused(tmp_path, ceph):
    (tmp_path / "mon").mkdir()
    with pytest.raises(ceph_cluster.CephError, match="not empty"):
        ceph_cluster.CephCluster(str(tmp_path)).start()
    assert os.listdir(tmp_path) == ["mon"]


def test_the_tool_starts_a_cluster_prints_its_endpoint_and_stops(tmp_path, ceph):
    """``python tools/ceph_cluster.py --dir D``: a second cluster beside the session's
    (other ports), usable with what it prints; Ctrl-C stops every daemon."""
    proc = subprocess.Popen(
        [sys.executable, TOOL, "--dir", str(tmp_path), "--bucket", "kv-tool"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        while not lines or lines[-1] != "Ctrl-C stops it.":
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            lines.append(line.rstrip("\n"))
        assert "started in" in lines[0] and "ceph version" in lines[0]
        env = dict(
            line[len("export ") :].split("=", 1)
            for line in lines
            if line.startswith("export ")
        )
        assert env["AWS_ENDPOINT_URL"] != ceph.endpoint
        s3 = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        )
        s3.put_object(Bucket="kv-tool", Key="a/b", Body=b"bytes")
        assert s3.get_object(Bucket="kv-tool", Key="a/b")["Body"].read() == b"bytes"
        assert sorted(daemons(tmp_path)) == ["ceph-mon", "ceph-osd", "radosgw"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read()
    assert daemons(tmp_path) == []
    assert ceph.client().list_buckets()  # the session's cluster is untouched
