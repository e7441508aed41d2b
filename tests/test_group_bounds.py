"""Every wait of the trainer's group lifecycle has a bound and a refusal ends it at once.

Real ``torch.distributed`` rendezvous (a TCP store on loopback) in this process:
rank 0 hosts a group whose other ranks never come, as when the router refused
``/init_weights_update_group`` on the workers' side.
"""

from __future__ import annotations

import threading
import time

import pytest

from router.dataplane.group import GroupError, init_weight_update_group
from router.trainer.rendezvous import alongside
from tests.procs import free_port

# Far beyond the moment each call is expected to return: reaching it would mean the bound did not work.
JOIN_TIMEOUT_S = 120.0
#: Not a speed check: a join the cancel did not end would wait JOIN_TIMEOUT_S for a rank that never
#: comes; it is expected to end within a second of the cancel, 0.3 s in.
ENDED_WITHIN_S = JOIN_TIMEOUT_S / 4


def host_alone(cancel: threading.Event | None, port: int, name: str) -> None:
    init_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        group_name=name,
        backend="gloo",
        timeout_s=JOIN_TIMEOUT_S,
        cancel=cancel,
    )


@pytest.mark.timeout(60)
def test_a_cancelled_join_gives_up_at_once() -> None:
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()  # a cancel that comes while the join waits
    started = time.monotonic()
    with pytest.raises(GroupError, match="cancelled"):
        host_alone(cancel, free_port(), "cancelled-join")
    assert time.monotonic() - started < ENDED_WITHIN_S


@pytest.mark.timeout(60)
def test_a_refused_remote_init_ends_the_local_join_with_the_refusal() -> None:
    """The driver's pairing: the router's answer and the trainer's join run side by side; the
    router's refusal (raised by ``remote``) cancels the join instead of letting it wait out its timeout."""
    cancel = threading.Event()
    port = free_port()

    def refused_by_router() -> None:
        time.sleep(0.3)  # not synchronisation: the router's answer comes while the join waits (either order ends it)
        raise RuntimeError("init_weights_update_group refused: 2 of 2 worker(s) not ready")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="refused"):
        alongside(
            refused_by_router,
            lambda: host_alone(cancel, port, "refused-init"),
            timeout_s=JOIN_TIMEOUT_S,
            what="/init_weights_update_group",
            remote_failed=cancel,
        )
    assert cancel.is_set()
    assert time.monotonic() - started < ENDED_WITHIN_S
