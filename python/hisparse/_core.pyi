"""Typed stubs of the Rust extension ``hisparse._core``.

Integer arguments must be integers (``int`` or anything with ``__index__``; never ``bool`` or ``float``) in the
range the core takes: sizes, lengths, token counts 0..2**32, request and transfer ids 0..2**64, page hashes
-2**63..2**64. Anything else raises :class:`hisparse.InvalidArgumentError` naming the argument. Every call that
can refuse checks everything first: when it raises, nothing changed.

Threads: one :class:`ResidencyManager` may be shared. Calls run with the GIL released and are serialized by a
lock inside (taken after the GIL is released, so waiting never blocks other Python threads); a read such as
``stats()`` beside a serving loop waits for the current call and never fails.
"""

from collections.abc import Container, Iterable, Sequence
from typing import Any, Literal, SupportsIndex, TypeVar, final

Residency = Literal["full", "mixed", "none"]
Policy = Literal["coldest", "fifo", "resident"]
Buf = tuple[int, int]
Int = int | SupportsIndex
_T = TypeVar("_T")

__version__: str

@final
class Admission:
    """What ``admit`` and ``resume`` return; made by the core only."""

    @property
    def row(self) -> int:
        """The request's state row on the worker."""
    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV the request already has (host prefix hits, or its kept pages); compute the rest."""
    @property
    def residency(self) -> Residency: ...
    @property
    def restored_pages(self) -> int:
        """Pages this admission queued restores (host -> GPU) for, carried by the next plan; the request runs once
        they have landed. Adopted GPU copies are not counted."""

@final
class StepPlan:
    """One step's work for the worker, applied in this order before the forward: cleared rows; the rows'
    requests, lengths, table entries and hot regions; restores (host -> GPU); page copies (GPU -> host).

    A frozen value. It pickles as its flat encoding (``to_bytes``), the form a worker applies in one call; the
    list views below are built on access."""

    @property
    def ok(self) -> bool:
        """False for a short plan: it changed nothing and must not be applied."""
    @property
    def missing_blocks(self) -> int: ...
    @property
    def cleared_rows(self) -> list[int]: ...
    @property
    def seq_lens(self) -> list[tuple[int, int, int]]:
        """(row, seq_len, request_id): a row's length after the step and the request it serves."""
    @property
    def resident_rows(self) -> list[tuple[int, bool]]:
        """(row, resident) of every length entry, in order: whether every page of the row's request is resident."""
    @property
    def table_updates(self) -> list[tuple[int, int, int, int, bool]]:
        """(row, page, gpu_block or 0, host_block or -1, releasable)"""
    @property
    def hot_updates(self) -> list[tuple[int, list[int]]]:
        """(row, blocks); no blocks: the row holds no hot region any more."""
    @property
    def restores(self) -> list[tuple[int, int]]:
        """(gpu_block, host_block) to copy host -> GPU before the forward."""
    @property
    def materialize(self) -> list[tuple[int, int, int]]:
        """(transfer_id, gpu_block, host_block) to copy GPU -> host; report each through ``apply_results``."""
    @property
    def transfer_ids(self) -> list[int]: ...
    @property
    def scheduled(self) -> list[tuple[int, int, int, int]]:
        """(request_id, row, start, new_tokens) per scheduled request, in the order given to ``plan_step``."""
    @property
    def num_scheduled(self) -> int: ...
    @property
    def num_tokens(self) -> int:
        """How many tokens the scheduled requests write in all."""
    @property
    def rows(self) -> list[int]:
        """The state row of each scheduled request, in order."""
    @property
    def transitions(self) -> list[tuple[int, Residency, Residency]]: ...
    @property
    def num_transitions(self) -> int: ...
    @property
    def released_pages(self) -> int: ...
    @property
    def lost_pages(self) -> int: ...
    def to_bytes(self) -> bytes:
        """The flat encoding (``cuda/SPEC.md``, "apply")."""
    @classmethod
    def from_bytes(cls, data: bytes | bytearray) -> StepPlan:
        """Reads ``to_bytes`` back; refuses anything it did not write."""

