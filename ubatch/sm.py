"""SM partitioning between ubatch compute and communication.

Why: by default persistent GEMMs take every SM and the collectives queue behind them, so overlap
hides almost nothing (docs/sm-partition.md). ``SMPartition`` is the policy the
scheduler and wrapper consult for streams, communicators and GEMM launches. Modes:

- ``"green"``: compute streams on a green context of ``total - comm_sms`` SMs and the comm stream
  on a disjoint one of ``comm_sms`` SMs; GEMMs launched under ``compute_context()`` size their
  grids to the compute partition (see ``carveout_for``).
  ``torch.cuda.green_contexts.GreenContext.create()`` carves every context from the whole
  device (two of them overlap and serialise), so the device's SM resource is split through
  ``cuda.bindings.driver`` (``cuDevSmResourceSplitByCount`` returns disjoint groups) and the
  driver's streams are wrapped in ``torch.cuda.ExternalStream``. Every
  stream handed out holds a reference to the object that owns its green context, so a context
  lives exactly as long as its last stream (a stream outliving its context fails with "context is
  destroyed").
- ``"cooperative"``: ordinary streams; collectives go through a dedicated NCCL communicator whose
  CTAs are capped (``ProcessGroupNCCL.Options().config.max_ctas``), and GEMMs launched under
  ``compute_context()`` leave SMs free through cuBLAS's SM carveout.
- ``"none"``: ordinary streams, the original group, no carveout.

A mode that cannot work here (CPU, no CUDA, no ``cuda.bindings``, compute capability < 9.0, a
driver older than CUDA 12.4, NCCL missing, or any CUresult error) degrades to ``"none"``, logs one
WARNING with the reason and keeps it in ``reason``. Per-phase SM counts (``prefill_comm_sms``,
``decode_comm_sms``) select a partition with ``phase=`` on every method.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ubatch.streams import ubatch_streams

logger = logging.getLogger(__name__)

MODES = ("none", "green", "cooperative")
PHASES = ("prefill", "decode")
# The 116/16 split that hid 94% of an SM copy kernel beside a GEMM loop on two H200s
# (benchmarks/h200x2/sm_h200x2.json, docs/sm-partition.md).
DEFAULT_COMM_SMS = 16
# NCCL clamps maxCTAs to MAXCHANNELS (32 or 64 depending on the release); 32 is valid in all.
NCCL_MAX_CTAS_LIMIT = 32
# Green contexts need CUDA 12.4 (driver API) and, for this project, Hopper or newer.
MIN_DRIVER_VERSION = 12040
MIN_CAPABILITY = (9, 0)
P2P_CHANNELS_ENV = "NCCL_MAX_P2P_NCHANNELS"


class GreenContextError(RuntimeError):
    """A driver call of the green-context path failed; the partition degrades to "none"."""


def _load_driver() -> Any:
    """``cuda.bindings.driver``, imported only when a green partition is wanted."""
    return importlib.import_module("cuda.bindings.driver")


def _checked(driver: Any, result: Any, what: str) -> Any:
    """Unpack a cuda-bindings ``(CUresult, *outputs)`` tuple, raising on any error code."""
    err, *outputs = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        name = getattr(err, "name", str(err))
        raise GreenContextError(f"{what} failed with {name}")
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def round_comm_sms(requested: int, min_partition: int, alignment: int) -> int:
    """The smallest SM count >= ``requested`` that the driver can split off (Hopper: e.g. 8 / 2)."""
    alignment = max(1, int(alignment))
    rounded = -(-requested // alignment) * alignment
    return max(rounded, int(min_partition))


class _GreenContexts:
    """Owns one disjoint (compute, comm) pair of green contexts and every stream made on them.

    Streams are destroyed before their contexts, and only when the last ExternalStream wrapping
    one of them is gone (each holds a reference to this object).
    """

    def __init__(self, driver: Any, device_index: int, comm_sms: int) -> None:
        self._driver = driver
        self._device_index = device_index
        self._contexts: list[Any] = []
        self._streams: list[Any] = []
        self._beside: dict[int, torch.cuda.Stream] = {}
        _checked(driver, driver.cuInit(0), "cuInit")
        dev = _checked(driver, driver.cuDeviceGet(device_index), "cuDeviceGet")
        sm_type = driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
        resource = _checked(driver, driver.cuDeviceGetDevResource(dev, sm_type), "cuDeviceGetDevResource")
        self.total_sms = int(resource.sm.smCount)
        # Granularity fields came with CUDA 13 bindings; older ones leave the rounding to the driver.
        granularity = (getattr(resource.sm, "minSmPartitionSize", 0), getattr(resource.sm, "smCoscheduledAlignment", 0))
        want = round_comm_sms(comm_sms, *granularity)
        if want >= self.total_sms:
            raise GreenContextError(
                f"comm_sms={comm_sms} rounds to {want}, leaving no SM of {self.total_sms} for compute"
            )
        groups, count, remainder = _checked(
            driver, driver.cuDevSmResourceSplitByCount(1, resource, 0, want), "cuDevSmResourceSplitByCount"
        )
        if count < 1 or int(remainder.sm.smCount) < 1:
            raise GreenContextError(
                f"splitting {want} of {self.total_sms} SMs gave {count} group(s), remainder {remainder.sm.smCount}"
            )
        self.comm_sms = int(groups[0].sm.smCount)
        self.compute_sms = int(remainder.sm.smCount)
        self.comm_context = self._create(dev, groups[0])
        self.compute_context = self._create(dev, remainder)

    def _create(self, dev: Any, resource: Any) -> Any:
        driver = self._driver
        desc = _checked(driver, driver.cuDevResourceGenerateDesc([resource], 1), "cuDevResourceGenerateDesc")
        flags = int(driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
        context = _checked(driver, driver.cuGreenCtxCreate(desc, dev, flags), "cuGreenCtxCreate")
        self._contexts.append(context)
        return context

    def stream(self, context: Any) -> torch.cuda.Stream:
        """A non-blocking driver stream on ``context``, wrapped for torch and tied to this owner."""
        driver = self._driver
        flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
        handle = _checked(driver, driver.cuGreenCtxStreamCreate(context, flags, 0), "cuGreenCtxStreamCreate")
        self._streams.append(handle)
        stream = torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", self._device_index))
        stream._ubatch_green_owner = self  # the context must outlive the stream
        stream._ubatch_green_context = context
        return stream

    def beside(self, stream: torch.cuda.Stream) -> torch.cuda.Stream:
        """A second stream on ``stream``'s context (``ubatch.streams.beside_stream``), made once."""
        other = self._beside.get(stream.cuda_stream)
        if other is None:
            other = self._beside[stream.cuda_stream] = self.stream(stream._ubatch_green_context)
        return other

    def __del__(self) -> None:
        driver = self._driver
        with contextlib.suppress(Exception):  # interpreter shutdown may have unloaded the driver
            for handle in self._streams:
                driver.cuStreamSynchronize(handle)
                driver.cuStreamDestroy(handle)
            for context in self._contexts:
                driver.cuGreenCtxDestroy(context)


