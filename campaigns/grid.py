"""The binding grid: one `vtengine serve` per arm, closed-loop legs through the load generator, arms interleaved.

Protocol (DESIGN.md §5, the `vllm bench serve` protocol): for rep r and concurrency c, both arms serve the same
prompt partition (random token ids of exact length, its sha256 recorded); partitions are disjoint across (c, r);
arm order alternates per rep (A B, B A, ...) to cancel drift; warm-up requests (at least the leg's concurrency)
precede each leg; a leg is valid only when every request completed with exactly output_len tokens and
output_len - 1 ITLs. GPU clocks and temperature are sampled during each leg (pynvml). Evidence is written by the
caller after every leg, so a killed campaign resumes.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx

from campaigns import loadgen
from campaigns.evidence import Arm, LegResult, utc_now

SERVER_START_TIMEOUT_S = 900


class GridError(RuntimeError):
    pass


@dataclass
class ServerHandle:
    arm: str
    url: str
    proc: subprocess.Popen
    model_name: str
    log_path: str


def server_command(model: str, quant: str, lever_values: dict, *, backend: str | None, gpu_util: float | None,
                   max_num_seqs: int, triton_kernels: list[str] | None = None, max_model_len: int | None = None,
                   fault_injection: bool = False) -> list[str]:
    """``vtengine serve`` for one arm: ``lever_values`` are set by --lever (they win over any inherited VT_*);
    ``fault_injection`` opens the deliberate-fault endpoint the gates' self-checks use."""
    cmd = [sys.executable, "-m", "vtengine.cli", "serve", "--model", model, "--quant", quant, "--port", "0",
           "--max-num-seqs", str(max_num_seqs)]
    for lever, value in lever_values.items():
        value_text = "off" if value is False else ("on" if value is True else str(value))
        cmd += ["--lever", f"{lever}={value_text}"]
    if fault_injection:
        cmd.append("--fault-injection")
    cmd.append("--exit-with-parent")        # a campaign killed even by SIGKILL takes its servers with it
    if backend:
        cmd += ["--backend", backend]
    if gpu_util:
        cmd += ["--gpu-memory-utilization", str(gpu_util)]
    if triton_kernels:
        cmd += ["--triton-kernels", ",".join(triton_kernels)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd


def start_server(arm: Arm, cmd: list[str], log_path: str, env: dict[str, str],
                 timeout_s: float = SERVER_START_TIMEOUT_S) -> ServerHandle:
    """Start a server and wait (at most ``timeout_s``, even if it prints nothing) for its ready line; its output
    goes to log_path. On any failure or interruption while starting, the process is killed: never an orphan."""
    return _await_ready(_launch(arm, cmd, log_path, env), timeout_s)


@dataclass
class _Launch:
    arm: Arm
    proc: subprocess.Popen
    ready: queue.Queue
    log_path: str
    log_start: int = 0          # where this start's output begins in the (appended) log


def _launch(arm: Arm, cmd: list[str], log_path: str, env: dict[str, str]) -> _Launch:
    # appended, one header per start: a resumed campaign (or the next block of legs) keeps the earlier servers' logs
    log = open(log_path, "a")
    log.write(f"==== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting the {arm.name!r} server: {' '.join(cmd)}\n")
    log.flush()
    start = log.tell()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        write_pid_file(_pid_file(log_path), proc.pid, cmd)
    except BaseException:       # not yet among the launches the caller stops: never an orphan
        _kill(proc)
        log.close()
        raise
    ready: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_drain, args=(proc, log, ready), daemon=True).start()
    return _Launch(arm, proc, ready, log_path, start)


# ----------------------------------------------------------------------------------------------- pid files
# Each server's pid sits in the campaign directory while it runs (server-<arm>.pid), so a campaign killed with
# SIGKILL (no chance to stop its servers; they also exit with their parent, see vtengine serve --exit-with-parent)
# leaves a trace its resume uses to stop any that survived.


def _pid_file(log_path: str) -> Path:
    return Path(log_path).with_suffix(".pid")


def write_pid_file(path: Path, pid: int, cmd: list[str]) -> None:
    path.write_text(json.dumps({"pid": pid, "cmd": cmd}) + "\n")


