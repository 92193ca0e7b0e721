"""A training job on a simulated two-node Ray cluster that loses the node its workers run on.

Run as ``python -m tests.platform._multinode ROOT`` from the repository root (by
``test_multinode.py``, in a process of its own: the cluster is not the test session's). The head
node runs the driver and the Train controller; two worker nodes each offer room for the 2
training workers (custom resource ``trainer``). Once the first checkpoint is registered, the node
holding the training workers is removed (its processes killed, as when a machine is lost); Ray
Train restarts the worker group on the other node from that checkpoint. Prints one JSON line:
the result's metrics, the removed node and the nodes the workers ran on.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import ray
from ray._private import state
from ray.cluster_utils import Cluster

import raydlrm
from tests.platform.test_resume import _config

# 64 steps of 2 x 32 rows: the node goes at the first checkpoint (step 16), 48 steps before the end.
ROWS = 4096
MB = 1024 * 1024


def _worker_nodes() -> set[str]:
    """The nodes of the live Ray Train workers (from the GCS: this cluster has no dashboard,
    so no state API)."""
    actors = state.actors(actor_state_name="ALIVE").values()
    return {a["Address"]["NodeID"] for a in actors if "RayTrainWorker" in a["ActorClassName"]}


def main(root: Path) -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "object_store_memory": 200 * MB,
            # Notice a lost node within seconds.
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4},
        },
    )
    nodes = [
        cluster.add_node(num_cpus=1, resources={"trainer": 2}, object_store_memory=150 * MB)
        for _ in range(2)
    ]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)

    config = _config(root, "multinode", max_failures=2)
    config["data"].update(batch_size=32)
    config["data"]["synthetic"].update(num_train_rows=ROWS, rows_per_file=1024)
    config["training"].update(num_epochs=1, log_every_steps=8)
    config["checkpoint"].update(every_steps=16)
    config["scaling"] = {"num_workers": 2, "resources_per_worker": {"CPU": 0.25, "trainer": 1}}

    out: dict = {}

    def run() -> None:
        try:
            out["result"] = raydlrm.train(config)
        except BaseException as exc:  # reported by the parent
            out["error"] = repr(exc)

    thread = threading.Thread(target=run)
    thread.start()
    run_dir = root / "runs" / "multinode"
    deadline = time.monotonic() + 300
    # The controller writes its snapshot once a checkpoint is registered (complete on all ranks).
    while not (run_dir / "checkpoint_manager_snapshot.json").is_file():
        if not thread.is_alive() or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    before = _worker_nodes()
    victims = [n for n in nodes if n.node_id in before]
    for node in victims:
        cluster.remove_node(node, allow_graceful=False)
    removed_at = time.time()
    thread.join()
    result = out.get("result")
    print(
        json.dumps(
            {
                "error": out.get("error"),
                "metrics": result.metrics if result else None,
                "run_id": result.run_id if result else None,
                "tracking_uri": result.tracking_uri if result else None,
                "removed": [n.node_id for n in victims],
                "removed_at": removed_at,
                "workers_before": sorted(before),
                "finished": result is not None,
                "live_nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
            }
        )
    )
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