_KEPT_GREEN: dict[tuple[int, int | None, int], _GreenContexts] = {}
"""Green context pairs by (driver, device, comm SMs), made once and kept for the process, with
every stream made on them: each partition of that size shares them. Why: destroying a pair (and
its streams) while the caching allocator may still hold blocks used on those streams, then
making another, crashed a bench process on the H200 that swept several ``@greenK`` modes."""


class SMPartition:
    """How ubatch compute and communication share the GPU's SMs; see the module docstring.

    ``comm_sms`` (default ``DEFAULT_COMM_SMS``) is the SM budget of communication: the comm
    partition's size in "green" mode (rounded up to the driver's split granularity), the NCCL CTA
    cap and the cuBLAS carveout in "cooperative" mode. ``prefill_comm_sms`` / ``decode_comm_sms``
    override it for one phase.
    """

    def __init__(
        self,
        mode: str = "none",
        comm_sms: int | None = None,
        device: torch.device | str | int | None = None,
        *,
        prefill_comm_sms: int | None = None,
        decode_comm_sms: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown SM partition mode {mode!r}; modes: {', '.join(MODES)}")
        self.mode = mode
        self.device = _resolve_device(device)
        total = _device_sm_count(self.device)
        base = DEFAULT_COMM_SMS if comm_sms is None else _validated_sms("comm_sms", comm_sms, total)
        self._phase_sms = {
            None: base,
            "prefill": base
            if prefill_comm_sms is None
            else _validated_sms("prefill_comm_sms", prefill_comm_sms, total),
            "decode": base if decode_comm_sms is None else _validated_sms("decode_comm_sms", decode_comm_sms, total),
        }
        self.total_sms = total
        self.reason = ""
        self._effective = mode
        self._green: dict[int, _GreenContexts] = {}
        self._groups: dict[tuple[Any, int], Any] = {}
        self._setup_mode()

    @property
    def effective_mode(self) -> str:
        """The mode in force: the requested one, or "none" after a degrade (see ``reason``)."""
        return self._effective

    def comm_sms_for(self, phase: str | None = None) -> int:
        """The requested SM budget of communication for ``phase`` (None: the default)."""
        if phase not in self._phase_sms:
            raise ValueError(f"unknown phase {phase!r}; phases: None, {', '.join(PHASES)}")
        return self._phase_sms[phase]

    def partition_sms(self, phase: str | None = None) -> tuple[int, int] | None:
        """(compute SMs, comm SMs) the driver actually gave in "green" mode, else None."""
        green = self._green.get(self.comm_sms_for(phase)) if self._effective == "green" else None
        return None if green is None else (green.compute_sms, green.comm_sms)

    def make_streams(self, num_ubatches: int, phase: str | None = None) -> tuple[list[Any] | None, Any]:
        """One compute stream per ubatch and the comm stream, on this mode's partitions.

        On a non-CUDA device there are no streams: ``(None, None)``, which is what
        ``UBatchScheduler(compute_streams=..., comm_stream=...)`` takes as "make none".
        """
        if not isinstance(num_ubatches, int) or isinstance(num_ubatches, bool) or num_ubatches < 1:
            raise ValueError(f"num_ubatches must be an int >= 1, got {num_ubatches!r}")
        sms = self.comm_sms_for(phase)
        if self.device.type != "cuda":
            return None, None
        if self._effective == "green":
            green = self._green[sms]
            try:
                return [green.stream(green.compute_context) for _ in range(num_ubatches)], green.stream(
                    green.comm_context
                )
            except RuntimeError as exc:  # GreenContextError included
                self._degrade(f"creating green-context streams failed: {exc}")
        return ubatch_streams(self.device, num_ubatches)

    def comm_group(self, group: Any = None, phase: str | None = None) -> Any:
        """The process group overlapped collectives should use.

        "cooperative": a dedicated NCCL communicator over the same ranks with CTAs capped at
        ``min(comm_sms, NCCL_MAX_CTAS_LIMIT)``, created at the first call for each (group, cap) and
        cached. Creating it is collective: ``dist.new_group`` must be called by every rank of the
        default group, in the same order, so call ``setup(groups)`` at start-up on every rank
        (never first inside a CUDA-graph capture: that raises). For all-to-all / send-recv, NCCL
        takes its P2P channel limit from ``NCCL_MAX_P2P_NCHANNELS``; it is set to the cap while the
        communicator is created and connected, then restored. NCCL caches that variable process-wide
        at its first read, so it binds only if no earlier communicator read it; recent NCCL also
        bounds P2P channels by ``max_ctas``. Other modes, gloo groups and runs without a process
        group: ``group`` unchanged.
        """
        cap = min(self.comm_sms_for(phase), NCCL_MAX_CTAS_LIMIT)
        if self._effective != "cooperative" or not dist.is_initialized():
            return group
        if "nccl" not in str(dist.get_backend(group)).lower():
            return group
        key = (group, cap)
        if key not in self._groups:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "SMPartition.comm_group would create an NCCL communicator inside a CUDA-graph "
                    "capture; call SMPartition.setup(groups) on every rank before capturing"
                )
            self._groups[key] = _new_capped_group(group, cap, self.device)
            logger.info("SMPartition: dedicated NCCL communicator with max_ctas=%d created", cap)
        return self._groups[key]

    def setup(self, groups: Iterable[Any] = (None,)) -> None:
        """Create every phase's dedicated communicator for ``groups`` now (collective: all ranks)."""
        for group in groups:
            for phase in (None, *PHASES):
                self.comm_group(group, phase)

    def carveout_for(self, phase: str | None = None) -> int | None:
        """SMs that persistent GEMMs (cuBLAS, torch's CUTLASS grouped GEMM) must leave unused
        during a ubatched step, or None for no carveout.

        "cooperative": ``comm_sms``, room for the collectives' CTAs. "green": every SM outside the
        compute partition. Those kernels size their grid to the device's SM count; on a smaller
        partition the CTAs past it run as a second wave, and a persistent kernel's CTA that waits
        for a second wave holds the whole GEMM (measured on 2 H200s: a split step's expert GEMMs
        took 84% longer beside NCCL kernels without a carveout, 14% on the green partition with it).
        """
        if self._effective == "cooperative":
            return self.comm_sms_for(phase)
        sms = self.partition_sms(phase)
        return None if sms is None else self.total_sms - sms[0]

    @contextlib.contextmanager
    def compute_context(self, phase: str | None = None) -> Iterator[None]:
        """Launch compute inside: GEMMs leave ``carveout_for(phase)`` SMs unused (see there).

        The carveout is process-wide torch state (not per stream or thread), so wrap a whole step,
        not one ubatch; the previous value is restored on exit.
        """
        carveout = self.carveout_for(phase)
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
        if carveout is None or setter is None or getter is None:
            yield
            return
        previous = getter()
        setter(carveout)
        try:
            yield
        finally:
            setter(previous)

    def self_check(self, size: int = 8192) -> bool:
        """Are the green partitions (every phase's) real, eagerly and in graph replay? Degrade if not.

        A bf16 GEMM on the comm partition must run materially slower than on the compute one
        (at least 2x when the compute partition has >= 3x the SMs; proportionally less when it is
        smaller). Call it once at start-up, before ``make_streams``; other modes pass.
        """
        for green in list(self._green.values()) if self._effective == "green" else []:
            if not self._check_partition(green, size):
                return False
        return True

    def _check_partition(self, green: _GreenContexts, size: int) -> bool:
        expected = green.compute_sms / green.comm_sms
        threshold = min(2.0, 1.0 + 0.5 * (expected - 1.0))
        if threshold < 1.1:
            logger.info(
                "SMPartition self-check inconclusive: %d vs %d SMs are too close to tell apart",
                green.compute_sms,
                green.comm_sms,
            )
            return True
        try:
            fast, slow, graphed = _gemm_times(green, size, self.device)
        except RuntimeError as exc:  # GreenContextError included
            self._degrade(f"self-check failed to run: {exc}")
            return False
        logger.info(
            "SMPartition self-check: GEMM %.2f ms on %d SMs, %.2f ms on %d SMs (%.2f ms in graph replay); "
            "need >= %.2fx",
            fast,
            green.compute_sms,
            slow,
            green.comm_sms,
            graphed,
            threshold,
        )
        if slow < threshold * fast or graphed < threshold * fast:
            self._degrade(
                f"self-check: a GEMM on the {green.comm_sms}-SM partition took {slow:.2f} ms eager and "
                f"{graphed:.2f} ms replayed vs {fast:.2f} ms on {green.compute_sms} SMs (< {threshold:.2f}x): "
                "the partition is not real"
            )
            return False
        return True

    def _setup_mode(self) -> None:
        if self.mode == "none":
            return
        problem = self._unsupported()
        if problem:
            self._degrade(problem)
        elif self.mode == "green":
            self._build_green()

    def _unsupported(self) -> str:
        """Why the requested mode cannot run here ("" if it can)."""
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return f"device {self.device} is not a CUDA device"
        if self.mode == "cooperative":
            if not (dist.is_available() and dist.is_nccl_available()):
                return "torch.distributed has no NCCL backend"
            return ""
        capability = torch.cuda.get_device_capability(self.device)
        if capability < MIN_CAPABILITY:
            return f"compute capability {capability[0]}.{capability[1]} < 9.0"
        try:
            driver = _load_driver()
        except ImportError as exc:
            return f"cuda.bindings is not installed ({exc})"
        try:
            version = _checked(driver, driver.cuDriverGetVersion(), "cuDriverGetVersion")
        except RuntimeError as exc:  # GreenContextError, or libcuda missing
            return str(exc)
        if version < MIN_DRIVER_VERSION:
            return f"the driver supports CUDA {version // 1000}.{version % 1000 // 10} < 12.4"
        return ""

    def _build_green(self) -> None:
        _activate_primary_context(self.device)
        driver = _load_driver()
        try:
            for sms in sorted(set(self._phase_sms.values())):
                key = (id(driver), self.device.index, sms)
                if key not in _KEPT_GREEN:
                    _KEPT_GREEN[key] = _GreenContexts(driver, self.device.index, sms)
                green = self._green[sms] = _KEPT_GREEN[key]
                logger.info(
                    "SMPartition green: %d compute SMs, %d comm SMs (requested %d of %d)",
                    green.compute_sms,
                    green.comm_sms,
                    sms,
                    green.total_sms,
                )
        except (RuntimeError, AttributeError) as exc:  # AttributeError: bindings older than the API
            self._degrade(f"green contexts: {exc}")

    def _degrade(self, reason: str) -> None:
        if self._effective == "none":
            return
        logger.warning("SMPartition: mode %r falls back to 'none': %s", self.mode, reason)
        self._effective = "none"
        self.reason = reason
        self._green.clear()  # streams already handed out keep their contexts alive


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type == "cuda" and resolved.index is None and torch.cuda.is_available():
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _activate_primary_context(device: torch.device) -> None:
    """Green contexts retain the primary context; have torch create it first (cuGreenCtxCreate docs)."""
    torch.zeros(1, device=device)