def _alive(pid: int, cmd: list[str]) -> bool:
    """Whether ``pid`` is still that process (its command line, not a recycled pid)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:len(cmd)] == [c.encode() for c in cmd]
    except OSError:
        return True                 # no /proc: the pid exists, trust it


def stop_stale_servers(campaign_dir: Path | str, timeout_s: float = 30.0) -> list[int]:
    """Stop the servers an earlier run of this campaign left behind (their pid files), and remove the files.
    Returns the pids that were still running."""
    stopped = []
    for path in sorted(Path(campaign_dir).glob("server-*.pid")):
        try:
            info = json.loads(path.read_text())
            pid, cmd = int(info["pid"]), list(info["cmd"])
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)
            continue
        if _alive(pid, cmd):
            stopped.append(pid)
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _alive(pid, cmd) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _alive(pid, cmd):
                os.kill(pid, signal.SIGKILL)
        path.unlink(missing_ok=True)
    return stopped


def _await_ready(launch: _Launch, timeout_s: float = SERVER_START_TIMEOUT_S) -> ServerHandle:
    arm, proc, log_path = launch.arm, launch.proc, launch.log_path
    try:
        try:
            url = launch.ready.get(timeout=timeout_s)
            if not url:                     # its output ended: the exit status lands a moment after the EOF
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        except queue.Empty:
            url = None
        if not url:
            why = f"exited with {proc.poll()}" if proc.poll() is not None else f"not ready after {timeout_s:.0f} s"
            with open(log_path) as f:       # this start's output: an earlier start's error is not this one's
                f.seek(launch.log_start)
                tail = f.read()[-2000:]
            raise GridError(f"the {arm.name!r} server did not start ({why}); log {log_path}:\n{tail}")
        info = loadgen.get_model_info(url)
        return ServerHandle(arm.name, url, proc, info.get("id") or info.get("model") or "", log_path)
    except BaseException:
        _kill(proc)
        raise


def _drain(proc: subprocess.Popen, log, ready: queue.Queue) -> None:
    """Copy the server's output into its log (so the pipe never fills) and hand over the URL of its ready line."""
    announced = False
    for line in proc.stdout:
        log.write(line)
        log.flush()
        if not announced and "ready at " in line:
            ready.put(line.split("ready at ", 1)[1].split()[0])
            announced = True
    log.close()
    if not announced:
        ready.put("")               # exited before it was ready


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the server's whole session (it runs in its own: start_new_session), then a bounded wait. A
    process stuck in the GPU driver may outlive the wait: that is reported, not raised, so the servers after it are
    still stopped."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        print(f"server pid {proc.pid} did not exit 30 s after SIGKILL (stuck in the driver?)", file=sys.stderr)


def stop_servers(handles: list[ServerHandle], timeout_s: float = 30.0) -> None:
    """SIGTERM to every server first, then wait for them all, SIGKILL to any still running after ``timeout_s``: the
    arms' shutdowns overlap rather than add up. Interrupted while waiting, it kills the rest: never an orphan."""
    for h in handles:
        if h.proc.poll() is None:
            try:                # the server's whole session: a process it started goes with it
                os.killpg(h.proc.pid, signal.SIGTERM)
            except OSError:
                h.proc.terminate()
    deadline = time.monotonic() + timeout_s
    try:
        for h in handles:
            try:
                h.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                _kill(h.proc)
    finally:
        for h in handles:
            _kill(h.proc)
            _pid_file(h.log_path).unlink(missing_ok=True)


@contextmanager
def servers(arms: list[Arm], make_cmd: Callable[[Arm], list[str]], log_dir: str, env: dict[str, str],
            on_start: Callable[[str], None] | None = None) -> Iterator[dict[str, ServerHandle]]:
    """Every arm's server, started once and always stopped (also on Ctrl-C or a failed leg). The servers start
    side by side (a model build and graph capture each: about half a minute per 8B arm on the H200)."""
    launches: list[_Launch] = []
    handles: dict[str, ServerHandle] = {}
    try:
        for arm in arms:
            if on_start:
                on_start(arm.name)
            launches.append(_launch(arm, make_cmd(arm), os.path.join(log_dir, f"server-{arm.name}.log"), env))
        for launch in launches:
            handles[launch.arm.name] = _await_ready(launch)
        yield handles
    finally:
        for launch in launches:
            if launch.arm.name not in handles:
                _kill(launch.proc)
                _pid_file(launch.log_path).unlink(missing_ok=True)
        stop_servers(list(handles.values()))


