"""A cluster of ``kafka.brokers`` nodes: ports, names, bootstrap list, replication; the
one-broker defaults unchanged (no broker needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.infra.kafka import CLUSTER_SIZE, kafka_nodes
from loraplane.infra.processes import StackError
from loraplane.kernel import topics
from loraplane.kernel.config import KafkaSettings, Settings


def _cluster(home: Path, brokers: int) -> Settings:
    return Settings(
        home=home, kafka=KafkaSettings(port=30092, controller_port=30093, brokers=brokers)
    )


def test_one_broker_keeps_its_names_ports_and_heap(tmp_path: Path) -> None:
    settings = _cluster(tmp_path, 1)
    [node] = kafka_nodes(settings)
    assert settings.kafka.bootstrap == "127.0.0.1:30092"
    assert (node.label, node.dir, node.endpoint()) == (
        "kafka",
        tmp_path / "kafka",
        "127.0.0.1:30092",
    )
    assert node.process.pid_file == tmp_path / "run" / "kafka.pid"
    assert settings.kafka.heap_per_broker == "768m"
    assert topics.replicas(settings) == 1


def test_three_nodes_take_every_second_port_and_own_files(tmp_path: Path) -> None:
    settings = _cluster(tmp_path, 3)
    nodes = kafka_nodes(settings)
    assert [n.label for n in nodes] == ["kafka", "kafka-2", "kafka-3"]
    assert [[p.number for p in n.ports()] for n in nodes] == [
        [30092, 30093],
        [30094, 30095],
        [30096, 30097],
    ]
    assert len({n.dir for n in nodes}) == len({n.process.pid_file for n in nodes}) == 3
    assert len({n.marker() for n in nodes}) == 3
    assert [n.last for n in nodes] == [False, False, True]
    assert settings.kafka.heap_per_broker == "384m"


def test_three_brokers_replicate_three_times_and_need_two_in_sync(tmp_path: Path) -> None:
    settings = _cluster(tmp_path, 3)
    assert topics.replicas(settings) == 3 and topics.min_insync(3) == 2
    assert topics.replicas(_cluster(tmp_path, 5)) == 3
    assert topics.spec("requests").configs(3)["min.insync.replicas"] == "2"
    assert "min.insync.replicas" not in topics.spec("requests").configs()
    [create] = topics.diff("lp.requests", topics.spec("requests"), None, 3)
    assert "3 replicas" in create.detail and "min.insync.replicas=2" in create.detail


def test_data_formatted_for_another_cluster_size_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "kafka" / "data"
    data.mkdir(parents=True)
    (data / "meta.properties").write_text("cluster.id=x\nnode.id=1\n")
    (tmp_path / "kafka" / CLUSTER_SIZE).write_text("3\n")
    one = _cluster(tmp_path, 1)
    assert len(kafka_nodes(one)) == 3  # stack down and status still see every node
    with pytest.raises(StackError, match=r"formatted for 3 broker.*LORAPLANE_KAFKA__BROKERS=3"):
        kafka_nodes(one)[0].prepare()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("left", [b"", b"three\n", b"-2\n", b"folder", b"fifo"])
def test_a_cluster_size_record_cut_short_or_replaced_is_a_clear_error(
    tmp_path: Path, left: bytes
) -> None:
    """A kill -9 of `stack up` while it wrote the record (open, then write) left it empty.
    Before, `stack up`, `status` and `down` died of ValueError (a folder: IsADirectoryError;
    a FIFO: a hang)."""
    import os

    data = tmp_path / "kafka" / "data"
    data.mkdir(parents=True)
    (data / "meta.properties").write_text("cluster.id=x\nnode.id=1\n")
    record = tmp_path / "kafka" / CLUSTER_SIZE
    if left == b"folder":
        record.mkdir()
    elif left == b"fifo":
        os.mkfifo(record)
    else:
        record.write_bytes(left)
    with pytest.raises(StackError, match=CLUSTER_SIZE):
        kafka_nodes(_cluster(tmp_path, 1))