def _device_sm_count(device: torch.device) -> int | None:
    """The device's SM count, or None where there is no CUDA device to ask."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _validated_sms(name: str, value: Any, total: int | None) -> int:
    """``value`` if it is an int in [1, total - 1] (upper bound unchecked when total is unknown)."""
    upper = "the device's SM count - 1" if total is None else str(total - 1)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int in [1, {upper}], got {value!r} ({type(value).__name__})")
    if value < 1 or (total is not None and value >= total):
        raise ValueError(f"{name}={value} is out of range: it must be in [1, {upper}]")
    return value


@contextlib.contextmanager
def _scoped_env(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _new_capped_group(group: Any, cap: int, device: torch.device) -> Any:
    """A new NCCL group over ``group``'s ranks with ``max_ctas=cap``, connected before returning.

    The tiny all-reduce makes NCCL create the communicator now, while the P2P channel variable is
    set, whether torch initialises communicators eagerly or at the first collective.
    """
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = cap
    with _scoped_env(P2P_CHANNELS_ENV, str(cap)):
        new = dist.new_group(ranks=ranks, backend="nccl", pg_options=options)
        if dist.get_rank() in ranks:
            dist.all_reduce(torch.zeros(1, device=device), group=new)
            torch.cuda.synchronize(device)
    return new


def _gemm_times(green: _GreenContexts, size: int, device: torch.device) -> tuple[float, float, float]:
    """ms of one bf16 GEMM on the compute partition, on the comm partition, and replayed there."""
    fast_stream, slow_stream = green.stream(green.compute_context), green.stream(green.comm_context)
    with torch.cuda.device(device):
        a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        torch.cuda.synchronize(device)
        fast = _time_on(fast_stream, lambda: a @ b)
        slow = _time_on(slow_stream, lambda: a @ b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=slow_stream):
            a @ b
        graphed = _time_on(slow_stream, graph.replay)
    return fast, slow, graphed


def _time_on(stream: Any, fn: Any, repeats: int = 3) -> float:
    """Median ms of ``fn`` on ``stream`` (after one warm-up, which also makes its cuBLAS handle)."""
    times = []
    with torch.cuda.stream(stream):
        fn()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
