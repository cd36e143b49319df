"""The CUDA transport replayed on CPU: a runtime that records stream and event calls instead of running them,
the checks that the recorded order is race-free (check_protocol: streamed weights; check_activations: the CPU
path's activations), and the transports and activation links a load builds, captured."""

from __future__ import annotations

import torch


class _Stream:
    def __init__(self, name):
        self.name = name


class _Event:
    def __init__(self):
        self.version = 0  # how many times it was recorded


class RecordingRuntime:
    """Stands in for CudaRuntime on CPU: copies run at once, stream/event calls are logged in the
    order the two threads made them, for `check_protocol` to replay."""

    def __init__(self, device):
        import threading

        self.device = device
        self.compute = _Stream("compute")
        self.log: list[tuple] = []
        self.skip_record = None  # set by a test to break the protocol on purpose
        self.skip_host_wait = None  # the same, for the host's waits
        self._lock = threading.Lock()

    def stream(self):
        return _Stream("copy")

    def event(self, timing=False):
        return _Event()

    def current_stream(self):
        return self.compute

    def device_bytes(self, n):
        return torch.empty(n, dtype=torch.uint8)

    def pinned_bytes(self, n):
        return torch.empty(n, dtype=torch.uint8)

    def copy(self, dst, src, stream):
        dst.copy_(src)
        with self._lock:
            self.log.append(("copy", stream.name, dst.data_ptr(), src.data_ptr()))

    def wait(self, stream, event):
        with self._lock:
            self.log.append(("wait", stream.name, event, event.version))

    def record(self, event, stream):
        if self.skip_record is not None and self.skip_record(event):
            return
        with self._lock:
            event.version += 1
            self.log.append(("record", stream.name, event, event.version))

    def host_wait(self, event):
        if self.skip_host_wait is not None and self.skip_host_wait(event):
            return
        with self._lock:
            self.log.append(("host_wait", "host", event, event.version))

    def synchronize(self):
        pass

    def release(self):
        pass

    def copy_gbps(self, dst, src):
        return None


def check_protocol(t, log) -> int:
    """Replay the log and prove, for every copy, that the device could not overwrite a buffer a
    kernel may still read, nor read one before its copy landed. Returns the number of copies."""
    dev = {buf.data_ptr(): i for i, buf in enumerate(t._dev)}
    stage = {buf.data_ptr(): i for i, buf in enumerate(t._stage)}
    freed = {id(e): i for i, e in enumerate(t._freed)}
    ready = {id(e): i for i, e in enumerate(t._ready)}
    staged = {id(e): i for i, e in enumerate(t._staged)}
    n = len(t._dev)
    copy_saw_freed = [0] * n  # version of free[b] the copy stream last waited on
    freed_version = [0] * n
    in_use = [False] * n  # activated and not yet retired
    landed = [False] * n  # ready[b] recorded after the last copy into b
    host_saw_staged = [0] * len(t._stage)
    staged_version = [0] * len(t._stage)
    copies = 0
    for kind, stream, obj, arg in log:
        if kind == "copy":
            b = dev[obj]
            assert stream == "copy", "host->device copies must run on the copy stream"
            assert not in_use[b], f"copy into buffer {b} while a block in it was not retired"
            assert copy_saw_freed[b] == freed_version[b], f"copy into buffer {b} does not wait for its last free"
            if arg in stage:
                s = stage[arg]
                assert host_saw_staged[s] == staged_version[s], f"staging {s} refilled before its DMA finished"
            landed[b] = False
            copies += 1
        elif kind == "wait" and stream == "copy" and id(obj) in freed:
            copy_saw_freed[freed[id(obj)]] = arg
        elif kind == "wait" and stream == "compute" and id(obj) in ready:
            b = ready[id(obj)]
            # The wait binds to ready[b]'s latest record, which `landed` says follows the last copy.
            assert landed[b], f"compute on buffer {b} does not wait for its copy"
            in_use[b] = True
        elif kind == "record" and id(obj) in ready:
            assert stream == "copy"
            landed[ready[id(obj)]] = True
        elif kind == "record" and id(obj) in freed:
            b = freed[id(obj)]
            assert stream == "compute", "free events mark the end of kernels: they belong on the compute stream"
            freed_version[b] = arg
            in_use[b] = False
        elif kind == "record" and id(obj) in staged:
            staged_version[staged[id(obj)]] = arg
        elif kind == "host_wait" and id(obj) in staged:
            host_saw_staged[staged[id(obj)]] = arg
    return copies


