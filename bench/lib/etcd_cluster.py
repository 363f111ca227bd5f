"""A throwaway etcd cluster of three (or five) members on 127.0.0.1: what production runs, for the fault harness.

Each member is an ``EtcdProcess`` (``bench/lib/etcd_proc.py``) with its own free ports and its own
folder under ``root``, so it can be SIGKILLed and started again on its data, or frozen with SIGSTOP
(the closest a single host comes to a member partitioned away: its clients' connections stay open
and answer nothing) and thawed with SIGCONT. Every signal goes to a member's own PID.

    cluster = EtcdCluster(root)            # members a, b, c
    cluster.start()                        # all up and agreeing on a leader
    url = cluster.registry_url("/kdn/")    # etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/kdn/
    cluster.make_leader(cluster.members[0])
    cluster.members[0].kill()              # the leader, mid-whatever
    cluster.leader(timeout=10)             # the member the other two elected
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

from etcd_proc import ETCD_BIN, EtcdProcess  # bench/lib/etcd_proc.py


class Member(EtcdProcess):
    """One member of an ``EtcdCluster``: its data and log under ``root/NAME``, kept across restarts."""

    def __init__(self, name: str, root: Path) -> None:
        super().__init__(ETCD_BIN, root=root / name, retry_ports=False)  # its peers are told its ports
        self.name = name
        self.paused = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self, timeout: float = 1.0) -> dict:
        """``/v3/maintenance/status`` (etcd's JSON gateway): this member's id (``header.member_id``), the
        leader it knows of (``leader``, "0" for none) and its raft term. ``OSError`` when it does not answer."""
        req = urllib.request.Request(f"{self.url}/v3/maintenance/status", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)

    def kill(self) -> None:
        """SIGKILL: no goodbye to its peers or its clients."""
        if self.alive:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: the process holds its sockets and answers nothing, to its peers or its clients."""
        assert self.alive
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.alive and self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.resume()  # a stopped process cannot act on SIGTERM
        super().stop(sig)


class EtcdCluster:
    """``n`` etcd members on 127.0.0.1, each with its own ports and folder under ``root``."""

    def __init__(self, root: Path, n: int = 3) -> None:
        assert n in (1, 3, 5), "a cluster of 1, 3 or 5 members (an even count buys no tolerance)"
        root.mkdir(parents=True, exist_ok=True)
        self.members = [Member("abcde"[i], root) for i in range(n)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    def endpoints(self) -> str:
        """``127.0.0.1:P1,127.0.0.1:P2,...``: every member's client address, in member order."""
        return ",".join(f"127.0.0.1:{m.client_port}" for m in self.members)

    def registry_url(self, prefix: str = "/kdn/") -> str:
        """The KDN registry URL naming every member (``kdn/registry/url.py``: several endpoints)."""
        return f"etcd://{self.endpoints()}{prefix}"

    def start(self, timeout: float = 30.0) -> None:
        """Start every member that is not running and wait until each is healthy (it sees a leader)."""
        for m in self.members:
            if not m.alive:
                m.spawn()
        for m in self.members:
            m.wait_healthy(timeout)

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def member_ids(self) -> dict[str, Member]:
        """Raft member id (as etcd's JSON writes it: a decimal string) -> member, of the members answering."""
        out = {}
        for m in self.members:
            if m.alive and not m.paused:
                try:
                    out[m.status()["header"]["member_id"]] = m
                except OSError:
                    pass
        return out

    def leader(self, timeout: float = 15.0) -> Member:
        """The member that every running, unpaused member names as leader, once they agree (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            ids, named = {}, set()
            for m in self.members:
                if not m.alive or m.paused:
                    continue
                try:
                    st = m.status()
                except OSError:
                    named.add(None)
                    continue
                ids[st["header"]["member_id"]] = m
                named.add(st.get("leader", "0"))
            if len(named) == 1:
                (lead,) = named
                if lead in ids:
                    return ids[lead]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no agreed leader in {timeout} s (members name {named})")
            time.sleep(0.05)

    def make_leader(self, target: Member, timeout: float = 15.0) -> None:
        """Hand leadership to ``target`` (etcd's ``move-leader``, asked of the current leader)."""
        for _ in range(20):  # bounded: a handover can race an election
            lead = self.leader(timeout)
            if lead is target:
                return
            target_id = target.status()["header"]["member_id"]
            req = urllib.request.Request(f"{lead.url}/v3/maintenance/transfer-leadership",
                                         data=json.dumps({"targetID": target_id}).encode(), method="POST")
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    r.read()
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"could not make {target.name} the leader")

    def compact_now(self) -> None:
        live = next(m for m in self.members if m.alive and not m.paused)
        live.compact_now()