@final
class ResidencyManager:
    """The scheduler-side residency manager: admission, step plans, the pressure policy, the worker's feedback.

    Safe to share between threads (see the module docstring)."""

    def __init__(
        self,
        *,
        num_gpu_blocks: Int,
        max_model_len: Int,
        block_size: Int | None = 64,
        num_host_blocks: Int | None = None,
        host_pool_gib: float | None = None,
        page_bytes: Int | None = 0,
        max_running: Int | None = 256,
        top_k: Int | None = 2048,
        hot_rows: Int | None = None,
        speculative_tokens: Int | None = 0,
        num_index_groups: Int | None = 1,
        tail_pages: Int | None = 2,
        watermark: Int | None = None,
        policy: Policy | None = "coldest",
        materialize_budget: Int | None = 256,
        admission_pages: Int | None = 0,
    ) -> None:
        """Give exactly one of ``num_host_blocks`` and ``host_pool_gib`` (with ``page_bytes``). ``hot_rows``
        defaults to 2 x top_k, or (q + 1) x top_k with q speculative tokens; ``watermark`` to one hot region or a
        tenth of the pool; ``admission_pages`` (the resident pages admission reserves for a request) to none: a
        request that never fills it comes back from the host restored whole when its blocks are free. Raises
        ``ConfigError`` saying what to change."""
    def admit(
        self, request_id: Int, prompt_len: Int, prefix_hashes: Sequence[Int] | None = None, max_len: Int | None = None
    ) -> Admission:
        """Admits a request whose full prompt pages hash to ``prefix_hashes`` (a chain); pages durable on the host
        are not computed again. ``CapacityError`` (``.resource``) when it cannot be backed now."""
    def resume(self, request_id: Int) -> Admission:
        """Brings a preempted request back from its kept host pages."""
    def plan_step(self, scheduled: Sequence[tuple[Int, Int]]) -> StepPlan:
        """Plans one step: (request_id, new_tokens) pairs. A short plan (``ok`` False) changed nothing."""
    def resync(self, redo_last_step: bool) -> StepPlan:
        """The plan that brings a rebuilt worker to the current state (every row set again, copies in flight
        failed and started again under new ids); ``redo_last_step``: the last plan's restores and scheduled
        tokens again (its results never came back)."""
    def complete(self, transfer_ids: Sequence[Int], ok: bool | None = True) -> None:
        """Ends copies to the host (``ok`` False: failed, copied again later)."""
    def apply_results(
        self,
        completed: Sequence[Int] | None = None,
        failed: Sequence[Int] | None = None,
        heat: bytes | bytearray | None = None,
    ) -> None:
        """One worker report, atomically: copies that ended or failed, and an encoded heat summary
        (``DataPath.heat_summary``). Heat of requests that left meanwhile is skipped."""
    def add_page_hashes(self, request_id: Int, hashes: Sequence[Int]) -> None:
        """Page hashes continuing the admission chain (e.g. for generated tokens), published once durable."""
    def finish(self, request_id: Int) -> None: ...
    def preempt(self, request_id: Int) -> int:
        """Stops a request; returns the tokens kept on the host."""
    def check_invariants(self) -> None:
        """Recomputes every invariant; ``InvariantError`` names the first broken one."""
    def __contains__(self, request_id: object, /) -> bool: ...
    def request_ids(self) -> list[int]: ...
    def request_info(self, request_id: Int) -> dict[str, int | str | None]:
        """``row`` (None when preempted), ``seq_len``, ``residency``, ``num_pages``, ``host_only_pages``,
        ``released_pages``, ``hot_blocks``."""
    def block_table(self, request_id: Int) -> list[tuple[int, int]]:
        """(gpu_block or 0, host_block or -1) per page."""
    def page_states(self, request_id: Int) -> list[str]: ...
    def hot_blocks(self, request_id: Int) -> list[int]: ...
    def stats(self) -> dict[str, int]: ...
    def capacity_log(self) -> str: ...
    def steady_state_concurrency(self) -> int: ...
    def config(self) -> dict[str, int | str]: ...

def steady_state_blocks(*, seq_len: Int, block_size: Int, hot_rows: Int, tail_pages: Int, groups: Int) -> int: ...
def kernel_sources() -> list[tuple[str, str]]: ...
def decode_heat_summary(
    data: bytes | bytearray,
) -> list[tuple[int, list[tuple[int, int]], list[tuple[int, int]]]]:
    """(request_id, coldest [(heat, page), ...], hottest [...]) per request of an encoded heat summary, each part
    in ascending (heat, page) order."""