def check_activations(link, log) -> tuple[int, int]:
    """Replay an activation link's log (engine/weights/transports/activations.py) and prove each crossing ordered:
    a device -> host copy reads its inputs only after the compute stream's kernels that made them (the copy stream
    waited on `computed` as last recorded there), and lands in staging the host took the last crossing out of;
    the host reaches for what landed (its next call: the result going back) only after waiting on `down_landed`;
    the host refills the "up" staging only after the last copy out of it finished (its wait on `up_landed`), a
    host -> device copy writes only after the compute stream's earlier kernels (memory the allocator handed out),
    and the compute stream waits for it to land before the next crossing starts. Every copy is on the copy stream,
    from or into the pinned staging. Returns (device -> host copies, host -> device copies)."""
    down = (link._down.data_ptr(), link._down.data_ptr() + link.capacity)
    up = (link._up.data_ptr(), link._up.data_ptr() + link.capacity)
    computed, down_landed, up_landed = id(link._computed), id(link._down_landed), id(link._up_landed)
    version = {computed: 0, down_landed: 0, up_landed: 0}  # the latest record of each event
    copy_saw_computed = 0
    used_computed = 0  # the record of `computed` the last crossing's copies were ordered behind
    host_saw = {down_landed: 0, up_landed: 0}
    down_pending = False  # copies into "down" since its last down_landed record
    up_pending = False  # a copy out of "up" whose up_landed record the compute stream has not waited on
    up_landed_after_copy = True
    d2h = h2d = 0
    for kind, stream, obj, arg in log:
        if kind == "copy":
            assert stream == "copy", "activations cross on the copy stream"
            dst, src = obj, arg
            if down[0] <= dst < down[1]:
                assert copy_saw_computed == version[computed], "device -> host copy before the inputs' kernels"
                if not down_pending:  # the crossing's first copy
                    assert host_saw[down_landed] == version[down_landed], \
                        "pinned 'down' staging refilled before the host took the last crossing out of it"
                    assert version[computed] > used_computed, "device -> host copy behind a stale `computed`"
                    used_computed = version[computed]
                down_pending = True
                d2h += 1
            else:
                assert up[0] <= src < up[1], "a crossing's copy neither into nor out of the pinned staging"
                assert copy_saw_computed == version[computed] > used_computed, \
                    "host -> device copy into memory kernels may use"
                used_computed = version[computed]
                assert host_saw[up_landed] == version[up_landed], \
                    "pinned 'up' staging refilled before its last host -> device copy finished"
                up_pending, up_landed_after_copy = True, False
                h2d += 1
        elif kind == "record":
            key = id(obj)
            if key == computed:
                assert stream == "compute", "`computed` marks the compute stream's kernels"
                assert not up_pending, "a crossing started before the compute stream waited for the last result"
            elif key == down_landed:
                assert stream == "copy" and down_pending, "down_landed belongs behind the copies into 'down'"
                down_pending = False
            elif key == up_landed:
                assert stream == "copy"
                up_landed_after_copy = True
            if key in version:
                version[key] = arg
        elif kind == "wait" and id(obj) == computed:
            assert stream == "copy"
            copy_saw_computed = arg
        elif kind == "wait" and id(obj) == up_landed:
            assert stream == "compute" and up_landed_after_copy, "compute uses the result before it landed"
            up_pending = False
        elif kind == "host_wait" and id(obj) in host_saw:
            if id(obj) == up_landed:  # to_device's first call: the host is done computing from what landed
                assert host_saw[down_landed] == version[down_landed], \
                    "the host used the crossing's inputs before they landed"
            host_saw[id(obj)] = arg
    assert not up_pending and not down_pending, "a crossing left unfinished"
    return d2h, h2d


def record_activation_links(monkeypatch) -> list:
    """Every CUDA activation link the engine builds from now on, on the recording runtime (check_activations)."""
    import engine.weights.transports.activations as act

    monkeypatch.setattr(act, "CudaRuntime", RecordingRuntime)
    made = []

    class Captured(act.CudaActivationLink):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(act, "CudaActivationLink", Captured)
    return made


def capture_cuda_transports(monkeypatch) -> list:
    """Every CudaTransport the engine builds from now on, in order: the protocol checks (check_protocol) read a
    transport's own buffers and events, which no public interface shows (nor should)."""
    import engine.weights.transports.cuda as ct

    made = []

    class Captured(ct.CudaTransport):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(ct, "CudaTransport", Captured)
    return made


def record_cuda_experts(monkeypatch) -> tuple[list, list]:
    """The CUDA transport and the CUDA expert slots on the recording runtime (copies happen at once, stream
    and event calls are logged for check_protocol): (the expert slots made, the block transports made)."""
    import engine.weights.experts.cuda_slots as ce
    import engine.weights.transports.cuda as ct

    monkeypatch.setattr(ct, "CudaRuntime", RecordingRuntime)
    monkeypatch.setattr(ce, "CudaRuntime", RecordingRuntime)
    made = []

    class Captured(ce.CudaExpertSlots):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(ce, "CudaExpertSlots", Captured)
    return made, capture_cuda_transports(monkeypatch)
