"""KRaft cluster ids the storage tool accepts (one in 64 random ids starts with "-")."""

from __future__ import annotations

import base64

from loraplane.infra.kafka import new_cluster_id


def test_cluster_ids_are_16_byte_uuids_that_never_look_like_an_option() -> None:
    ids = {new_cluster_id() for _ in range(3000)}
    assert len(ids) == 3000
    assert not any(i.startswith("-") for i in ids)
    assert {len(base64.urlsafe_b64decode(i + "==")) for i in ids} == {16}