# The CPU reference over raw (address, length) buffers; ``hisparse.datapath`` checks every tensor first.
def _ref_resolve(
    geometry: tuple[int, int, int, int, int],
    state: Sequence[Buf],
    topk: Buf,
    top_k: int,
    row_state: Buf,
    resident: Buf,
    group: int,
    gpu_layers: Sequence[Buf],
    host_layers: Sequence[Buf],
    out: Buf,
) -> None: ...
def _ref_gather(row_ids: Buf, slab: Buf, row_bytes: int, out: Buf) -> None: ...
def _ref_copy(
    pairs: Buf, unit: int, row_bytes: int, to_host: bool, gpu_layers: Sequence[Buf], host_layers: Sequence[Buf]
) -> None: ...
def _ref_invalidate(geometry: tuple[int, int, int, int, int], hot_pos: Buf, hot_stamp: Buf, pairs: Buf) -> None: ...
@final
class ApplyBuffers:
    """The checked buffers ``_ref_apply`` writes, kept across steps by ``DataPath``."""

    def __init__(
        self,
        geometry: tuple[int, int, int, int, int],
        state: Sequence[Buf],
        gpu: Sequence[Buf],
        host: Sequence[Buf],
    ) -> None: ...

def _ref_apply(plan: StepPlan, buffers: ApplyBuffers) -> bytearray | None: ...
def _ref_slot_mapping(plan: StepPlan, block_table: Buf, pages: int, block_size: int) -> bytearray: ...
def _ref_heat_summary(tables: Sequence[Buf], pages: int, block_size: int, coldest: int, hottest: int) -> bytes: ...
def _encode_heat_summary(bufs: Sequence[Buf], pages: int, coldest: int, hottest: int) -> bytes: ...
def _check_plan(
    plan: StepPlan, geometry: tuple[int, int, int, int, int], rows: int, gpu_blocks: int, host_blocks: int
) -> None: ...

@final
class PoolPolicy:
    """Release and reuse order over a block pool that another engine (vLLM) owns; see ``pool_policy.rs``."""

    def __init__(
        self,
        *,
        block_size: int = 0,
        blocks_per_page: int = 0,
        hot_blocks: int = 0,
        admission_pages: int = 0,
        tail_pages: int = 0,
        low_watermark: int = 0,
    ) -> None: ...
    def report(self, summary: bytes | bytearray, request_ids: Sequence[str]) -> None: ...
    def release_order(self, request: str, pages: Sequence[int]) -> list[int]: ...
    def forget(self, request: str) -> None: ...
    def __len__(self) -> int: ...
    def worth_transition(self, releasable_pages: int) -> bool: ...
    def transition(
        self,
        fills_window: bool,
        free_blocks: int,
        row_pages: int,
        released_pages: int,
        step_end: int,
        tokens_left: int,
        chunk_tokens: int,
        longest_tokens: int | None,
    ) -> Literal["stay", "declined", "postponed", "take"]: ...
    def never_takes_hot_region(self, longest_tokens: int) -> bool: ...
    def admitting(self) -> bool: ...
    def admit(
        self,
        tokens: int,
        computed_tokens: int,
        chunk_tokens: int,
        longest_tokens: int | None,
        *,
        free_blocks: int,
        running: int,
        reading_host: int,
        owed_hot_blocks: int,
        may_take_hot: bool,
    ) -> bool: ...
    def end_pass(self) -> None: ...

def unpack_row_mirrors(
    cls: type[_T],
    ids: list[str],
    counts: bytes,
    sources: bytes,
    destinations: bytes,
    rows: bytes,
    groups: int,
) -> dict[str, tuple[_T, ...]]: ...

@final
class BlockRows:
    """vLLM's per-request block rows (each resident group's, residency changes applied, and the host's), recorded
    as vLLM changes them, and the scans its scheduler runs over them every step; see ``block_rows.rs``. A
    ``group`` of ``None`` names the host row; a block id of ``None`` is a page read from the host."""

    def __init__(self, groups: int, block_size: int) -> None: ...
    def set(self, request: str, group: int | None, ids: Sequence[int | None]) -> None: ...
    def extend(self, request: str, group: int | None, ids: Sequence[int | None]) -> None: ...
    def set_page(self, request: str, group: int | None, page: int, id: int | None) -> None: ...
    def grow(self, request: str, new_blocks: Sequence[Sequence[Any]], groups: Sequence[tuple[int, Any, int | None]]
             ) -> list[tuple[Any, int | None]]: ...
    def drop_page(self, request: str, page: int) -> None: ...
    def clear(self, request: str, group: int | None) -> None: ...
    def clear_all(self) -> None: ...
    def row(self, request: str, group: int | None) -> list[int | None]: ...
    def row_len(self, request: str, group: int | None) -> int: ...
    def quiet(self, request: str, tokens: int) -> None: ...
    def wake(self, request: str) -> None: ...
    @property
    def changes(self) -> int: ...
    def scan(
        self,
        scheduled: dict[str, int],
        computed: dict[str, int],
        lookahead: int = 0,
        back: dict[str, int] | None = None,
    ) -> tuple[tuple[list[str], bytes, bytes, bytes, bytes], bool, list[str]]: ...
    def __len__(self) -> int: ...

