"""The default root is the machine's, not the Ray node's: ``{host}``, ``{namespace}`` and a
``{slot}`` each storage node of the machine holds under a lock (``node/root_slot.py``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from flatcake_ray.config import ServiceConfig, host_name
from flatcake_ray.errors import StoreInUseError
from flatcake_ray.node.root_slot import RootSlot


def test_the_default_root_names_the_namespace_the_host_and_the_slot():
    config = ServiceConfig(namespace="team/a")
    first = config.store_config("a" * 16 + "-ray-node-1", 1, slot=0).root
    again = config.store_config("b" * 16 + "-ray-node-2", 1, slot=0).root  # a new Ray node
    assert first == again == f"/var/tmp/flatcake/team_a/{host_name()}-0"
    assert config.store_config("c" * 16, 1, slot=3).root.endswith("-3")
    assert host_name() == socket.gethostname().replace("/", "_")


def test_node_and_slot_expand_in_every_source(tmp_path):
    environ = {"FLATCAKE_ROOT": f"{tmp_path}/{{host}}/{{slot}}", "FLATCAKE_SSD_DIRS": "/d/{slot}"}
    store = ServiceConfig().store_config("f" * 16, 1, environ, slot=2)
    assert store.root == f"{tmp_path}/{host_name()}/2" and store.ssd_dirs == ("/d/2",)


def slots(tmp_path):
    return lambda slot: str(tmp_path / f"host-{slot}")


def test_nodes_of_one_machine_take_the_smallest_free_slots(tmp_path):
    first, second = RootSlot.claim(slots(tmp_path)), RootSlot.claim(slots(tmp_path))
    assert (first.index, second.index) == (0, 1)
    assert second.root == tmp_path / "host-1" and second.root.is_dir()
    first.close()
    again = RootSlot.claim(slots(tmp_path))  # the node that comes back gets its folder again
    assert again.index == 0
    for slot in (again, second):
        slot.close()


def test_a_root_without_a_slot_has_one_and_a_second_claim_is_a_typed_error(tmp_path):
    only = RootSlot.claim(lambda slot: str(tmp_path / "fixed"))
    with pytest.raises(StoreInUseError, match="held by another storage node"):
        RootSlot.claim(lambda slot: str(tmp_path / "fixed"))
    only.close()
    RootSlot.claim(lambda slot: str(tmp_path / "fixed")).close()


def test_a_killed_holder_frees_its_slot(tmp_path):
    """A crash never leaves a slot held: the kernel drops a dead process's flock."""
    code = (
        "import sys, time; from flatcake_ray.node.root_slot import RootSlot; "
        f"s = RootSlot.claim(lambda i: {str(tmp_path)!r} + f'/host-{{i}}'); "
        "print(s.index, flush=True); time.sleep(600)"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "0"
            held = RootSlot.claim(slots(tmp_path))
            assert held.index == 1
            held.close()
        finally:
            child.kill()
            child.wait(timeout=60)
    assert os.path.isdir(tmp_path / "host-0")
    back = RootSlot.claim(slots(tmp_path))
    assert back.index == 0
    back.close()
