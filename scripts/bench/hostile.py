#!/usr/bin/python3
"""Hostile-client figures for `udm serve` (docs/benchmarks.md).

  scripts/bench/hostile.py rss   UDM [N]   # peak RSS with N (16) slow readers
  scripts/bench/hostile.py flood UDM [M]   # a real client's connect time
                                           # during a flood of M (20000) idle
                                           # sockets from two processes

UDM is the udm binary. Each run starts its own server on a RAM disk (64 MiB,
linear over it, export 'lin') on a unix socket in a temporary directory.
"""
import os
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20
# Seconds after the flood starts that the real client starts trying.
DELAY = float(os.environ.get("DELAY", "2"))


def start(udm, extra=()):
    d = tempfile.mkdtemp(prefix="udm-hostile-")
    sock = os.path.join(d, "nbd.sock")
    log = open(os.path.join(d, "log"), "w")
    p = subprocess.Popen(
        [udm, "serve", "--dev", "ram0=ram:64M", "--dev", "lin=0 131072 linear ram0 0",
         "--listen", "unix:" + sock, *extra],
        stdout=subprocess.DEVNULL, stderr=log)
    t0 = time.time()
    while not os.path.exists(sock):
        if time.time() - t0 > 10:
            raise SystemExit("server did not start")
        time.sleep(0.01)
    time.sleep(0.2)
    return p, sock


def recv_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise ConnectionError("closed")
        b += c
    return b


def negotiate(sock, timeout=5.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(sock)
    g = recv_exact(s, 18)
    assert g[:8] == b"NBDMAGIC"
    s.sendall(struct.pack(">I", 3))
    name = b"lin"
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 7, len(data)) + data)
    while True:
        h = recv_exact(s, 20)
        _, _, ty, ln = struct.unpack(">QIII", h)
        recv_exact(s, ln)
        if ty == 1:
            return s
        if ty != 3:
            raise ConnectionError("GO refused %#x" % ty)


def request(s, cmd, cookie, off, ln, flags=0):
    s.sendall(struct.pack(">IHHQQI", 0x25609513, flags, cmd, cookie, off, ln))


def rss(pid):
    with open("/proc/%d/status" % pid) as f:
        for l in f:
            if l.startswith("VmRSS:"):
                return int(l.split()[1]) << 10
    return 0


def cmd_rss(udm, n=16):
    p, sock = start(udm)
    try:
        good = negotiate(sock)
        # Every page of the RAM disk resident first.
        for off in range(0, 64 * MIB, 4 * MIB):
            request(good, 1, off, off, 4 * MIB)
            good.sendall(b"\x5a" * (4 * MIB))
            recv_exact(good, 16)
        base = rss(p.pid)
        hostile = []
        for i in range(n):
            s = negotiate(sock)
            for k in range(8):
                request(s, 0, i * 100 + k, (k % 2) * 32 * MIB, 32 * MIB)
            hostile.append(s)
        peak, t0 = 0, time.time()
        while time.time() - t0 < 5:
            peak = max(peak, rss(p.pid))
            time.sleep(0.05)
        t1 = time.time()
        for k in range(64):
            request(good, 0, k, k * 4096, 4096)
            recv_exact(good, 16 + 4096)
        served = time.time() - t1
        peak = max(peak, rss(p.pid))
        print("slow readers %d: rss before %d MiB, peak %d MiB; 64 4 KiB reads beside them: %.3f s"
              % (n, base // MIB, peak // MIB, served))
    finally:
        p.kill()
        p.wait()


def flood_proc(sock, count, hold):
    socks, t0 = [], time.time()
    while len(socks) < count and time.time() - t0 < hold:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(sock)
            socks.append(s)
        except OSError:
            s.close()
    time.sleep(max(0, hold - (time.time() - t0)))
    os._exit(0)


def cmd_flood(udm, m=20000):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    p, sock = start(udm)
    try:
        t = time.time()
        s = negotiate(sock)
        request(s, 0, 1, 0, 4096)
        recv_exact(s, 16 + 4096)
        s.close()
        print("idle server: connect + GO + one read: %.3f s" % (time.time() - t))
        kids = []
        t0 = time.time()
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                flood_proc(sock, m // 2, 40)
            kids.append(pid)
        # The client starts trying once the flood is under way (the server
        # at its cap, or out of descriptors).
        time.sleep(DELAY)
        took, tries = None, 0
        while time.time() - t0 < 35:
            tries += 1
            try:
                s = negotiate(sock, timeout=1.0)
                request(s, 0, 1, 0, 4096)
                recv_exact(s, 16 + 4096)
                s.close()
                took = time.time() - t0
                break
            except (OSError, ConnectionError, AssertionError):
                time.sleep(0.05)
        print("flood of %d idle sockets: a real client trying from %.1f s %s (%d tries)"
              % (m, DELAY, "connected and read %.2f s after the flood began" % took
                 if took else "never connected in 35 s", tries))
        for k in kids:
            os.kill(k, 9)
            os.waitpid(k, 0)
    finally:
        p.kill()
        p.wait()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("rss", "flood"):
        raise SystemExit(__doc__)
    arg = [int(x) for x in sys.argv[3:4]]
    {"rss": cmd_rss, "flood": cmd_flood}[sys.argv[1]](sys.argv[2], *arg)