@final
class PageBook:
    """vLLM's HiSparse page lifecycle, kept in the core (see ``page_book.rs``): pages being copied to the host,
    clean, held and released, the transfers in flight, the owners of released blocks and the index of GPU
    copies. It reads and changes ``rows`` (the coordinator's ``BlockRows``) and makes its effects on vLLM's
    objects: ``gpu_pool`` and ``host_pool`` directly, the rest through ``coordinator``'s ``_can_read_from_host``
    (asked for a request not in ``reads_host``), ``_on_block_reused`` (the callback it releases pages with),
    ``_release_order``, ``_without_region``, ``_engine_publish``, ``_engine_detach`` and
    ``_engine_publish_detached``. A publication's payload is vLLM's ``_PendingPublication``."""

    def __init__(self, rows: BlockRows, coordinator: Any, reads_host: set[str], gpu_pool: Any, host_pool: Any,
                 resident_managers: Sequence[Any], hot_managers: Sequence[Any], block_size: int,
                 max_planned: int) -> None: ...
    def commit_computed(self, request: str, pages: int) -> None: ...
    def record_import(self, request: str, tokens: int) -> None: ...
    def take_import(self, request: str) -> int | None: ...
    def imports(self) -> dict[str, int]: ...
    def complete_import(self, request: str, tokens: int) -> None: ...
    def plan(self, request: str, page: int, after_forward: bool, restore: bool) -> bool: ...
    def advance(self, steps: Iterable[tuple[str, int]], reprefill: int) -> int: ...
    def take_planned(self) -> list[tuple[int, int, tuple[int, ...], bool, bool]]: ...
    @property
    def planned(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def next_transfer(self) -> int: ...
    def transfers(self) -> list[tuple[int, str, int, int, tuple[int, ...], bool, bool, bool]]: ...
    def update_transfers(self, enqueued: dict[int, int], completed: dict[int, int]) -> None: ...
    def set_publication(self, request: str, payload: Any | None, tokens: int | None = None) -> None: ...
    def publication_facts(self, request: str) -> tuple[int, int] | None: ...
    def publish_if_ready(self, request: str) -> None: ...
    def adopt(self, request: str, done: bool) -> int: ...
    def releasable(self, request: str) -> list[int]: ...
    def unpin(self, request: str, pages: Sequence[int]) -> int: ...
    def block_reused(self, block: Any) -> None: ...
    def residency_updates(self, requests: Iterable[str], null: int
                          ) -> list[tuple[str, list[int], tuple[list[int], ...]]]: ...
    def with_work(self, requests: Iterable[tuple[str, int]], reprefill: int) -> list[tuple[str, int]]: ...
    def quiet_below(self, request: str, reads_host: bool, reprefill: int) -> int: ...
    def settle(self, requests: Iterable[str], reads_host: Container[str], reprefill: int) -> None: ...
    def free(self, request: str) -> None: ...
    def forget_all(self) -> None: ...
    def detached(self) -> list[tuple[str, Any]]: ...
    def knows(self, request: str) -> bool: ...
    def pages(self, request: str) -> dict[str, Any] | None: ...
    def requests(self) -> list[str]: ...
    def owners(self) -> dict[int, list[tuple[str, int]]]: ...
    def copies(self) -> dict[bytes, tuple[int, ...]]: ...
    def copy_keys(self) -> dict[int, bytes]: ...
    def __len__(self) -> int: ...

@final
class PublishGate:
    """The check vLLM's per-request publication call lands on (``Bookkeeping.bind``): ``cache_blocks`` returns at
    once when the request is marked with ``num_tokens // page_tokens`` pages, and otherwise calls
    ``owner.publish_when_ready`` with its arguments; see ``publish_gate.rs``."""

    def __init__(self, page_tokens: int, owner: Any) -> None: ...
    def cache_blocks(self, request: Any, num_tokens: int, retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int]) -> None: ...
    def mark(self, request_id: str, pages: int) -> None: ...
    def unmark(self, request_id: str) -> None: ...
    def unmark_all(self) -> None: ...
    def end_pass(self) -> None: ...
    def marked(self, request_id: str) -> int | None: ...
    def __len__(self) -> int: ...
