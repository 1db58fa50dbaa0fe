"""AttachRequest.local_world_size: the job's ranks on this server (one server per host)."""

from __future__ import annotations

import grpc
import pytest

from swap_state.proto import swap_state_pb2 as pb
from swap_state.common.errors import InvalidRequestError
from swap_state.server.rpc.validation import validate_local_world_size


def test_zero_means_world_size_and_the_range_is_one_to_world_size():
    assert validate_local_world_size(0, 16) == 16  # clients without the field
    assert validate_local_world_size(1, 16) == 1
    assert validate_local_world_size(8, 16) == 8
    assert validate_local_world_size(16, 16) == 16
    with pytest.raises(InvalidRequestError, match=r"local_world_size 17 must be in \[1, world_size 16\]"):
        validate_local_world_size(17, 16)


def _attach(stub, rank=0, world_size=4, local_world_size=0, job_id="mh"):
    request = pb.AttachRequest(
        job_id=job_id, rank=rank, world_size=world_size, local_world_size=local_world_size,
        client_host="test",
    )
    return stub.Attach(request, timeout=10)


async def test_local_world_size_above_world_size_is_invalid_argument(stub):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _attach(stub, rank=2, world_size=4, local_world_size=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "local_world_size 5" in caught.value.details()
    # Nothing was attached.
    assert list((await stub.Stats(pb.StatsRequest(), timeout=10)).sessions) == []


async def test_stats_report_it_and_zero_reports_world_size(stub):
    await _attach(stub, rank=2, world_size=4, local_world_size=2)
    await _attach(stub, rank=0, world_size=4, job_id="single-host")  # an old client: field unset
    sessions = {s.job_id: s for s in (await stub.Stats(pb.StatsRequest(), timeout=10)).sessions}
    assert (sessions["mh"].world_size, sessions["mh"].local_world_size) == (4, 2)
    assert (sessions["single-host"].world_size, sessions["single-host"].local_world_size) == (4, 4)


async def test_reattach_with_another_local_world_size_is_a_new_session(stub):
    first = await _attach(stub, rank=3, world_size=4, local_world_size=2)
    again = await _attach(stub, rank=3, world_size=4, local_world_size=2)  # not live: reattach
    assert again.reattached and again.session_id == first.session_id
    other = await _attach(stub, rank=3, world_size=4, local_world_size=4)  # like a new world size
    assert not other.reattached and other.session_id != first.session_id
    [session] = (await stub.Stats(pb.StatsRequest(), timeout=10)).sessions
    assert (session.session_id, session.local_world_size) == (other.session_id, 4)