def server_info(url: str, timeout_s: float = 30.0) -> dict:
    """What a server reports of itself on /metrics: every lever's resolved value, the kernels that ran (launch
    counters), and its build info (model, quant, dtype, device, versions). A series the campaign records that the
    server does not expose (renamed, removed) is a GridError naming it, never an empty context."""
    import re
    try:
        resp = httpx.get(f"{url}/metrics", timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError as e:
        raise GridError(f"cannot read {url}/metrics for the arm's context: {type(e).__name__}: {e}") from None
    text = resp.text
    wanted = ("vtengine_lever_info", "vtengine_build_info", "vtengine_kernel_launches_total")
    absent = [name for name in wanted if not re.search(rf"^# TYPE {name} ", text, re.M)]
    if absent:
        raise GridError(f"{url}/metrics does not expose {', '.join(absent)}: the arm's context cannot be recorded")

    def labels(body: str) -> dict[str, str]:
        # name="value" pairs in any order (prometheus-client sorts them); values escape \\, \" and \n
        unescape = {"n": "\n"}
        return {k: re.sub(r"\\(.)", lambda m: unescape.get(m.group(1), m.group(1)), v)
                for k, v in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', body)}

    series = re.compile(rf'^({"|".join(wanted)})\{{((?:[^"}}]|"(?:[^"\\]|\\.)*")*)\}} (\S+)$', re.M)
    levers: dict[str, str] = {}
    build: dict[str, str] = {}
    ran: dict[str, float] = {}
    for name, body, value in series.findall(text):
        lab = labels(body)
        if name == "vtengine_lever_info" and float(value) == 1:
            levers[lab["lever"]] = lab["value"]
        elif name == "vtengine_build_info" and float(value) == 1:
            build = lab
        elif name == "vtengine_kernel_launches_total":
            ran[lab["kernel"]] = ran.get(lab["kernel"], 0.0) + float(value)
    for name, found in (("vtengine_lever_info", levers), ("vtengine_build_info", build)):
        if not found:
            raise GridError(f"{url}/metrics has no {name} series: the arm's context cannot be recorded")
    return {"levers": levers, "kernels_ran": {k for k, n in ran.items() if n > 0}, "build": build}


def peak_memory_gib(url: str, timeout_s: float = 30.0) -> float:
    """The server's peak GPU memory (``vtengine_peak_gpu_memory_bytes``; 0 on CPU) in GiB. A server that does not
    expose it, or whose /metrics cannot be read, is a GridError naming the metric, never a silent 0."""
    name = "vtengine_peak_gpu_memory_bytes"
    try:
        resp = httpx.get(f"{url}/metrics", timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError as e:
        raise GridError(f"cannot read {url}/metrics for {name}: {type(e).__name__}: {e}") from None
    vals = loadgen.parse_prometheus(resp.text)
    if name not in vals:
        raise GridError(f"{url}/metrics does not expose {name}: the arm's peak memory cannot be recorded")
    return round(vals[name] / 2**30, 3)


def visible_gpu(environ=None) -> str:
    """The physical GPU that CUDA calls device 0 here, as NVML names it: the first entry of CUDA_VISIBLE_DEVICES (an
    index or a GPU-/MIG- UUID), "0" when unset. NVML ignores CUDA_VISIBLE_DEVICES, so a sweep job that sees one
    GPU of a host must ask NVML for that GPU, not for NVML's first (vLLM maps its devices the same way)."""
    environ = os.environ if environ is None else environ
    first = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first or "0"


def nvml_handle(nv, environ=None):
    """The NVML handle of ``visible_gpu``: by index, or by UUID."""
    gpu = visible_gpu(environ)
    return nv.nvmlDeviceGetHandleByIndex(int(gpu)) if gpu.isdigit() else nv.nvmlDeviceGetHandleByUUID(gpu)


class GpuSampler:
    """Samples SM clock, memory clock, temperature and power every ``period_s`` while a leg runs (pynvml)."""

    def __init__(self, period_s: float = 0.5):
        self.period_s, self.samples, self._stop = period_s, [], threading.Event()
        self._nvml = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, nvml_handle(pynvml)
        except Exception:       # no NVIDIA driver (CPU host): nothing to sample
            self._nvml = None

    def _loop(self):
        nv, t0 = self._nvml, time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append({
                    "t_s": round(time.monotonic() - t0, 3),
                    "sm_clock_mhz": float(nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM)),
                    "mem_clock_mhz": float(nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_MEM)),
                    "temp_c": float(nv.nvmlDeviceGetTemperature(self._handle, nv.NVML_TEMPERATURE_GPU)),
                    "power_w": nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0,
                })
            except Exception:
                break
            self._stop.wait(self.period_s)

    def __enter__(self):
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._nvml is not None:
            self._thread.join(timeout=5)


def leg_plan(arms: list[Arm], concurrency: list[int], reps: int, alternate: bool,
             by_arm: bool = False) -> list[tuple[int, int, Arm]]:
    """(concurrency, rep, arm) in run order: every concurrency per rep, the arms' order flipped on odd reps.

    ``by_arm``: the order of one-server-at-a-time residency: per rep, each arm's legs at every concurrency as one
    block, so a block of one arm that ends a rep and the block of the same arm that starts the next share a server
    (A | B B | A A | B ...: reps + 1 server starts for two arms, not 2 x reps)."""
    plan = []
    for rep in range(reps):
        order = list(arms) if (not alternate or rep % 2 == 0) else list(reversed(arms))
        if by_arm:
            plan += [(c, rep, arm) for arm in order for c in concurrency]
        else:
            plan += [(c, rep, arm) for c in concurrency for arm in order]
    return plan


# what a server's log says when the GPU's memory share could not hold the model and a KV cache (the engine's
# ConfigError, or torch's allocator): the one failure that running the arms one at a time can cure
OUT_OF_MEMORY = ("no room for the KV cache", "CUDA out of memory", "OutOfMemoryError")


def out_of_memory(error: str) -> bool:
    """Whether a GridError is a server that did not start because its memory share was too small."""
    return "did not start" in error and any(sign in error for sign in OUT_OF_MEMORY)


def prompt_partitions(grid, vocab_range: tuple[int, int]) -> tuple[dict[tuple[int, int], list[list[int]]],
                                                                     list[list[int]]]:
    """Disjoint prompt sets per (concurrency, rep) sliced from one seeded pool, plus the warm-up prompts.

    There are at least ``warmup_requests`` warm-up prompts and at least the largest concurrency, so that a leg's
    warm-up can fill its batch (see ``warmup_for``). The first ``warmup_requests`` open the pool and the extra ones
    close it, so the measured partitions do not depend on the grid's concurrencies beyond their own."""
    sizes = [(c, r, int(n)) for r in range(int(grid.reps)) for c, n in zip(grid.concurrency, grid.prompts_per_leg)]
    base = int(grid.warmup_requests)
    extra = max(0, max(int(c) for c in grid.concurrency) - base) if base > 0 else 0
    total = sum(n for _, _, n in sizes) + base + extra
    pool = loadgen.make_prompts(total, int(grid.input_len), int(grid.seed), vocab_range)
    parts, at = {}, base
    for c, r, n in sizes:
        parts[(c, r)] = pool[at:at + n]
        at += n
    return parts, pool[:base] + pool[at:]


def output_len_partitions(grid) -> dict[tuple[int, int], int | list[int]]:
    """Each leg's requested output lengths, (concurrency, rep) -> one int for all its requests, or (with
    ``grid.output_len_range``) each request's own: drawn once per concurrency from the grid's seed and the same in
    every rep, so the reps of a point stay replicates (the same work, in the same order) and both arms, and a
    resumed campaign, ask for the same lengths."""
    reps = range(int(grid.reps))
    ratio = float(getattr(grid, "output_len_range", 0.0) or 0.0)
    if ratio == 0.0:
        return {(int(c), r): int(grid.output_len) for r in reps for c in grid.concurrency}
    sizes = [(int(c), int(n)) for c, n in zip(grid.concurrency, grid.prompts_per_leg)]
    pool = loadgen.make_output_lens(sum(n for _, n in sizes), int(grid.output_len), ratio, int(grid.seed))
    parts, at = {}, 0
    for c, n in sizes:
        parts.update({(c, r): pool[at:at + n] for r in reps})
        at += n
    return parts


def warmup_for(warmup: list[list[int]], concurrency: int, warmup_requests: int) -> list[list[int]]:
    """A leg's warm-up: ``max(warmup_requests, concurrency)`` requests (none when warmup_requests is 0), run at the
    leg's concurrency so the server has run this batch size before the clock starts. With two warm-up requests only,
    the first leg at c=8 also paid the first batches of 3 to 8 sequences (JIT compiles, cuBLAS heuristics): on the
    H200 the baseline's first c=8 leg ran 20-25% below its other reps in three campaigns of 2026-11-30."""
    if warmup_requests <= 0:
        return []
    return warmup[:max(warmup_requests, concurrency)]


def run_leg(h: ServerHandle, arm: Arm, c: int, rep: int, order_index: int, prompts: list[list[int]],
            warmup: list[list[int]], output_len: int | list[int]) -> LegResult:
    started = utc_now()
    with GpuSampler() as sampler:
        m = loadgen.run_leg(h.url, h.model_name, prompts, output_len, c, warmup_prompts=warmup or None)
    return LegResult.from_loadgen(m.to_dict(), rep=rep, arm=arm.name, order_index=order_index, started=started,
                                  ended=utc_now(), gpu_samples=sampler.samples[-240:])
