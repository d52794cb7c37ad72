"""A real Ray cluster on this machine for the executor tests (pytest plugin, see ``conftest.py``).

``ray_cluster`` (module scope, one per test module that asks for it): a head that runs no task and one
worker node of 1 CPU, started with ``ray.cluster_utils.Cluster`` (each node its own raylet and worker
processes, as on separate machines), with this process connected as the driver. ``start_worker_node``
adds a node (a second try when the loaded machine made Ray's start-up time out). The nodes may reach
the test Hub (``HF_HUB_OFFLINE=0`` in their environment; the suite's driver stays offline). Ray is
imported only when the fixture is used: the suite runs without it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

# a loaded 2-core machine starts Ray's agents slowly; node deaths are noticed within seconds
RAY_ENV = {"RAY_agent_register_timeout_ms": "180000", "RAY_worker_register_timeout_seconds": "180",
           "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
           "RAY_health_check_initial_delay_ms": "0"}
NODE_ENV = {"HF_HUB_OFFLINE": "0"}  # what the nodes' processes inherit (the driver's own setting is kept)


@contextmanager
def _env(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_worker_node(cluster):
    """A worker node of 1 CPU (a second try when the loaded machine made Ray's start-up time out)."""
    with _env(NODE_ENV):
        try:
            return cluster.add_node(num_cpus=1)
        except Exception:  # noqa: BLE001
            return cluster.add_node(num_cpus=1)


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray cluster of two nodes on this machine: a head that runs no task and one worker node of 1 CPU."""
    ray = pytest.importorskip("ray", reason="hubsoup[ray] is not installed")
    from ray.cluster_utils import Cluster

    with _env(RAY_ENV):
        c = None
        for attempt in range(3):  # Ray gives a node 30 s to register: a loaded machine may need another try
            try:
                with _env(NODE_ENV):
                    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
                break
            except Exception:  # noqa: BLE001
                if attempt == 2:
                    raise
        start_worker_node(c)
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        try:
            yield c
        finally:
            ray.shutdown()
            c.shutdown()
