"""The one torch.distributed rendezvous: on one host its store listens on loopback only,
its keys carry one random prefix that every rank shares, and the groups made on it work
without a process-wide default group."""

import socket

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from hpctrain.errors import CommError
from hpctrain.runtime.torchdist import LOOPBACK, Rendezvous, listen_address

WORLD = MPI.COMM_WORLD


def listeners(port: int) -> list[str]:
    """Local addresses of this process's host listening on ``port`` (``/proc/net/tcp*``,
    what ``ss -ltn`` reads; state 0A is LISTEN)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.split(":")
                if state == "0A" and int(hexport, 16) == port:
                    found.append(addr)
    return found


def test_listen_address_follows_the_hosts():
    assert listen_address(["a", "a", "a"], "10.0.0.9") == LOOPBACK
    assert listen_address(["a", "b"], "10.0.0.9") == "10.0.0.9"
    assert listen_address(["localhost", "b"], None) == socket.gethostbyname("localhost")


def test_an_unresolvable_first_host_asks_for_master_addr(monkeypatch):
    """Hosts that share no name service: the error says how to give the address instead."""
    def unknown(host):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "gethostbyname", unknown)
    with pytest.raises(CommError, match=r"cannot resolve host 'a' .*; set MASTER_ADDR to its "
                                        r"address"):
        listen_address(["a", "b"], None)


@pytest.mark.mpi(ranks=(2, 3))
def test_store_listens_on_loopback_with_a_shared_prefix():
    rdv = Rendezvous(WORLD)
    prefixes = WORLD.allgather(rdv.prefix)
    assert len(set(prefixes)) == 1 and len(prefixes[0]) == 16
    assert rdv.host == LOOPBACK
    # Rank 0 reads the listening sockets; every rank asserts on what it saw.
    seen = WORLD.bcast(listeners(rdv.port) if WORLD.Get_rank() == 0 else None, root=0)
    assert seen == ["0100007F"]  # 127.0.0.1, and nothing on 0.0.0.0 or ::
    # A second rendezvous draws another prefix: two stores never share keys.
    other = Rendezvous(WORLD)
    assert other.prefix != rdv.prefix and other.port != rdv.port
    pg = rdv.process_group("test", WORLD.Get_rank(), WORLD.Get_size())
    t = torch.tensor([float(WORLD.Get_rank() + 1)])
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg.allreduce([t], opts).wait()
    p = WORLD.Get_size()
    assert t.item() == p * (p + 1) / 2
    assert not dist.is_initialized()  # no default group was made
