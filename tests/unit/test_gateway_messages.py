"""What a client is told of vLLM's failure (``workers.gateway.client_message``): a property
over vLLM's words around internal names and paths."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loraplane.schemas.reasons import VllmErrorCode
from loraplane.workers.gateway import client_message
from loraplane.workers.vllm_client import VllmError
from tests.unit.test_gateway import _INTERNAL, RECORDS


@given(
    parts=st.lists(
        st.one_of(
            st.text(max_size=12),
            st.sampled_from([RECORDS[2].lora_name, _INTERNAL, "/home/w/host/sql@1-73716c31/"]),
        ),
        max_size=8,
    ),
    reason=st.sampled_from(list(VllmErrorCode)),
)
def test_a_client_message_never_names_a_lora_or_a_path(
    parts: list[str], reason: VllmErrorCode
) -> None:
    """Whatever vLLM's words hold around them, the client's message never carries the
    lora name, the base model's path or a host-tier path; only a 400's words pass at all."""
    error = VllmError(reason, " ".join(parts), 400)
    names = {RECORDS[2].lora_name: "sql", _INTERNAL: "sql"}
    message = client_message(error, names)
    for secret in (RECORDS[2].lora_name, _INTERNAL, "/home/w/host"):
        assert secret not in message
    if reason != VllmErrorCode.bad_request:
        assert message == f"the model server failed on this request ({reason.failure})"
