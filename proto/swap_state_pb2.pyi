from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorPlacement(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class SegmentInfo(_message.Message):
    __slots__ = ("path", "size", "header_bytes", "tensors", "chunk_bytes", "cow_slots", "cow_slots_offset", "layout_hash")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    COW_SLOTS_FIELD_NUMBER: _ClassVar[int]
    COW_SLOTS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    header_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorPlacement]
    chunk_bytes: int
    cow_slots: int
    cow_slots_offset: int
    layout_hash: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., header_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorPlacement, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ..., cow_slots: _Optional[int] = ..., cow_slots_offset: _Optional[int] = ..., layout_hash: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "client_pid", "client_host", "local_world_size")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_HOST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    client_pid: int
    client_host: str
    local_world_size: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., client_pid: _Optional[int] = ..., client_host: _Optional[str] = ..., local_world_size: _Optional[int] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("session_id", "generation", "reattached", "has_segment", "segment", "last_committed_step", "has_committed_step", "keepalive_interval_ms", "previous_session")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REATTACHED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SESSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generation: int
    reattached: bool
    has_segment: bool
    segment: SegmentInfo
    last_committed_step: int
    has_committed_step: bool
    keepalive_interval_ms: int
    previous_session: str
    def __init__(self, session_id: _Optional[str] = ..., generation: _Optional[int] = ..., reattached: _Optional[bool] = ..., has_segment: _Optional[bool] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., last_committed_step: _Optional[int] = ..., has_committed_step: _Optional[bool] = ..., keepalive_interval_ms: _Optional[int] = ..., previous_session: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id", "generation")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generation: int
    def __init__(self, session_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class KeepAliveEvent(_message.Message):
    __slots__ = ("server_time_ms", "notice")
    SERVER_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    server_time_ms: int
    notice: str
    def __init__(self, server_time_ms: _Optional[int] = ..., notice: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("session_id", "generation", "tensors")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generation: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, session_id: _Optional[str] = ..., generation: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("segment", "reused")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    segment: SegmentInfo
    reused: bool
    def __init__(self, segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., reused: _Optional[bool] = ...) -> None: ...

class CommitStepRequest(_message.Message):
    __slots__ = ("session_id", "generation", "step")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generation: int
    step: int
    def __init__(self, session_id: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class CommitStepReply(_message.Message):
    __slots__ = ("committed_step",)
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    committed_step: int
    def __init__(self, committed_step: _Optional[int] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session_id", "generation", "keep")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generation: int
    keep: bool
    def __init__(self, session_id: _Optional[str] = ..., generation: _Optional[int] = ..., keep: _Optional[bool] = ...) -> None: ...

class DetachReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("session_id", "job_id", "rank", "world_size", "generation", "state", "segment_bytes", "last_committed_step", "has_committed_step", "steps_committed", "orphaned_seconds", "local_world_size", "copy_slot_bytes", "copy_budget_needed_bytes", "copy_budget_warning", "model_bytes", "adopted")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ORPHANED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    COPY_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_BUDGET_NEEDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_BUDGET_WARNING_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    job_id: str
    rank: int
    world_size: int
    generation: int
    state: str
    segment_bytes: int
    last_committed_step: int
    has_committed_step: bool
    steps_committed: int
    orphaned_seconds: float
    local_world_size: int
    copy_slot_bytes: int
    copy_budget_needed_bytes: int
    copy_budget_warning: str
    model_bytes: int
    adopted: bool
    def __init__(self, session_id: _Optional[str] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., generation: _Optional[int] = ..., state: _Optional[str] = ..., segment_bytes: _Optional[int] = ..., last_committed_step: _Optional[int] = ..., has_committed_step: _Optional[bool] = ..., steps_committed: _Optional[int] = ..., orphaned_seconds: _Optional[float] = ..., local_world_size: _Optional[int] = ..., copy_slot_bytes: _Optional[int] = ..., copy_budget_needed_bytes: _Optional[int] = ..., copy_budget_warning: _Optional[str] = ..., model_bytes: _Optional[int] = ..., adopted: _Optional[bool] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("budget_total_bytes", "budget_used_bytes", "budget_free_bytes", "sessions", "steps_committed_total", "snapshots_in_progress", "persist_bytes_per_second", "persist_bandwidth_measured", "assumed_fwd_bwd_seconds", "stage_threads", "cow_pool_bytes", "cow_pool_used_bytes", "sessions_adopted_total", "reconnects_total")
    BUDGET_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMMITTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PERSIST_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PERSIST_BANDWIDTH_MEASURED_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FWD_BWD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGE_THREADS_FIELD_NUMBER: _ClassVar[int]
    COW_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    COW_POOL_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ADOPTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECONNECTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    budget_total_bytes: int
    budget_used_bytes: int
    budget_free_bytes: int
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStats]
    steps_committed_total: int
    snapshots_in_progress: _containers.RepeatedCompositeFieldContainer[SnapshotStatusReply]
    persist_bytes_per_second: float
    persist_bandwidth_measured: bool
    assumed_fwd_bwd_seconds: float
    stage_threads: int
    cow_pool_bytes: int
    cow_pool_used_bytes: int
    sessions_adopted_total: int
    reconnects_total: int
    def __init__(self, budget_total_bytes: _Optional[int] = ..., budget_used_bytes: _Optional[int] = ..., budget_free_bytes: _Optional[int] = ..., sessions: _Optional[_Iterable[_Union[SessionStats, _Mapping]]] = ..., steps_committed_total: _Optional[int] = ..., snapshots_in_progress: _Optional[_Iterable[_Union[SnapshotStatusReply, _Mapping]]] = ..., persist_bytes_per_second: _Optional[float] = ..., persist_bandwidth_measured: _Optional[bool] = ..., assumed_fwd_bwd_seconds: _Optional[float] = ..., stage_threads: _Optional[int] = ..., cow_pool_bytes: _Optional[int] = ..., cow_pool_used_bytes: _Optional[int] = ..., sessions_adopted_total: _Optional[int] = ..., reconnects_total: _Optional[int] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("session_id", "generation", "step", "keep_latest", "keep_all", "replace_existing", "metadata_base_id", "metadata_base_json", "metadata_delta_json", "memory_only")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KEEP_LATEST_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALL_FIELD_NUMBER: _ClassVar[int]
    REPLACE_EXISTING_FIELD_NUMBER: _ClassVar[int]
    METADATA_BASE_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_BASE_JSON_FIELD_NUMBER: _ClassVar[int]
    METADATA_DELTA_JSON_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generation: int
    step: int
    keep_latest: int
    keep_all: bool
    replace_existing: bool
    metadata_base_id: str
    metadata_base_json: str
    metadata_delta_json: str
    memory_only: bool
    def __init__(self, session_id: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., keep_latest: _Optional[int] = ..., keep_all: _Optional[bool] = ..., replace_existing: _Optional[bool] = ..., metadata_base_id: _Optional[str] = ..., metadata_base_json: _Optional[str] = ..., metadata_delta_json: _Optional[str] = ..., memory_only: _Optional[bool] = ...) -> None: ...

class SnapshotReply(_message.Message):
    __slots__ = ("snapshot_id", "consistent")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    CONSISTENT_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    consistent: bool
    def __init__(self, snapshot_id: _Optional[str] = ..., consistent: _Optional[bool] = ...) -> None: ...

class SnapshotStatusRequest(_message.Message):
    __slots__ = ("snapshot_id", "rank", "wait_seconds", "wait_stored", "wait_replicated")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_STORED_FIELD_NUMBER: _ClassVar[int]
    WAIT_REPLICATED_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    rank: int
    wait_seconds: float
    wait_stored: bool
    wait_replicated: bool
    def __init__(self, snapshot_id: _Optional[str] = ..., rank: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., wait_stored: _Optional[bool] = ..., wait_replicated: _Optional[bool] = ...) -> None: ...

class SnapshotStatusReply(_message.Message):
    __slots__ = ("snapshot_id", "rank", "state", "bytes_total", "bytes_persisted", "error", "cow_copies", "backpressure_waits", "backpressure_wait_seconds", "path", "step", "server_staged_chunks", "server_staged_bytes", "trainer_copied_bytes", "store_state", "store_error", "store_path", "bytes_stored", "replica_state", "replica_peer", "replica_error")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_PERSISTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COW_COPIES_FIELD_NUMBER: _ClassVar[int]
    BACKPRESSURE_WAITS_FIELD_NUMBER: _ClassVar[int]
    BACKPRESSURE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SERVER_STAGED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SERVER_STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_COPIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_STATE_FIELD_NUMBER: _ClassVar[int]
    STORE_ERROR_FIELD_NUMBER: _ClassVar[int]
    STORE_PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STATE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PEER_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ERROR_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    rank: int
    state: str
    bytes_total: int
    bytes_persisted: int
    error: str
    cow_copies: int
    backpressure_waits: int
    backpressure_wait_seconds: float
    path: str
    step: int
    server_staged_chunks: int
    server_staged_bytes: int
    trainer_copied_bytes: int
    store_state: str
    store_error: str
    store_path: str
    bytes_stored: int
    replica_state: str
    replica_peer: str
    replica_error: str
    def __init__(self, snapshot_id: _Optional[str] = ..., rank: _Optional[int] = ..., state: _Optional[str] = ..., bytes_total: _Optional[int] = ..., bytes_persisted: _Optional[int] = ..., error: _Optional[str] = ..., cow_copies: _Optional[int] = ..., backpressure_waits: _Optional[int] = ..., backpressure_wait_seconds: _Optional[float] = ..., path: _Optional[str] = ..., step: _Optional[int] = ..., server_staged_chunks: _Optional[int] = ..., server_staged_bytes: _Optional[int] = ..., trainer_copied_bytes: _Optional[int] = ..., store_state: _Optional[str] = ..., store_error: _Optional[str] = ..., store_path: _Optional[str] = ..., bytes_stored: _Optional[int] = ..., replica_state: _Optional[str] = ..., replica_peer: _Optional[str] = ..., replica_error: _Optional[str] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("snapshot_id", "job_id", "step", "world_size", "path", "bytes", "latest", "ranks", "local_world_size", "local", "stored", "store_path", "replica_state", "replica_peer")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    STORE_PATH_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STATE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PEER_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    job_id: str
    step: int
    world_size: int
    path: str
    bytes: int
    latest: bool
    ranks: _containers.RepeatedScalarFieldContainer[int]
    local_world_size: int
    local: bool
    stored: bool
    store_path: str
    replica_state: str
    replica_peer: str
    def __init__(self, snapshot_id: _Optional[str] = ..., job_id: _Optional[str] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., latest: _Optional[bool] = ..., ranks: _Optional[_Iterable[int]] = ..., local_world_size: _Optional[int] = ..., local: _Optional[bool] = ..., stored: _Optional[bool] = ..., store_path: _Optional[str] = ..., replica_state: _Optional[str] = ..., replica_peer: _Optional[str] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListSnapshotsReply(_message.Message):
    __slots__ = ("snapshots", "store_error")
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    STORE_ERROR_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    store_error: str
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ..., store_error: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("session_id", "generation", "snapshot_id", "metadata_json")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generation: int
    snapshot_id: str
    metadata_json: str
    def __init__(self, session_id: _Optional[str] = ..., generation: _Optional[int] = ..., snapshot_id: _Optional[str] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class RestoreReply(_message.Message):
    __slots__ = ("snapshot_id", "step", "metadata_json", "source", "snapshot_world_size", "source_ranks")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANKS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    step: int
    metadata_json: str
    source: str
    snapshot_world_size: int
    source_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, snapshot_id: _Optional[str] = ..., step: _Optional[int] = ..., metadata_json: _Optional[str] = ..., source: _Optional[str] = ..., snapshot_world_size: _Optional[int] = ..., source_ranks: _Optional[_Iterable[int]] = ...) -> None: ...
